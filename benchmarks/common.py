"""What every benchmark part shares: services, statistics, figures, the table and the JSON file.

A *figure* is one number the suite reports, always with what it is compared
against: a floor (the bare round trip), a peer (a naive transaction, dramatiq's
limiter), a baseline (Celery without a cap) or an ideal (limit / duration).
Comparisons are ratios of two things measured side by side in the same run,
interleaved, so that the noise of a shared machine hits both; each figure is
the median over repeats, and its per-repeat values go to the JSON file.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import sqlalchemy as sa

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

#: Service URLs: ``CAPS_BENCH_*`` first, then the test suite's ``CAPS_TEST_*``, then this machine's services.
SERVICE_DEFAULTS = {
    "postgres": (
        "CAPS_BENCH_POSTGRES_URL",
        "CAPS_TEST_POSTGRES_URL",
        "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    ),
    "mysql": ("CAPS_BENCH_MYSQL_URL", "CAPS_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"),
    "redis": ("CAPS_BENCH_REDIS_URL", "CAPS_TEST_REDIS_URL", "redis://127.0.0.1:6379/12"),
    "amqp": ("CAPS_BENCH_AMQP_URL", "CAPS_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//"),
}

#: This run's name for what it creates on shared servers; inherited by the processes it starts,
#: so that they use the same databases, and different from any other run's, so that two runs
#: at once (two checkouts measured side by side) never drop each other's databases.
BENCH_RUN = os.environ.setdefault("CAPS_BENCH_RUN", uuid.uuid4().hex[:8])

#: The SQL databases the benchmarks create next to the configured one: an almost empty
#: one and one holding 10,000 slot names, so the two can be measured side by side.
BENCH_DATABASES = {"main": f"caps_bench_{BENCH_RUN}", "keys": f"caps_bench_keys_{BENCH_RUN}"}


def service_url(name: str) -> str:
    """The URL of service ``name`` (see :data:`SERVICE_DEFAULTS`)."""
    bench_variable, test_variable, default = SERVICE_DEFAULTS[name]
    return os.environ.get(bench_variable) or os.environ.get(test_variable) or default


def reachable(url: str, timeout: float = 1.0) -> str | None:
    """None if ``url``'s server accepts a TCP connection, else why not."""
    parts = urlsplit(url)
    ports = {"postgresql": 5432, "mysql": 3306, "redis": 6379, "amqp": 5672}
    port = parts.port or ports.get(parts.scheme.split("+", 1)[0], 0)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", port), timeout=timeout).close()
    except OSError as exc:
        return f"{parts.scheme}://{parts.hostname}:{port} unreachable: {exc}"
    return None


def drop_bench_databases(server_url: str) -> None:
    """Drop this run's benchmark databases on ``server_url``'s server (a run starts and ends
    with none: nothing of an earlier run, or of another version's schema, is measured)."""
    drop_databases(server_url, BENCH_DATABASES.values())


def drop_databases(server_url: str, names: Iterable[str]) -> None:
    """Drop the databases ``names`` (if they exist) on ``server_url``'s server."""
    url = sa.engine.make_url(server_url)
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            for name in names:
                if url.get_backend_name() == "postgresql":
                    connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                else:
                    connection.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        engine.dispose()


def bench_database_url(server_url: str, variant: str, *, name: str | None = None) -> str:
    """``server_url`` pointed at the benchmark database of ``variant`` (or ``name``), created if
    missing."""
    url = sa.engine.make_url(server_url)
    name = name or BENCH_DATABASES[variant]
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            if url.get_backend_name() == "postgresql":
                exists = connection.execute(
                    sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
                ).first()
                if not exists:
                    connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
            else:
                connection.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS `{name}`")
    finally:
        engine.dispose()
    return url.set(database=name).render_as_string(hide_password=False)


def new_run_id() -> str:
    """A short unique prefix for everything one benchmark run creates."""
    return f"bench{uuid.uuid4().hex[:8]}"


# -- statistics ----------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``values`` (linear interpolation); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Iterable[float]) -> float:
    clean = [value for value in values if value is not None and not math.isnan(value)]
    return statistics.median(clean) if clean else math.nan


