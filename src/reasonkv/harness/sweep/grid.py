"""Sweep grids: the file format, its validation, and the settings each dataset runs with.

A grid is TOML (or YAML when PyYAML is installed): `kind` (replay or eval), `models`,
`methods`, `budgets` (`full` runs once, without one), optional `seeds`, `[settings]`
(defaults for every dataset; keys: SETTINGS), `[knobs]` (to every method that has the knob;
one that none has is an error), `[knobs.NAME]` (to one method, over the shared ones) and
`[[datasets]]` (replay: `traces`, a trace jsonl; eval: `dataset`, math500/aime24/aime25 or a
jsonl). Relative paths are relative to the grid file; examples/sweep-replay.toml is a
commented grid.

Each (method, budget) is resolved once, when the grid loads (`Grid.runs`), and its units run
on that value. A bad knob is the grid's error; a budget below a method's protected window
fails only that budget's units (a method that runs at none of the budgets is the grid's error).

`device` and `dtype` say where and in what precision every model loads (default cpu and
float32). They are checked, and "auto" resolved, when the grid loads, on the machine that
loads it: a device it lacks is refused there, dry runs included. Every unit's record states
them; a unit's key includes them only when they are not the defaults, so units of grids
written before these settings existed keep their keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reasonkv.core.models import resolve_device, resolve_dtype
from reasonkv.harness.record_knobs import recorded
from reasonkv.methods.knobs import BudgetError, share_knobs
from reasonkv.methods.resolved import ResolvedMethod, resolve_method

KINDS = ("replay", "eval")
TOP_KEYS = {"kind", "description", "models", "methods", "budgets", "seeds", "settings", "knobs", "datasets"}
PLACEMENT: dict[str, str] = {"device": "cpu", "dtype": "float32"}
"""The default device and dtype: units that run with them carry neither in their key."""
COMMON_SETTINGS: dict[str, Any] = {"attn": "sdpa", "loader": None, **PLACEMENT}
"""loader: "module:function" called as fn(model, attn_implementation=..., device=..., dtype=...)
-> (model, tokenizer) instead of reasonkv.core.models.load_model (it must be importable by
every worker; device is a str, dtype a torch.dtype, and the model it returns must be on them)."""
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
    "greedy": True,  # as `reasonkv eval`: sampling (samples > 1, several seeds) needs greedy = false
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
SELECTION = {"limit", "ids", "variant", "data_dir", "hub", "share_reference", "batch_traces", "loader"}


class GridError(ValueError):
    """A grid file that cannot be expanded (printed as one line by the CLI)."""


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
    """Per method: the validated knobs it runs with, as its units record them (a method that
    never compresses keeps only its storage knobs)."""
    runs: dict[tuple[str, int | None], ResolvedMethod | BudgetError] = dataclasses.field(repr=False)
    """Each (method, budget) resolved once (`full`: budget None), or why it cannot run at that
    budget (its units fail with it; the method's other budgets run)."""
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
    for key, resolve in (("device", resolve_device), ("dtype", resolve_dtype)):
        if key in values:
            try:
                resolve(values[key])
            except ValueError as err:
                raise GridError(f"{where}: {err}") from None
    if values.get("batch_traces", False) not in (True, False, "every-step"):
        raise GridError(
            f'{where}: `batch_traces` must be true, false or "every-step", got {values["batch_traces"]!r}'
        )


def _resolve_runs(
    methods: list[str], budgets: list[int], raw: dict
) -> dict[tuple[str, int | None], ResolvedMethod | BudgetError]:
    """Each (method, budget) resolved once, with its knobs: shared ones go to every method that
    has them (one that no method has is a typo), a [knobs.METHOD] table to that method only, over
    the shared ones. A bad knob is the grid's error; a budget a method cannot run at is its
    units' (unless the method runs at none of the grid's budgets)."""
    per_method = {k: v for k, v in raw.items() if isinstance(v, dict)}
    shared = {k: v for k, v in raw.items() if not isinstance(v, dict)}
    stray = sorted(set(per_method) - set(methods))
    if stray:
        raise GridError(f"[knobs.{stray[0]}]: {stray[0]!r} is not one of the grid's methods")
    try:
        knobs = share_knobs(methods, shared, per_method)
    except ValueError as err:  # an unknown method or knob
        raise GridError(str(err)) from None
    runs: dict[tuple[str, int | None], ResolvedMethod | BudgetError] = {}
    for name in methods:
        refused = []
        for budget in budgets or [None]:
            try:
                value = recorded(resolve_method(name, budget, knobs[name]))
            except BudgetError as err:
                if not budgets:
                    raise GridError(f"the grid needs `budgets`: {name!r} compresses") from None
                runs[(name, budget)] = err
                refused.append(err)
                continue
            except ValueError as err:  # a bad value, knobs that do not fit together, a bad profile
                raise GridError(str(err)) from None
            runs[(name, value.budget)] = value
            if not value.compresses:  # `full` once, whatever the budgets
                break
        if refused and len(refused) == len(budgets):
            raise GridError(f"{name!r} runs at none of the grid's budgets: {refused[0]}")
    return runs


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
    budgets = _list_of(data, "budgets", int) if "budgets" in data else []
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
        settings.update(_placement(settings["device"], settings["dtype"]))
        source = entry[source_key]
        if kind == "replay" or not _is_known_dataset(source):
            candidate = base / source
            source = str(candidate) if candidate.exists() or kind == "replay" else source
        if settings.get("data_dir") is not None:
            settings["data_dir"] = str(base / settings["data_dir"])
        if kind == "eval" and settings["greedy"]:
            if settings["samples"] > 1:
                raise GridError(
                    f"{where}: greedy decoding (the default) gives one completion: use samples = 1, "
                    "or set greedy = false to sample"
                )
            if len(seeds) > 1:
                raise GridError(
                    "greedy decoding (the default) ignores the seed: give one seed, or set greedy = false"
                )
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
    runs = _resolve_runs(methods, budgets, knobs)
    return Grid(
        kind=kind,
        models=models,
        methods=methods,
        budgets=budgets,
        seeds=seeds,
        datasets=datasets,
        knobs={name: dict(v.knobs) for (name, _), v in runs.items() if isinstance(v, ResolvedMethod)},
        runs=runs,
        path=path,
        description=str(data.get("description", "")),
    )


def _placement(device: str, dtype: str) -> dict[str, str]:
    """The canonical names a unit records: "auto" resolved, "bf16" -> "bfloat16"."""
    where = resolve_device(device)
    return {"device": str(where), "dtype": str(resolve_dtype(dtype, where)).removeprefix("torch.")}


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
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
            import tomli as tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise GridError(f"{path}: {err}") from None
    return parse_grid(data, path.parent, path)


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
