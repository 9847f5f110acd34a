"""Progress that shows in a log as well as on a terminal.

On a terminal: rich's live bar. Anywhere else (a pipe, a file, CI) a live bar draws nothing
until the end, so `LineProgress` prints one plain, timestamped line when a task starts,
each time it passes another tenth of its total, at least once a minute while it moves, and
when it ends. Both take the calls the commands make: add_task, advance, update, tasks, stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn


def _clock_text(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


@dataclass
class LineTask:
    description: str
    total: float | None
    completed: float = 0.0
    fields: dict = field(default_factory=dict)
    started: float = 0.0
    next_mark: float = 0.1
    last_line: float = 0.0


class LineProgress:
    """rich.progress.Progress's calls, printed as plain lines (see the module docstring)."""

    def __init__(
        self, console: Console, every_fraction: float = 0.1, every_seconds: float = 60.0, clock=time.monotonic
    ) -> None:
        self.console = console
        self.every_fraction = every_fraction
        self.every_seconds = every_seconds
        self.clock: Callable[[], float] = clock
        self.tasks: list[LineTask] = []
        self._stopped = False

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **fields) -> int:
        now = self.clock()
        task = LineTask(description, total, float(completed), dict(fields), now, self.every_fraction, now)
        self.tasks.append(task)
        self._skip_marks(task)
        self._line(task, "started")
        return len(self.tasks) - 1

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(
        self,
        task_id: int,
        *,
        advance: float | None = None,
        completed: float | None = None,
        description: str | None = None,
        total: float | None = None,
        **fields,
    ) -> None:
        task = self.tasks[task_id]
        task.fields.update(fields)
        if description is not None:
            task.description = description
        if total is not None:
            task.total = total
        if completed is not None:
            task.completed = float(completed)
        if advance:
            task.completed += advance
        now = self.clock()
        fraction = self._fraction(task)
        if fraction is not None and fraction >= task.next_mark:
            self._skip_marks(task)
            self._line(task, "done" if fraction >= 1 else "")
        elif (advance or completed is not None) and now - task.last_line >= self.every_seconds:
            self._line(task, "")

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for task in self.tasks:  # a task left unfinished says where it stopped
            fraction = self._fraction(task)
            if fraction is None or fraction < 1:
                self._line(task, "stopped")

    def _fraction(self, task: LineTask) -> float | None:
        return task.completed / task.total if task.total else None

    def _skip_marks(self, task: LineTask) -> None:
        fraction = self._fraction(task)
        while fraction is not None and task.next_mark <= fraction and task.next_mark <= 1:
            task.next_mark += self.every_fraction

    def _line(self, task: LineTask, state: str) -> None:
        now = self.clock()
        task.last_line = now
        elapsed = now - task.started
        done = f"{task.completed:g}"
        if task.total:
            fraction = task.completed / task.total
            done += f"/{task.total:g} ({100 * fraction:.0f}%)"
        parts = [f"{time.strftime('%H:%M:%S')} {task.description}: {done}", f"{_clock_text(elapsed)} elapsed"]
        if task.total and 0 < task.completed < task.total and elapsed > 0:
            parts.append(f"ETA {_clock_text(elapsed * (task.total - task.completed) / task.completed)}")
        parts += [f"{k} {v}" for k, v in task.fields.items()]
        if state:
            parts.append(state)
        self.console.print(escape(", ".join(parts)), soft_wrap=True, highlight=False)


def progress_for(
    console: Console, *columns: ProgressColumn, transient: bool = False
) -> Progress | LineProgress:
    """A live bar when `console` is a terminal, plain lines otherwise."""
    if not console.is_terminal:
        return LineProgress(console)
    columns = columns or (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    return Progress(*columns, console=console, transient=transient)
