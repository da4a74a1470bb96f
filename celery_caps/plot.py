"""The timeline picture: slot occupancy over time against each limit (matplotlib, optional).

Install with ``pip install "celery-caps[plot]"``.  Used by ``celery caps timeline``;
matplotlib is imported only here, and only when a picture is drawn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from .errors import MissingDependencyError
from .history import Occupancy


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError(
            f'the timeline picture needs matplotlib: pip install "celery-caps[plot]" ({exc})'
        ) from exc
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as pyplot

    return pyplot


def draw_timeline(
    series: Sequence[Occupancy],
    limits: Mapping[str, int | None],
    deferrals: Mapping[str, Sequence[float]],
    since: float,
    now: float,
    path: str,
    waiting: Mapping[str, Occupancy] | None = None,
) -> None:
    """Draw one panel per slot: its occupancy as steps, its limit as a dashed line, the tasks
    waiting for it (``waiting``) as a second line, and a mark at the limit for each put-back it
    caused; write the figure to ``path``."""
    pyplot = _pyplot()
    from matplotlib import dates

    panels = max(len(series), 1)
    figure, axes = pyplot.subplots(panels, 1, figsize=(11, 1.2 + 1.6 * panels), sharex=True, squeeze=False)
    for axis, occupancy in zip(axes[:, 0], series, strict=False):
        times = [datetime.fromtimestamp(moment) for moment, _ in occupancy.steps]
        levels = [level for _, level in occupancy.steps]
        axis.step(times, levels, where="post", color="tab:blue", linewidth=1.6, label="holders")
        axis.fill_between(times, levels, step="post", color="tab:blue", alpha=0.15)
        limit = limits.get(occupancy.slot)
        waiters = (waiting or {}).get(occupancy.slot)
        top = max([occupancy.peak, limit or 0, waiters.peak if waiters else 0, 1])
        if waiters is not None:
            wait_times = [datetime.fromtimestamp(moment) for moment, _ in waiters.steps]
            axis.step(
                wait_times, [level for _, level in waiters.steps], where="post", color="tab:orange",
                linewidth=1.2, label="waiting",
            )  # fmt: skip
        if limit is not None:
            axis.axhline(limit, color="tab:red", linestyle="--", linewidth=1.2, label=f"limit {limit}")
        marks = [datetime.fromtimestamp(moment) for moment in deferrals.get(occupancy.slot, ())]
        if marks:
            axis.plot(marks, [limit or top] * len(marks), "x", color="tab:orange", markersize=5, label="put back")
        axis.set_ylim(0, top * 1.25 + 0.2)
        # A slot name is data: never read as math text (a key holding "$" would fail or be rendered).
        axis.set_ylabel(occupancy.slot, rotation=0, ha="right", va="center", fontsize=9, parse_math=False)
        axis.yaxis.get_major_locator().set_params(integer=True)
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend(loc="upper left", fontsize=7, ncol=3, frameon=False)
    axis = axes[-1, 0]
    axis.set_xlim(datetime.fromtimestamp(since), datetime.fromtimestamp(now))
    axis.xaxis.set_major_formatter(dates.DateFormatter("%H:%M:%S"))  # type: ignore[no-untyped-call]
    figure.suptitle("celery-caps: slot occupancy (distinct tasks holding each slot)", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
