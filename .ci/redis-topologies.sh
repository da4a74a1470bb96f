#!/usr/bin/env bash
# Start or stop the Redis topologies the tests run on besides a single Redis: a 3-master Redis
# Cluster and a Sentinel set (one master, one replica, three sentinels), as local redis-server
# processes on loopback ports.  Idempotent: `start` leaves running topologies as they are (after a
# failover test the replica may be the master: still one master named caps-master), `stop` stops
# whatever of them runs.  Used by .ci/run; a developer runs it the same way:
#
#     .ci/redis-topologies.sh start      # prints the two export lines for the tests
#     eval "$(.ci/redis-topologies.sh env)"
#     .ci/redis-topologies.sh stop
#
# Ports (override with CAPS_REDIS_TOPOLOGY_BASE_PORT, default 7300): cluster base+1..base+3,
# Sentinel master base+11, replica base+12, sentinels base+21..base+23.  Files (configuration,
# logs, the sentinels' rewritten configuration) live in a temporary directory named in
# $STATE (removed by `stop`).
set -euo pipefail

BASE=${CAPS_REDIS_TOPOLOGY_BASE_PORT:-7300}
CLUSTER_PORTS=($((BASE + 1)) $((BASE + 2)) $((BASE + 3)))
MASTER_PORT=$((BASE + 11))
REPLICA_PORT=$((BASE + 12))
SENTINEL_PORTS=($((BASE + 21)) $((BASE + 22)) $((BASE + 23)))
MASTER_NAME=caps-master
STATE=${TMPDIR:-/tmp}/caps-redis-topologies-${BASE}.dir
DEADLINE_SECONDS=${CAPS_SERVICE_DEADLINE_SECONDS:-60}

