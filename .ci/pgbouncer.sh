# PgBouncer (Debian's package) in front of the test PostgreSQL server, for the tests that run
# through a connection pooler.  Sourced by .ci/run; usable by hand too:
#   source .ci/pgbouncer.sh && pgbouncer_start transaction 17432 /tmp/pgb-tx
# starts one pgbouncer in the given pool mode on 127.0.0.1:PORT, forwarding every database
# name to 127.0.0.1:5432 as the connecting user (trust, as the test server), with its ini file,
# log and pid file in DIR.  Stop it with: kill "$(cat DIR/pgbouncer.pid)".

pgbouncer_up() { pg_isready -q -h 127.0.0.1 -p "$1" -U postgres -d test -t 3; }

pgbouncer_start() {
    local mode=$1 port=$2 dir=$3
    mkdir -p "$dir"
    # Pool sizes are PgBouncer's defaults: 20 server connections per database and user.
    cat >"$dir/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
pool_mode = $mode
auth_type = trust
auth_file = $dir/userlist.txt
max_client_conn = 1000
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
INI
    printf '"postgres" ""\n"root" ""\n' >"$dir/userlist.txt"
    local as_user=()
    if [[ $(id -u) == 0 ]]; then  # PgBouncer refuses to run as root
        chown -R postgres "$dir"
        as_user=(-u postgres)
    fi
    "${PGBOUNCER:-/usr/sbin/pgbouncer}" -d "${as_user[@]}" "$dir/pgbouncer.ini"
}
