"""Progress in a log: plain lines at start, at each tenth, at least once a minute, at the end."""

from __future__ import annotations

import io

from rich.console import Console

from reasonkv.util.progress import LineProgress, progress_for


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lines(buffer: io.StringIO) -> list[str]:
    return buffer.getvalue().splitlines()


def test_line_progress_prints_each_tenth_and_the_end():
    buffer, clock = io.StringIO(), Clock()
    console = Console(file=buffer, width=200)
    with LineProgress(console, clock=clock) as progress:
        task = progress.add_task("replaying", total=100)
        for _ in range(100):
            clock.now += 1.0
            progress.advance(task, 1)
    out = lines(buffer)
    assert len(out) == 1 + 10  # started, then 10 %, 20 %, ..., 100 %
    assert "replaying: 0/100 (0%)" in out[0] and out[0].endswith("started")
    assert "10/100 (10%)" in out[1] and "0m10s elapsed" in out[1] and "ETA 1m30s" in out[1]
    assert "100/100 (100%)" in out[-1] and out[-1].endswith("done")


def test_line_progress_speaks_once_a_minute_when_slow_and_says_where_it_stopped():
    buffer, clock = io.StringIO(), Clock()
    progress = LineProgress(Console(file=buffer, width=200), clock=clock)
    task = progress.add_task("sweep", total=1000, completed=5, failed=0)
    for _ in range(3):  # 3 units, 70 s apart: under a tenth each time
        clock.now += 70.0
        progress.update(task, advance=1, failed=1)
    progress.stop()
    out = lines(buffer)
    assert len(out) == 1 + 3 + 1
    assert all("failed 1" in line for line in out[1:4])
    assert "8/1000" in out[-1] and out[-1].endswith("stopped")


def test_a_big_jump_prints_one_line_not_one_per_tenth_skipped():
    buffer, clock = io.StringIO(), Clock()
    progress = LineProgress(Console(file=buffer, width=200), clock=clock)
    task = progress.add_task("eval", total=10)
    progress.update(task, completed=7)
    progress.update(task, completed=8)
    counts = [line.split(": ")[1].split(",")[0] for line in lines(buffer)]
    assert counts == ["0/10 (0%)", "7/10 (70%)", "8/10 (80%)"]


def test_progress_for_picks_a_live_bar_only_on_a_terminal():
    assert isinstance(progress_for(Console(file=io.StringIO())), LineProgress)
    assert not isinstance(progress_for(Console(file=io.StringIO(), force_terminal=True)), LineProgress)
