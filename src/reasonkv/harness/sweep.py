"""Resumable sweeps: a grid of models × methods × budgets × datasets × seeds, run unit by
unit into a JSONL file that survives Ctrl-C and kill -9.

Grid (TOML, or YAML when PyYAML is installed; relative paths are relative to the grid file)::

    kind = "replay"                 # or "eval"
    models = ["smollm2-135m"]
    methods = ["full", "snapkv", "rkv"]
    budgets = [64, 128]             # tokens per KV head; `full` runs once, without one
    seeds = [0]                     # optional; replay is deterministic and takes one seed

    [settings]                      # defaults for every dataset (keys: see SETTINGS)
    max_tokens = 256

    [knobs]                         # to every method that has the knob (none has it: error)
    interval = 32
    [knobs.rpc]                     # to one method, over the shared ones
    interval = 16

    [[datasets]]                    # replay: a trace jsonl; eval: math500/aime24/aime25 or a jsonl
    traces = "traces.jsonl"
    limit = 2

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
A task writes one line per unit when it ends; an interrupted task writes nothing, and its
units rerun on resume. A resumed replay task runs only its missing methods: each method's
numbers depend on the trace and the shared reference alone, not on which other methods
ran beside it.

Results file. The driver alone writes it: each line with one os.write on an O_APPEND
descriptor, then fsync, under an exclusive flock (a second sweep on the same file is
refused). On open, a trailing line without its newline (a write cut by kill -9) is cut
off the file; a unit whose key has a line is done. Error lines (status "error") count as
done too, unless retry_errors is set; the report prefers a unit's "ok" line.

Workers. `SerialPool` runs tasks in this process, one at a time (any number of simulated
workers: it exercises the same dispatch as Ray, in order). `RayPool` holds one Ray actor
per worker; an actor keeps the model of its last task loaded and the dispatcher hands it
tasks of that model first, so a model loads once per worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import hashlib
import importlib
import json
import os
import platform
import socket
import subprocess
import time
import traceback
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import torch

from reasonkv.core.models import load_model
from reasonkv.methods.api import make_cache
from reasonkv.methods.knobs import knobs_for_methods
from reasonkv.methods.registry import get_method

KINDS = ("replay", "eval")
TOP_KEYS = {"kind", "description", "models", "methods", "budgets", "seeds", "settings", "knobs", "datasets"}
COMMON_SETTINGS: dict[str, Any] = {"attn": "sdpa", "loader": None}
"""loader: "module:function" called as fn(model, attn_implementation=...) -> (model, tokenizer)
instead of reasonkv.core.models.load_model (it must be importable by every worker)."""
REPLAY_SETTINGS: dict[str, Any] = {
    "max_tokens": 2048,
    "variant": "well_posed",
    "limit": None,
    "ids": None,
    "bin": 128,
    "share_reference": True,
    "batch_traces": False,
}
EVAL_SETTINGS: dict[str, Any] = {
    "limit": None,
    "ids": None,
    "samples": 1,
    "greedy": False,
    "temperature": 0.6,
    "top_p": 0.95,
    "max_new_tokens": 512,
    "think_budget": None,
    "batch_size": 1,
    "data_dir": None,
    "hub": True,
}
SETTINGS = {"replay": {**COMMON_SETTINGS, **REPLAY_SETTINGS}, "eval": {**COMMON_SETTINGS, **EVAL_SETTINGS}}
# Settings that pick which items run (not how an item runs): never part of a unit's key.
_SELECTION = {"limit", "ids", "variant", "data_dir", "hub", "share_reference", "batch_traces", "loader"}


class GridError(ValueError):
    """A grid file that cannot be expanded (printed as one line by the CLI)."""


# ------------------------------------------------------------------------ grid
@dataclass
class DatasetSpec:
    name: str
    source: str
    """The trace jsonl (replay), or a known name / problem jsonl (eval)."""
    settings: dict[str, Any]
    """Every setting of SETTINGS[kind], the grid's [settings] under the dataset's own."""


@dataclass
class Grid:
    kind: str
    models: list[str]
    methods: list[str]
    budgets: list[int]
    seeds: list[int]
    datasets: list[DatasetSpec]
    knobs: dict[str, dict[str, Any]]
    """Per method: the validated knobs it runs with (empty for methods that do not compress)."""
    path: Path | None = None
    description: str = ""


def _list_of(data: dict, key: str, kind: type, default: list | None = None) -> list:
    value = data.get(key, default)
    if value is None:
        raise GridError(f"the grid needs `{key}`")
    if isinstance(value, kind) and not isinstance(value, list):
        value = [value]
    if not isinstance(value, list) or not value:
        raise GridError(f"`{key}` must be a non-empty list")
    for item in value:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise GridError(f"`{key}` takes {kind.__name__} values, got {item!r}")
    return list(dict.fromkeys(value))


def _check_settings(where: str, values: dict, kind: str) -> None:
    known = set(SETTINGS[kind])
    unknown = sorted(set(values) - known)
    if unknown:
        raise GridError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid for {kind}: {', '.join(sorted(known))}"
        )
    for key in ("limit", "max_tokens", "bin", "samples", "max_new_tokens", "batch_size", "think_budget"):
        value = values.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise GridError(f"{where}: `{key}` must be a positive integer, got {value!r}")
    if values.get("max_tokens") is not None and values["max_tokens"] < 2:
        raise GridError(f"{where}: `max_tokens` must be at least 2")
    ids = values.get("ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, (str, int)) for i in ids)):
        raise GridError(f"{where}: `ids` must be a list of ids")
    if values.get("attn", "sdpa") not in ("sdpa", "eager"):
        raise GridError(f"{where}: `attn` must be sdpa or eager, got {values['attn']!r}")
    if values.get("batch_traces", False) not in (True, False, "every-step"):
        raise GridError(
            f'{where}: `batch_traces` must be true, false or "every-step", got {values["batch_traces"]!r}'
        )


def _resolve_knobs(methods: list[str], raw: dict) -> dict[str, dict[str, Any]]:
    """Shared knobs go to every method that has them (one that no method has is a typo);
    a [knobs.METHOD] table goes to that method only, over the shared ones."""
    per_method = {k: v for k, v in raw.items() if isinstance(v, dict)}
    shared = {k: v for k, v in raw.items() if not isinstance(v, dict)}
    stray = sorted(set(per_method) - set(methods))
    if stray:
        raise GridError(f"[knobs.{stray[0]}]: {stray[0]!r} is not one of the grid's methods")
    try:
        return knobs_for_methods(methods, shared, per_method)
    except ValueError as err:  # an unknown method or knob, a bad value
        raise GridError(str(err)) from None


def parse_grid(data: dict, base_dir: str | Path = ".", path: Path | None = None) -> Grid:
    """Validate a grid (the parsed TOML/YAML) before anything is loaded."""
    if not isinstance(data, dict):
        raise GridError("a grid is a table of keys")
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise GridError(f"unknown grid key(s) {', '.join(unknown)}; valid: {', '.join(sorted(TOP_KEYS))}")
    kind = data.get("kind")
    if kind not in KINDS:
        raise GridError(f"`kind` must be one of {', '.join(KINDS)}, got {kind!r}")
    models = _list_of(data, "models", str)
    methods = _list_of(data, "methods", str)
    # Only compressing methods take a budget: a grid of `full` alone needs none.
    budgets = _list_of(data, "budgets", int) if any(_compresses(m) for m in methods) else []
    if any(b <= 0 for b in budgets):
        raise GridError(f"budgets must be positive numbers of tokens per KV head, got {budgets}")
    seeds = _list_of(data, "seeds", int, default=[0])
    defaults = data.get("settings", {})
    if not isinstance(defaults, dict):
        raise GridError("[settings] must be a table")
    _check_settings("[settings]", defaults, kind)
    raw_sets = data.get("datasets")
    if isinstance(raw_sets, dict):
        raw_sets = [raw_sets]
    if not isinstance(raw_sets, list) or not raw_sets:
        raise GridError("the grid needs at least one [[datasets]] entry")
    base = Path(base_dir)
    datasets = []
    source_key = "traces" if kind == "replay" else "dataset"
    for i, entry in enumerate(raw_sets):
        where = f"datasets[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get(source_key), str):
            raise GridError(
                f"{where}: needs `{source_key}` (a {'trace jsonl' if kind == 'replay' else 'dataset'})"
            )
        own = {k: v for k, v in entry.items() if k not in (source_key, "name")}
        _check_settings(where, own, kind)
        settings = {**SETTINGS[kind], **defaults, **own}
        source = entry[source_key]
        if kind == "replay" or not _is_known_dataset(source):
            candidate = base / source
            source = str(candidate) if candidate.exists() or kind == "replay" else source
        if settings.get("data_dir") is not None:
            settings["data_dir"] = str(base / settings["data_dir"])
        if kind == "eval" and settings["greedy"]:
            if settings["samples"] > 1:
                raise GridError(f"{where}: greedy decoding gives one completion: use samples = 1")
            if len(seeds) > 1:
                raise GridError("greedy decoding ignores the seed: give one seed")
        if kind == "eval" and settings["think_budget"] is not None:
            if settings["think_budget"] >= settings["max_new_tokens"]:
                raise GridError(f"{where}: think_budget must be below max_new_tokens")
        name = entry.get("name") or (Path(source).stem if source_key == "traces" or "/" in source else source)
        datasets.append(DatasetSpec(str(name), source, settings))
    if kind == "replay" and len(seeds) > 1:
        raise GridError("replay is deterministic: more than one seed would repeat identical units")
    knobs = data.get("knobs", {})
    if not isinstance(knobs, dict):
        raise GridError("[knobs] must be a table")
    return Grid(
        kind=kind,
        models=models,
        methods=methods,
        budgets=budgets,
        seeds=seeds,
        datasets=datasets,
        knobs=_resolve_knobs(methods, knobs),
        path=path,
        description=str(data.get("description", "")),
    )


def _compresses(method: str) -> bool:
    try:
        return get_method(method).compresses
    except ValueError as err:
        raise GridError(str(err)) from None


def _is_known_dataset(name: str) -> bool:
    from reasonkv.harness.datasets import KNOWN

    return name.lower() in KNOWN


def load_grid(path: str | Path) -> Grid:
    """Read and validate a grid file (.toml, or .yaml/.yml with PyYAML)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no grid file at {path}")
    text = path.read_text()
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise GridError("YAML grids need PyYAML (pip install pyyaml); TOML needs nothing") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise GridError(f"{path}: {err}") from None
    else:
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise GridError(f"{path}: {err}") from None
    return parse_grid(data, path.parent, path)


