"""Units and tasks: what a sweep runs, and how units group into tasks for the workers.

Units. A unit is one JSON line of the results: (model, dataset, item, method, budget,
knobs, seed, settings), where item is one trace (replay) or one problem (eval). Its key is
a hash of that config (`unit_key`), so a rerun skips exactly the units already written.
The config holds a hash of the item's text (`input_sha`): an edited trace is a new unit.

Tasks. Workers run tasks, not units. An eval task is one unit. A replay task is every
pending unit of one (model, trace, settings): `replay_batch` teacher-forces the trace
once and every method shares the full-cache reference (share_reference = false makes each
unit its own task: finer resume, twice the forwards). batch_traces = true instead makes a
task of every pending unit of one method ("every-step": of the methods that compress
every step, the others stay per trace): all the dataset's traces go through as one
left-padded batch (each row compresses as if alone), so a forward serves every trace;
the numbers equal a trace's replay alone up to float rounding of batched matmuls.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from reasonkv.harness.sweep.grid import PLACEMENT, SELECTION, DatasetSpec, Grid, GridError
from reasonkv.methods.knobs import BudgetError
from reasonkv.methods.resolved import ResolvedMethod


def unit_key(config: dict) -> str:
    """Stable across runs, machines and key order: sha256 of the canonical JSON, 20 hex."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def placement(config: dict) -> dict[str, str]:
    """The device and dtype a unit runs with (a config holds them only when not the defaults)."""
    return {k: config.get(k, default) for k, default in PLACEMENT.items()}


def _sha(*parts: str) -> str:
    return hashlib.sha256(json.dumps(parts, ensure_ascii=False).encode()).hexdigest()[:16]


@dataclass
class Unit:
    key: str
    config: dict
    """What the unit's numbers depend on; `key` hashes it."""
    group: str
    """Units with the same group run as one task (replay: one pass over the trace)."""
    item: dict = field(repr=False)
    """The trace row (problem, trace) or problem row (problem, answer): travels to the worker."""
    source: str
    resolved: ResolvedMethod | BudgetError = field(repr=False, compare=False)
    """The grid's value of the unit's (method, budget), or why it cannot run at that budget.
    Pickled to a Ray worker as its setting, and resolved again there."""


def _items(spec: DatasetSpec, kind: str) -> list[dict]:
    s = spec.settings
    ids = [str(i) for i in s["ids"]] if s["ids"] is not None else None
    if kind == "replay":
        from reasonkv.harness.traces import load_traces

        rows = load_traces(spec.source, limit=s["limit"], variant=s["variant"], ids=ids)
        if not rows:
            raise GridError(f"{spec.source}: no traces of variant {s['variant']!r}")
        return [{"id": str(r["id"]), "problem": r["problem"], "trace": r["trace"]} for r in rows]
    from reasonkv.harness.datasets import load_problems_from

    rows, _ = load_problems_from(spec.source, limit=s["limit"], ids=ids, data_dir=s["data_dir"], hub=s["hub"])
    if not rows:
        raise GridError(f"{spec.source}: no problems")
    return [{"id": str(r["id"]), "problem": r["problem"], "answer": str(r["answer"])} for r in rows]


def _batches(setting: bool | str, value: ResolvedMethod | BudgetError) -> bool:
    """Does `batch_traces` put this setting's traces in one batch? "every-step": only methods
    whose schedule compresses every step (they replay one token per forward anyway, so a batch
    of traces costs about one trace; a chunked method's chunks would shrink to the rows'
    common compression points instead). Never with quantized storage: a batch moves tokens to
    low precision only where every row has left the full-precision residual, so its rows
    would keep more in full precision, and hold more, than each trace alone. Never for a
    budget the method cannot run at: its units fail alone."""
    if not isinstance(value, ResolvedMethod) or value.stores_quantized:
        return False
    if setting == "every-step":
        return value.policy.schedule.evicts_every_step
    return bool(setting)


def expand(grid: Grid) -> list[Unit]:
    """Every unit of the grid, in a fixed order (datasets, models, items, seeds, methods,
    budgets); a unit that two entries describe alike appears once."""
    units: dict[str, Unit] = {}
    for spec in grid.datasets:
        items = _items(spec, grid.kind)
        keyed = {k: v for k, v in spec.settings.items() if k not in SELECTION}
        for k, default in PLACEMENT.items():  # the defaults stay out: keys from before them still match
            if keyed[k] == default:
                del keyed[k]
        if grid.kind == "eval" and spec.settings["greedy"]:
            keyed.update(temperature=None, top_p=None)  # greedy ignores them: keep keys equal
        for model in grid.models:
            for item in items:
                sha = _sha(item["problem"], item.get("trace", item.get("answer", "")))
                for seed in grid.seeds:
                    base = {
                        "kind": grid.kind,
                        "model": model,
                        "dataset": spec.name,
                        "item": item["id"],
                        "input_sha": sha,
                        "seed": seed,
                        **keyed,
                    }
                    if spec.settings["loader"] is not None:
                        base["loader"] = spec.settings["loader"]
                    share = grid.kind == "replay" and spec.settings["share_reference"]
                    group = unit_key(base) if share else None
                    every_item = {k: v for k, v in base.items() if k not in ("item", "input_sha")}
                    for (method, budget), value in grid.runs.items():
                        knobs = grid.knobs[method]
                        config = {**base, "method": method, "budget": budget, "knobs": knobs}
                        key = unit_key(config)
                        unit_group = group or key
                        if grid.kind == "replay" and _batches(spec.settings["batch_traces"], value):
                            # one task per method: every trace of the dataset in one batch
                            unit_group = unit_key({**every_item, "method": method, "knobs": knobs})
                        units.setdefault(key, Unit(key, config, unit_group, item, spec.source, value))
    return list(units.values())


@dataclass
class Task:
    kind: str
    model: str
    attn: str
    loader: str | None
    units: list[Unit]
    device: str = PLACEMENT["device"]
    dtype: str = PLACEMENT["dtype"]

    @property
    def model_id(self) -> tuple:
        return (self.model, self.attn, self.loader, self.device, self.dtype)


def make_tasks(units: list[Unit]) -> list[Task]:
    """Units grouped into tasks (first-appearance order), ordered by model so workers
    rarely switch models."""
    groups: dict[str, list[Unit]] = {}
    for u in units:
        groups.setdefault(u.group, []).append(u)
    tasks = []
    for members in groups.values():
        c = members[0].config
        tasks.append(Task(c["kind"], c["model"], c["attn"], c.get("loader"), members, **placement(c)))
    order = {m: i for i, m in enumerate(dict.fromkeys(t.model_id for t in tasks))}
    return sorted(tasks, key=lambda t: order[t.model_id])  # stable: keeps the grid's order
