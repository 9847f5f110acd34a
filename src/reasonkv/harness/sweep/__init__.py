"""Resumable sweeps: a grid of models × methods × budgets × datasets × seeds, run unit by
unit into a JSONL file that survives Ctrl-C and kill -9.

Modules, in the order a sweep uses them: `grid` (the file format and its checks), `units`
(one result line each, keyed by a hash of its config, grouped into tasks), `log` (the
flock'd, append-only results file), `tasks` (what a worker does with a task), `pool` (the
worker in this process or on Ray, and the dispatcher) and `run` (plan, then run_sweep).
"""

from reasonkv.harness.sweep.grid import (
    KINDS,
    SETTINGS,
    DatasetSpec,
    Grid,
    GridError,
    grid_summary,
    load_grid,
    parse_grid,
)
from reasonkv.harness.sweep.log import ResultsLog, done_keys, git_info, read_results, versions
from reasonkv.harness.sweep.pool import Pool, RayPool, SerialPool, SweepWorker, dispatch, resolve_loader
from reasonkv.harness.sweep.run import SweepPlan, SweepStats, plan, run_sweep
from reasonkv.harness.sweep.tasks import error_record, eval_task, replay_task
from reasonkv.harness.sweep.units import Task, Unit, expand, make_tasks, unit_key

__all__ = [
    "KINDS",
    "SETTINGS",
    "DatasetSpec",
    "Grid",
    "GridError",
    "Pool",
    "RayPool",
    "ResultsLog",
    "SerialPool",
    "SweepPlan",
    "SweepStats",
    "SweepWorker",
    "Task",
    "Unit",
    "dispatch",
    "done_keys",
    "error_record",
    "eval_task",
    "expand",
    "git_info",
    "grid_summary",
    "load_grid",
    "make_tasks",
    "parse_grid",
    "plan",
    "read_results",
    "replay_task",
    "resolve_loader",
    "run_sweep",
    "unit_key",
    "versions",
]
