"""Running a sweep: plan which units are pending, then run their tasks into the results file."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from reasonkv.harness.sweep.grid import Grid, GridError
from reasonkv.harness.sweep.log import ResultsLog, done_keys, git_info
from reasonkv.harness.sweep.pool import Pool, RayPool, SerialPool, dispatch
from reasonkv.harness.sweep.units import Task, Unit, expand, make_tasks
from reasonkv.util.runtime import env_threads


@dataclass
class SweepPlan:
    units: list[Unit]
    pending: list[Unit]
    tasks: list[Task]
    done: int
    stray: int
    """Records in the results file that belong to no unit of this grid (kept, not counted)."""
    dropped_tail: int = 0
    """Bytes of a partial last line (an interrupted write) cut off the file on opening."""
    unreadable: int = 0
    """Complete lines that are not records (ignored: their units, if any, run again)."""


def plan(grid: Grid, log_records: list[dict], retry_errors: bool = False) -> SweepPlan:
    units = expand(grid)
    keys = {u.key for u in units}
    done = done_keys(log_records, retry_errors) & keys
    pending = [u for u in units if u.key not in done]
    stray = len({r["key"] for r in log_records} - keys)
    return SweepPlan(units, pending, make_tasks(pending), len(done), stray)


@dataclass
class SweepStats:
    total: int
    skipped: int
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_sweep(
    grid: Grid,
    out: str | Path,
    *,
    workers: int = 1,
    ray_address: str | None = None,
    threads: int | None = None,
    retry_errors: bool = False,
    pool: Pool | None = None,
    on_start: Callable[[SweepPlan], None] | None = None,
    on_records: Callable[[list[dict]], None] | None = None,
) -> SweepStats:
    """Run every unit of `grid` whose key `out` does not hold yet, appending one line per
    unit. workers=1 without ray_address runs in this process; otherwise on Ray. threads:
    torch threads per worker (default: REASONKV_THREADS, else cores // workers)."""
    if workers < 1:
        raise GridError(f"workers must be at least 1, got {workers}")
    if threads is None:
        threads = env_threads() or max(1, (os.cpu_count() or 1) // workers)
    with ResultsLog(out) as log:
        the_plan = plan(grid, log.records, retry_errors)
        the_plan.dropped_tail, the_plan.unreadable = log.dropped_tail, log.unreadable
        stats = SweepStats(total=len(the_plan.units), skipped=the_plan.done)
        if on_start is not None:
            on_start(the_plan)
        if not the_plan.tasks:
            return stats
        git = git_info()
        own_pool = pool is None
        if pool is None:
            pool = (
                SerialPool(1, threads)
                if workers == 1 and ray_address is None
                else RayPool(workers, threads, ray_address)
            )
        start = time.perf_counter()

        def on_done(task: Task, records: list[dict]) -> None:
            for record in records:
                record["git"] = git
                log.append(record)
                if record["status"] == "ok":
                    stats.ok += 1
                else:
                    stats.failed += 1
                    c = record["config"]
                    stats.errors.append(f"{c['model']} {c['item']} {_label(c)}: {record['error']}")
            if on_records is not None:  # once per task: a progress bar's rate sees tasks, not bursts
                on_records(records)

        try:
            dispatch(the_plan.tasks, pool, on_done)
        finally:
            stats.seconds = time.perf_counter() - start
            if own_pool:
                pool.close()
    return stats


def _label(config: dict) -> str:
    return config["method"] if config.get("budget") is None else f"{config['method']}@{config['budget']}"