say() { printf '[redis-topologies %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }
cli() { timeout 5 redis-cli -h 127.0.0.1 -p "$1" "${@:2}" 2>/dev/null; }
answers() { [[ "$(cli "$1" ping)" == PONG ]]; }
wait_for() {  # wait_for DESCRIPTION COMMAND...: until COMMAND succeeds, or die after the deadline
    local what=$1 deadline=$((SECONDS + DEADLINE_SECONDS))
    shift
    until "$@"; do
        ((SECONDS < deadline)) || die "$what not ready after ${DEADLINE_SECONDS} s (logs in $(workdir))"
        sleep 0.2
    done
}
workdir() {
    if [[ -f "$STATE" && -d "$(cat "$STATE")" ]]; then
        cat "$STATE"
    else
        local dir
        dir=$(mktemp -d "${TMPDIR:-/tmp}/caps-redis-topologies.XXXXXX")
        echo "$dir" >"$STATE"
        echo "$dir"
    fi
}

server() {  # server PORT [extra config lines...]: start a redis-server on PORT unless one answers
    local port=$1 dir
    shift
    answers "$port" && return 0
    dir="$(workdir)/$port"
    mkdir -p "$dir"
    {
        printf 'port %s\nbind 127.0.0.1\ndaemonize yes\ndir %s\nlogfile %s/redis.log\n' "$port" "$dir" "$dir"
        printf 'pidfile %s/redis.pid\nsave ""\nappendonly no\n' "$dir"
        printf '%s\n' "$@"
    } >"$dir/redis.conf"
    redis-server "$dir/redis.conf" >/dev/null
    wait_for "redis-server on port $port" answers "$port"
}

cluster_ok() { cli "${CLUSTER_PORTS[0]}" cluster info | grep -q '^cluster_state:ok'; }

start_cluster() {
    local port
    for port in "${CLUSTER_PORTS[@]}"; do
        server "$port" "cluster-enabled yes" "cluster-config-file nodes.conf" "cluster-node-timeout 2000"
    done
    if ! cluster_ok; then
        if [[ "$(cli "${CLUSTER_PORTS[0]}" cluster info | grep '^cluster_known_nodes:' | tr -dc 0-9)" == 1 ]]; then
            say "creating the cluster on ports ${CLUSTER_PORTS[*]}"
            redis-cli --cluster create "${CLUSTER_PORTS[@]/#/127.0.0.1:}" --cluster-replicas 0 --cluster-yes >/dev/null
        fi
        wait_for "the Redis Cluster" cluster_ok
    fi
    say "Redis Cluster up: ${CLUSTER_PORTS[*]}"
}

sentinels_know_master() {
    local port
    for port in "${SENTINEL_PORTS[@]}"; do
        [[ -n "$(cli "$port" sentinel get-master-addr-by-name "$MASTER_NAME")" ]] || return 1
        # every sentinel sees the other two and the replica
        [[ "$(cli "$port" sentinel master "$MASTER_NAME" | grep -A1 -x num-other-sentinels | tail -1)" == 2 ]] || return 1
        [[ "$(cli "$port" sentinel master "$MASTER_NAME" | grep -A1 -x num-slaves | tail -1)" == 1 ]] || return 1
    done
}

start_sentinel() {
    local port running=0
    for port in "$MASTER_PORT" "$REPLICA_PORT" "${SENTINEL_PORTS[@]}"; do
        answers "$port" && running=$((running + 1))
    done
    if ((running == 5)) && sentinels_know_master; then
        say "Redis Sentinel up (running already): master $MASTER_NAME, sentinels ${SENTINEL_PORTS[*]}"
        return 0
    fi
    server "$MASTER_PORT"
    server "$REPLICA_PORT" "replicaof 127.0.0.1 $MASTER_PORT"
    for port in "${SENTINEL_PORTS[@]}"; do
        answers "$port" && continue
        local dir
        dir="$(workdir)/$port"
        mkdir -p "$dir"
        # A sentinel rewrites its own configuration file: it must be writable and its own.
        cat >"$dir/sentinel.conf" <<CONF
port $port
bind 127.0.0.1
daemonize yes
dir $dir
logfile $dir/sentinel.log
pidfile $dir/sentinel.pid
sentinel monitor $MASTER_NAME 127.0.0.1 $MASTER_PORT 2
sentinel down-after-milliseconds $MASTER_NAME 1000
sentinel failover-timeout $MASTER_NAME 5000
sentinel parallel-syncs $MASTER_NAME 1
CONF
        redis-server "$dir/sentinel.conf" --sentinel >/dev/null
        wait_for "sentinel on port $port" answers "$port"
    done
    wait_for "the sentinels' view of $MASTER_NAME" sentinels_know_master
    say "Redis Sentinel up: master $MASTER_NAME, sentinels ${SENTINEL_PORTS[*]}"
}

print_env() {
    local sentinels=() port
    for port in "${SENTINEL_PORTS[@]}"; do
        sentinels+=("sentinel://127.0.0.1:$port")
    done
    local joined
    joined=$(IFS=';'; echo "${sentinels[*]}")
    echo "export CAPS_TEST_REDIS_CLUSTER_URL='redis+cluster://127.0.0.1:${CLUSTER_PORTS[0]},127.0.0.1:${CLUSTER_PORTS[1]}'"
    echo "export CAPS_TEST_REDIS_SENTINEL_URL='${joined}?master_name=$MASTER_NAME'"
}

stop_all() {
    local port
    for port in "${SENTINEL_PORTS[@]}" "$REPLICA_PORT" "$MASTER_PORT" "${CLUSTER_PORTS[@]}"; do
        if answers "$port"; then
            cli "$port" shutdown nosave >/dev/null || true
        fi
    done
    for port in "${SENTINEL_PORTS[@]}" "$REPLICA_PORT" "$MASTER_PORT" "${CLUSTER_PORTS[@]}"; do
        wait_for "port $port to stop" bash -c "! timeout 2 redis-cli -h 127.0.0.1 -p $port ping >/dev/null 2>&1"
    done
    if [[ -f "$STATE" ]]; then
        rm -rf "$(cat "$STATE")" "$STATE"
    fi
    say "stopped"
}

case ${1:-} in
    start)
        command -v redis-server >/dev/null || die "redis-server is not installed"
        start_cluster
        start_sentinel
        print_env
        ;;
    stop) stop_all ;;
    env) print_env ;;
    *)
        echo "usage: $0 start|stop|env" >&2
        exit 2
        ;;
esac
