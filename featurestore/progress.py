"""Progress bars for long work: what is done, how fast, how long is left (on stderr)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import duckdb
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class RateColumn(ProgressColumn):
    """``12,345 rows/s`` once there is a rate to show."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        return Text(f"{task.speed:,.0f} {self.unit}/s" if task.speed else "", style="progress.data.speed")


def progress_bar(unit: str, enabled: bool = True, percent: bool = False) -> Progress:
    """A bar with counts and a rate in ``unit``/s (or a percentage), elapsed time and ETA."""
    counts = [TextColumn("{task.percentage:>3.0f}%")] if percent else [MofNCompleteColumn(), RateColumn(unit)]
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        *counts,
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=True,
    )


@contextlib.contextmanager
def query_progress(con: duckdb.DuckDBPyConnection, bar: Progress, task: TaskID) -> Iterator[None]:
    """While the block runs a DuckDB query on ``con``, show the query's own progress (0-100) on ``task``."""
    if bar.disable:
        yield
        return
    con.execute("SET enable_progress_bar = true; SET enable_progress_bar_print = false")
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.2):
            done = con.query_progress()
            if done >= 0:
                bar.update(task, completed=done)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