def ratio(numerator: float, denominator: float) -> float:
    if denominator in (0, None) or numerator is None or math.isnan(numerator) or math.isnan(denominator):
        return math.nan
    return numerator / denominator


def ms(seconds: float) -> float:
    return seconds * 1000.0


# -- figures -------------------------------------------------------------------------


@dataclass
class Figure:
    """One reported number, what it is compared against, and whether it meets its target."""

    part: str
    name: str
    value: float
    unit: str
    #: What the value is compared against, e.g. "naive FOR UPDATE p50 0.91 ms".
    versus: str = ""
    #: value / the compared value (or the stated ratio), median over repeats.
    ratio: float | None = None
    #: The issue's target, e.g. "<= 0.5 ms"; empty when there is none.
    target: str = ""
    met: bool | None = None
    #: Per-repeat values (of ``value``) and anything else worth keeping.
    repeats: list[float] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


class Report:
    """The figures of one run, printed as a table and written as JSON."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.figures: list[Figure] = []
        self.notes: list[str] = []
        self.started = time.time()
        self.args = args
        self.machine = machine_description()

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        return figure

    def note(self, text: str) -> None:
        self.notes.append(text)

    def to_json(self) -> dict[str, Any]:
        return {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "duration_seconds": round(time.time() - self.started, 1),
            "arguments": self.args,
            "machine": self.machine,
            "load_average_end": list(os.getloadavg()),
            "notes": self.notes,
            "figures": [_clean(asdict(figure)) for figure in self.figures],
        }

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n")

    def print_table(self, parts: Sequence[str] | None = None) -> None:
        from rich.console import Console
        from rich.table import Table

        console = Console(width=200)
        table = Table(title="celery-caps benchmarks", show_lines=False)
        for column, justify in (
            ("part", "left"),
            ("figure", "left"),
            ("value", "right"),
            ("compared with", "left"),
            ("ratio", "right"),
            ("target", "left"),
            ("met", "center"),
        ):
            table.add_column(column, justify=justify)  # type: ignore[arg-type]
        previous = None
        for figure in self.figures:
            if parts is not None and figure.part not in parts:
                continue
            if previous is not None and figure.part != previous:
                table.add_section()
            previous = figure.part
            met = "" if figure.met is None else ("[green]yes[/]" if figure.met else "[red]NO[/]")
            table.add_row(
                figure.part,
                figure.name,
                format_value(figure.value, figure.unit),
                figure.versus,
                "" if figure.ratio is None or math.isnan(figure.ratio) else f"{figure.ratio:.2f}",
                figure.target,
                met,
            )
        console.print(table)
        for note in self.notes:
            console.print(f"note: {note}")

    def markdown_table(self) -> str:
        return markdown_table(self.figures)


def markdown_table(figures: Sequence[Figure]) -> str:
    """The figures as a Markdown table (for the README)."""
    lines = [
        "| part | figure | value | compared with | ratio | target | met |",
        "| --- | --- | ---: | --- | ---: | --- | :---: |",
    ]
    for figure in figures:
        met = "" if figure.met is None else ("yes" if figure.met else "**no**")
        ratio_text = "" if figure.ratio is None or math.isnan(figure.ratio) else f"{figure.ratio:.2f}"
        lines.append(
            f"| {figure.part} | {figure.name} | {format_value(figure.value, figure.unit)} | "
            f"{figure.versus} | {ratio_text} | {figure.target} | {met} |"
        )
    return "\n".join(lines)


def figures_from_json(path: Path) -> list[Figure]:
    """The figures of a results file (null values read back as NaN)."""
    figures = []
    for item in json.loads(path.read_text())["figures"]:
        item["value"] = math.nan if item["value"] is None else item["value"]
        figures.append(Figure(**item))
    return figures


def _clean(value: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else round(value, 6)
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(item) for item in value]
    return value


def format_value(value: float, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if unit == "ms":
        return f"{value:.3f} ms" if value < 10 else f"{value:.1f} ms"
    if unit == "/s":
        return f"{value:,.0f}/s" if value >= 100 else f"{value:.1f}/s"
    if unit == "s":
        return f"{value:.2f} s"
    if unit in ("x", "ratio"):
        return f"{value:.2f}"
    if unit == "count":
        return f"{value:,.0f}"
    return f"{value:.2f} {unit}".strip()


def at_most(value: float, limit: float) -> bool | None:
    return None if math.isnan(value) else value <= limit


def at_least(value: float, limit: float) -> bool | None:
    return None if math.isnan(value) else value >= limit


# -- the machine -----------------------------------------------------------------------


class CpuSteal:
    """How much of the machine's CPU time the hypervisor gave to others from this object's
    creation to :meth:`fraction` (the ``steal`` column of Linux's ``/proc/stat``, over all
    columns).

    On a shared virtual machine that is the noise a figure cannot correct for: a trial whose
    steal is a few percent ran on a quiet host, one at 15% did not.  NaN where there is no
    ``/proc/stat``.
    """

    def __init__(self) -> None:
        self._before = self._read()

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat", encoding="ascii") as stat:
                columns = [int(value) for value in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        steal = columns[7] if len(columns) > 7 else 0
        return steal, sum(columns)

    def fraction(self) -> float:
        after = self._read()
        if self._before is None or after is None or after[1] == self._before[1]:
            return math.nan
        return (after[0] - self._before[0]) / (after[1] - self._before[1])


def _command(args: Sequence[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=20, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _service_version(name: str, probe: Callable[[], str]) -> str:
    try:
        return probe()
    except Exception as exc:  # a missing service is reported, not fatal
        return f"unavailable ({type(exc).__name__})"


def machine_description() -> dict[str, Any]:
    """What the figures were measured on: CPUs, Python, library and service versions, load."""
    import celery
    import kombu
    import redis

    def postgres() -> str:
        engine = sa.create_engine(service_url("postgres"))
        try:
            with engine.connect() as connection:
                return str(connection.exec_driver_sql("SHOW server_version").scalar())
        finally:
            engine.dispose()

    def mysql() -> str:
        engine = sa.create_engine(service_url("mysql"))
        try:
            with engine.connect() as connection:
                return str(connection.exec_driver_sql("SELECT VERSION()").scalar())
        finally:
            engine.dispose()

    def redis_server() -> str:
        client = redis.Redis.from_url(service_url("redis"), socket_connect_timeout=1)
        try:
            return str(client.info("server")["redis_version"])
        finally:
            client.close()

    def rabbitmq() -> str:
        text = _command(["rabbitmqctl", "version"])
        return text.splitlines()[0] if text else "unknown"

    lscpu = _command(["lscpu"]).splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lscpu if line.startswith("Model name")), "")
    return {
        "nproc": _command(["nproc"]),
        "cpu_model": model,
        "lscpu_head": lscpu[:10],
        "memory": _command(["sh", "-c", "free -g | sed -n 2p"]),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "sqlalchemy": sa.__version__,
        "redis_py": redis.__version__,
        "postgresql": _service_version("postgres", postgres),
        "mariadb": _service_version("mysql", mysql),
        "redis": _service_version("redis", redis_server),
        "rabbitmq": _service_version("amqp", rabbitmq),
        "load_average_start": list(os.getloadavg()),
    }


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@dataclass
class Options:
    """What ``run.py`` was asked for, handed to every part."""

    quick: bool
    rounds: int
    stores: list[str]
    run_prefix: str
    tmp_dir: Path
    #: Stores the worker benchmarks (overhead, utilisation) run on.
    overhead_stores: list[str] = field(default_factory=lambda: ["postgresql", "redis"])
    utilisation_stores: list[str] = field(default_factory=lambda: ["postgresql"])
    #: Waiting strategies the utilisation part measures (keys of ``utilisation.STRATEGIES``; None: all).
    utilisation_strategies: list[str] | None = None
    #: How long the utilisation part's tasks sleep, ms (None: ``utilisation.TASK_MS``).
    utilisation_task_ms: int | None = None
    verbose: bool = True

    def log(self, text: str) -> None:
        if self.verbose:
            print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)