# ----------------------------------------------------------------------- units
def unit_key(config: dict) -> str:
    """Stable across runs, machines and key order: sha256 of the canonical JSON, 20 hex."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


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
    source: str = ""


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


def _runs(grid: Grid) -> list[tuple[str, int | None]]:
    out = []
    for method in grid.methods:
        if get_method(method).compresses:
            out += [(method, b) for b in grid.budgets]
        else:
            out.append((method, None))
    return out


def _batches(setting: bool | str, method: str) -> bool:
    """Does `batch_traces` put this method's traces in one batch? "every-step": only methods
    whose schedule compresses every step (they replay one token per forward anyway, so a batch
    of traces costs about one trace; a chunked method's chunks would shrink to the rows'
    common compression points instead)."""
    if setting == "every-step":
        return get_method(method).schedule.evicts_every_step
    return bool(setting)


def expand(grid: Grid) -> list[Unit]:
    """Every unit of the grid, in a fixed order (datasets, models, items, seeds, methods,
    budgets); a unit that two entries describe alike appears once."""
    units: dict[str, Unit] = {}
    for spec in grid.datasets:
        items = _items(spec, grid.kind)
        keyed = {k: v for k, v in spec.settings.items() if k not in _SELECTION}
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
                    for method, budget in _runs(grid):
                        config = {**base, "method": method, "budget": budget, "knobs": grid.knobs[method]}
                        key = unit_key(config)
                        unit_group = group or key
                        if grid.kind == "replay" and _batches(spec.settings["batch_traces"], method):
                            # one task per method: every trace of the dataset in one batch
                            unit_group = unit_key(
                                {**every_item, "method": method, "knobs": grid.knobs[method]}
                            )
                        units.setdefault(key, Unit(key, config, unit_group, item, spec.source))
    return list(units.values())


# --------------------------------------------------------------- results file
def _parse_lines(data: bytes) -> tuple[list[dict], int]:
    """Complete lines of a results file as records, and how many were unreadable."""
    records, bad = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("key"), str):
            records.append(record)
        else:
            bad += 1
    return records, bad


def read_results(path: str | Path) -> tuple[list[dict], int]:
    """Records of a results file (read only: a trailing partial line is ignored, not removed)
    and the count of lines that could not be read (partial tail included)."""
    data = Path(path).read_bytes()
    cut = data.rfind(b"\n") + 1
    records, bad = _parse_lines(data[:cut])
    return records, bad + (1 if data[cut:].strip() else 0)


class ResultsLog:
    """The sweep's append-only JSONL, opened for one writer.

    Opening takes an exclusive flock (released by the kernel even on kill -9), cuts off a
    trailing partial line, and reads every record. `append` writes one whole line per
    os.write on the O_APPEND descriptor and fsyncs it before returning: once append has
    returned, the unit is on disk; before, at most a partial tail exists, cut off next time.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise GridError(f"{self.path} is in use by another sweep (it holds the file's lock)") from None
        data = b""
        while chunk := os.pread(self.fd, 1 << 20, len(data)):
            data += chunk
        cut = data.rfind(b"\n") + 1
        self.dropped_tail = len(data) - cut  # bytes of an interrupted write, now removed
        if self.dropped_tail:
            os.ftruncate(self.fd, cut)
            os.fsync(self.fd)
        self.records, self.unreadable = _parse_lines(data[:cut])

    def append(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        size = os.fstat(self.fd).st_size
        try:
            written = os.write(self.fd, data)
            while written < len(data):  # a regular file takes it all at once; a full disk may not
                written += os.write(self.fd, data[written:])
            os.fsync(self.fd)
        except OSError:
            with contextlib.suppress(OSError):  # no half line for the next record to follow
                os.ftruncate(self.fd, size)
            raise
        self.records.append(record)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1

    def __enter__(self) -> ResultsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def done_keys(records: Iterable[dict], retry_errors: bool = False) -> set[str]:
    """Keys of finished units: those with an ok line, and those with an error line unless
    errors are to be retried."""
    return {r["key"] for r in records if r.get("status") == "ok" or not retry_errors}


# ---------------------------------------------------------------------- tasks
@dataclass
class Task:
    kind: str
    model: str
    attn: str
    loader: str | None
    units: list[Unit]

    @property
    def model_id(self) -> tuple:
        return (self.model, self.attn, self.loader)


def make_tasks(units: list[Unit]) -> list[Task]:
    """Units grouped into tasks (first-appearance order), ordered by model so workers
    rarely switch models."""
    groups: dict[str, list[Unit]] = {}
    for u in units:
        groups.setdefault(u.group, []).append(u)
    tasks = []
    for members in groups.values():
        c = members[0].config
        tasks.append(Task(c["kind"], c["model"], c["attn"], c.get("loader"), members))
    order = {m: i for i, m in enumerate(dict.fromkeys(t.model_id for t in tasks))}
    return sorted(tasks, key=lambda t: order[t.model_id])  # stable: keeps the grid's order


# --------------------------------------------------------------------- worker
def resolve_loader(spec: str | None) -> Callable:
    """The model loader: reasonkv's load_model (looked up when called, so tests can
    replace it), or "module:function"."""
    if spec is None:
        return load_model
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"loader must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), attr)


def versions() -> dict[str, str]:
    import transformers

    import reasonkv

    return {
        "reasonkv": reasonkv.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def git_info() -> dict | None:
    """The commit of the reasonkv source tree (and whether tracked files differ), or None."""
    import reasonkv

    root = Path(reasonkv.__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _record(unit: Unit, status: str, **fields) -> dict:
    return {"key": unit.key, "status": status, "kind": unit.config["kind"], "config": unit.config, **fields}


def error_record(unit: Unit, err: BaseException, phase: str = "run") -> dict:
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return _record(
        unit,
        "error",
        error=f"{type(err).__name__}: {err}",
        phase=phase,
        traceback=tb[-4000:],
        timings={},
        source=unit.source,
        finished=_now(),
    )


def _replay_task(model, tokenizer, task: Task) -> list[dict]:
    """Replay the task's traces (one, or several as one batch) under its runs in one pass;
    one record per unit. Units a task does not hold (done before a resume) are not rerun
    unless the rectangle traces × runs needs them, and then not written again."""
    from reasonkv.harness.replay import ReplayRun, replay_batch
    from reasonkv.harness.traces import replay_input

    c = task.units[0].config
    records: list[dict] = []
    inputs, input_of = [], {}
    for u in task.units:
        if u.item["id"] in input_of or any(r["key"] == u.key for r in records):
            continue
        try:
            inp = replay_input(tokenizer, u.item, c["max_tokens"])
        except Exception as err:  # a trace that cannot be replayed fails its units alone
            records += [error_record(v, err) for v in task.units if v.item["id"] == u.item["id"]]
            continue
        input_of[u.item["id"]] = len(inputs)
        inputs.append(inp)
    runs: dict[tuple, ReplayRun] = {}
    for u in task.units:
        run = ReplayRun(u.config["method"], u.config["budget"], dict(u.config["knobs"]))
        if _run_id(run) in runs or u.item["id"] not in input_of:
            continue
        try:  # a method that cannot run (budget below its protected window) fails alone
            make_cache(model, run.method, run.budget, **run.knobs)
        except Exception as err:
            records += [error_record(v, err) for v in task.units if _run_id(_run_of(v)) == _run_id(run)]
            continue
        runs[_run_id(run)] = run
    pending = [u for u in task.units if u.item["id"] in input_of and _run_id(_run_of(u)) in runs]
    if not pending:
        return records
    torch.manual_seed(c["seed"])
    start = time.perf_counter()
    try:
        results = replay_batch(model, inputs, list(runs.values()))
    except Exception as err:
        if len(pending) == 1:
            return records + [error_record(pending[0], err)]
        # One method or trace broke the shared pass: replay each unit alone, so only the culprit
        # fails (a unit's numbers are the same alone or shared, up to float rounding).
        for u in pending:
            records += _replay_task(model, tokenizer, dataclasses.replace(task, units=[u]))
        return records
    wall = time.perf_counter() - start
    column = {rid: j for j, rid in enumerate(runs)}
    for u in pending:
        inp = inputs[input_of[u.item["id"]]]
        r = results[input_of[u.item["id"]]][column[_run_id(_run_of(u))]]
        d = r.to_dict(c["bin"])
        metrics = {k: d[k] for k in ("positions", "mean_kl", "top1", "ppl_ratio", "nll", "nll_full")}
        metrics.update(
            tokens=int(inp.input_ids.shape[1]),
            prompt_len=inp.prompt_len,
            live_tokens=r.live_tokens,
            forwards=r.forwards,
            compressions=r.compressions,
            sums=r.sums(),
            curve=d["curve"],
        )
        timings = {
            "seconds": r.seconds,
            "task_seconds": wall,
            "task_units": len(pending),
            "task_traces": len(inputs),
        }
        records.append(_record(u, "ok", metrics=metrics, timings=timings, source=u.source, finished=_now()))
    return records


def _run_of(u: Unit):
    from reasonkv.harness.replay import ReplayRun

    return ReplayRun(u.config["method"], u.config["budget"], dict(u.config["knobs"]))


def _run_id(run) -> tuple:
    return (run.method, run.budget, json.dumps(run.knobs, sort_keys=True))


def _eval_task(model, tokenizer, task: Task) -> list[dict]:
    from reasonkv.harness.accuracy import evaluate

    records = []
    for u in task.units:
        c = u.config
        # One seed per (grid seed, problem), whatever else runs: a problem's samples repeat exactly.
        seed = (c["seed"] * 1_000_003 + zlib.crc32(c["item"].encode())) % 2**31
        start = time.perf_counter()
        try:
            result = evaluate(
                model,
                tokenizer,
                [u.item],
                c["method"],
                c["budget"],
                c["knobs"],
                n_samples=c["samples"],
                greedy=c["greedy"],
                temperature=c["temperature"] if c["temperature"] is not None else 0.6,
                top_p=c["top_p"] if c["top_p"] is not None else 0.95,
                max_new_tokens=c["max_new_tokens"],
                seed=seed,
                batch_size=c["batch_size"],
                think_budget=c["think_budget"],
            )
        except Exception as err:
            records.append(error_record(u, err))
            continue
        problem = result.pop("problems")[0]
        metrics = {
            k: result[k]
            for k in (
                "pass@1",
                "mean_length",
                "truncation_rate",
                "generated_tokens",
                "tokens_per_second",
                "peak_kv_bytes",
                "mean_kv_bytes",
                "peak_live_kv_bytes",
                "mean_live_kv_bytes",
            )
        }
        metrics.update(
            samples=c["samples"],
            sampling_seed=seed,
            answer=problem["answer"],
            predictions=problem["predictions"],
            correct=problem["correct"],
            lengths=problem["lengths"],
            truncated=problem["truncated"],
            outputs=problem["outputs"],
        )
        timings = {"seconds": time.perf_counter() - start, "generate_seconds": result["generate_seconds"]}
        records.append(_record(u, "ok", metrics=metrics, timings=timings, source=u.source, finished=_now()))
    return records


class SweepWorker:
    """Runs tasks; keeps the last task's model loaded (one model at a time)."""

    def __init__(self, threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.model_id: tuple | None = None
        self.model = self.tokenizer = None

    def _load(self, task: Task) -> float:
        if self.model_id == task.model_id:
            return 0.0
        from reasonkv.util.runtime import quiet_loading

        self.model = self.tokenizer = self.model_id = None
        gc.collect()  # free the previous model before the next one loads
        start = time.perf_counter()
        with quiet_loading():
            self.model, self.tokenizer = resolve_loader(task.loader)(
                task.model, attn_implementation=task.attn
            )
        self.model_id = task.model_id
        return time.perf_counter() - start

    def run(self, task: Task) -> list[dict]:
        try:
            load_seconds = self._load(task)
        except Exception as err:
            return [error_record(u, err, phase="load") for u in task.units]
        runner = _replay_task if task.kind == "replay" else _eval_task
        records = runner(self.model, self.tokenizer, task)
        about = {"host": socket.gethostname(), "pid": os.getpid(), "threads": torch.get_num_threads()}
        env = versions()
        for r in records:
            r["timings"]["load_seconds"] = load_seconds
            r["versions"] = env
            r["worker"] = about
        return records


# ----------------------------------------------------------------------- pools
class Pool(Protocol):
    size: int

    def submit(self, worker: int, task: Task) -> Any: ...
    def wait(self, handles: list) -> list: ...
    def result(self, handle) -> list[dict]: ...
    def replace(self, worker: int) -> None: ...
    def close(self) -> None: ...


class SerialPool:
    """`size` workers simulated in this process: each has its own SweepWorker (its own
    model), tasks run when waited for, oldest first. Ctrl-C reaches the running task."""

    def __init__(self, size: int = 1, threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.size = size
        self.workers = [SweepWorker() for _ in range(size)]
        self._queue: dict[int, tuple[int, Task]] = {}
        self._done: dict[int, list[dict]] = {}
        self._next = 0

    def submit(self, worker: int, task: Task) -> int:
        self._next += 1
        self._queue[self._next] = (worker, task)
        return self._next

    def wait(self, handles: list) -> list:
        handle = min(handles)
        worker, task = self._queue.pop(handle)
        self._done[handle] = self.workers[worker].run(task)
        return [handle]

    def result(self, handle) -> list[dict]:
        return self._done.pop(handle)

    def replace(self, worker: int) -> None:
        self.workers[worker] = SweepWorker()

    def close(self) -> None:
        self.workers = []


class RayPool:
    """One Ray actor per worker (`num_cpus=threads` each). address=None starts a local
    Ray instance sized for the workers; otherwise joins that cluster (reasonkv must be
    installed on its nodes)."""

    def __init__(self, size: int, threads: int, address: str | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise GridError(
                "--workers > 1 and --ray need Ray: pip install 'reasonkv[eval]' (or ray)"
            ) from None
        import logging

        self.ray = ray
        self.size, self.threads = size, threads
        self.started = not ray.is_initialized()
        if self.started:
            kwargs: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "logging_level": logging.WARNING,
            }
            if address is None:  # every actor must fit, even with more workers than cores
                kwargs["num_cpus"] = max(os.cpu_count() or 1, size * threads)
            try:
                ray.init(address=address, **kwargs)
            except (ConnectionError, RuntimeError) as err:
                raise GridError(f"could not start Ray{f' at {address}' if address else ''}: {err}") from None
        self.actor_class = ray.remote(num_cpus=threads)(SweepWorker)
        self.actors = [self.actor_class.remote(threads) for _ in range(size)]

    def submit(self, worker: int, task: Task):
        return self.actors[worker].run.remote(task)

    def wait(self, handles: list) -> list:
        ready, _ = self.ray.wait(handles, num_returns=1)
        return ready

    def result(self, handle) -> list[dict]:
        return self.ray.get(handle)

    def replace(self, worker: int) -> None:
        with contextlib.suppress(Exception):
            self.ray.kill(self.actors[worker])
        self.actors[worker] = self.actor_class.remote(self.threads)

    def close(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        self.actors = []
        if self.started:
            self.ray.shutdown()


def _pick(pending: list[Task], current: tuple | None, busy_models: set) -> int:
    """The next task for a free worker: one of the model it holds, else one of a model no
    busy worker holds (models spread over workers), else the oldest."""
    for want in (lambda t: t.model_id == current, lambda t: t.model_id not in busy_models):
        for i, t in enumerate(pending):
            if want(t):
                return i
    return 0


def dispatch(tasks: list[Task], pool: Pool, on_done: Callable[[Task, list[dict]], None]) -> None:
    """Run every task on the pool's workers, one task per worker at a time; on_done(task,
    records) as each finishes. A task whose worker died (the actor crashed, e.g. killed
    for memory) ends as error records and the worker is replaced."""
    pending = list(tasks)
    idle = list(range(pool.size))
    held: list[tuple | None] = [None] * pool.size
    inflight: dict[Any, tuple[int, Task]] = {}
    while pending or inflight:
        while idle and pending:
            worker = idle.pop(0)
            busy = {held[w] for w, _ in inflight.values()}
            task = pending.pop(_pick(pending, held[worker], busy))
            held[worker] = task.model_id
            inflight[pool.submit(worker, task)] = (worker, task)
        for handle in pool.wait(list(inflight)):
            worker, task = inflight.pop(handle)
            try:
                records = pool.result(handle)
            except Exception as err:  # the worker itself failed, not the task's code
                records = [error_record(u, err, phase="worker") for u in task.units]
                pool.replace(worker)
                held[worker] = None
            idle.append(worker)
            on_done(task, records)


# ---------------------------------------------------------------------- sweep
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
        env = os.environ.get("REASONKV_THREADS", "").strip()
        threads = int(env) if env.isdigit() and int(env) > 0 else max(1, (os.cpu_count() or 1) // workers)
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


def grid_summary(grid: Grid) -> dict:
    """What the grid is, for display."""
    return {
        "kind": grid.kind,
        "models": grid.models,
        "methods": grid.methods,
        "budgets": grid.budgets,
        "seeds": grid.seeds,
        "datasets": [dataclasses.asdict(d) for d in grid.datasets],
        "knobs": grid.knobs,
    }
