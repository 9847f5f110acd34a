"""What `reasonkv report` reads: a sweep's JSONL, a `reasonkv replay --out` JSON or a
`reasonkv eval --out` JSON, each turned into the sweep records the report summarises.

The kind is read from the content, not the name: a file whose first line is a JSON object
with a string "key" is a sweep JSONL; otherwise the whole file must be one JSON object, a
replay record ("kind": "replay", or "per_trace") or an eval summary ("kind": "eval", or
"problems" and "method"). A replay record becomes one unit per trace × run (its sums
rebuilt from the saved means, so positions pool as in a sweep); an eval summary one unit
per problem (its generate time shared out by tokens generated, so tok/s stays the run's).
"""

from __future__ import annotations

import json
from pathlib import Path

from reasonkv.harness.sweep.log import read_results
from reasonkv.methods.registry import get_method
from reasonkv.util.records import RecordError, read_json_object

SWEEP, REPLAY, EVAL = "sweep", "replay", "eval"


def _first_line(path: Path) -> object:
    with path.open("rb") as f:
        line = f.readline()
    try:
        return json.loads(line)
    except ValueError:
        return None


def file_kind(path: str | Path) -> tuple[str, dict | None]:
    """(SWEEP, None), or (REPLAY or EVAL, the file's JSON object). A file that is none of
    them is a RecordError naming it; an empty or garbled file counts as a sweep JSONL (the
    reader counts its unreadable lines)."""
    path = Path(path)
    head = _first_line(path)
    if isinstance(head, dict) and isinstance(head.get("key"), str):
        return SWEEP, None
    try:
        obj = read_json_object(path, "results file")
    except RecordError:
        return SWEEP, None
    if obj.get("kind") == REPLAY or "per_trace" in obj:
        return REPLAY, obj
    if obj.get("kind") == EVAL or ("problems" in obj and "method" in obj):
        return EVAL, obj
    raise RecordError(
        f"{path}: not a results file: expected a `reasonkv sweep` JSONL, a `reasonkv replay --out` "
        "JSON or a `reasonkv eval --out` JSON"
    )


def _budget(method: str, budget: int | None) -> int | None:
    """No budget for a method that never compresses (eval records the CLI's default anyway)."""
    try:
        return budget if get_method(method).compresses else None
    except ValueError:  # a method this install does not know: keep what the file says
        return budget


def _key(kind: str, *parts: object) -> str:
    return kind + ":" + json.dumps(parts, sort_keys=True, default=str)


def _dataset_name(source: str) -> str:
    """As a sweep names its datasets: a known name as is, a file by its stem."""
    return Path(source).stem if "/" in source or source.endswith(".jsonl") else source


_MEANS = {"kl": "mean_kl", "top1": "top1", "nll_full": "nll_full", "nll": "nll"}
"""A replay sum and the per-trace mean it is saved as."""


def _placement_of(obj: dict) -> dict[str, str]:
    """The device and dtype a replay ran on, as a sweep config holds them: only where not the
    CPU in fp32 (files from before they were recorded ran there)."""
    where = {"device": obj.get("device", "cpu"), "dtype": obj.get("dtype", "float32")}
    return {} if where == {"device": "cpu", "dtype": "float32"} else where


def replay_records(obj: dict, path: str | Path = "") -> list[dict]:
    """One ok sweep record per trace × run of a `reasonkv replay --out` record."""
    model, dataset = obj["model"], _dataset_name(str(obj.get("traces_file", path)))
    records = []
    for t in obj["per_trace"]:
        n = int(t.get("positions") or 0)
        budget = _budget(t["method"], t.get("budget"))
        knobs = t.get("knobs", {})
        config = {
            "kind": REPLAY,
            "model": model,
            "dataset": dataset,
            "item": t["trace"],
            "method": t["method"],
            "budget": budget,
            "knobs": knobs,
            "max_tokens": obj.get("max_tokens"),
            **_placement_of(obj),
        }
        sums = {"n": n, **{k: (t.get(name) or 0.0) * n for k, name in _MEANS.items()}}  # means back to sums
        metrics = {
            "sums": sums,
            "live_tokens": t.get("live_tokens", 0.0),
            "decode_peak_kv_bytes": t.get("decode_peak_kv_bytes"),
            "decode_peak_kv_bytes_16bit": t.get("decode_peak_kv_bytes_16bit"),
            "decode_peak_live_tokens": t.get("decode_peak_live_tokens"),
        }
        records.append(
            {
                "key": _key(
                    REPLAY, model, dataset, obj.get("max_tokens"), t["trace"], t["method"], budget, knobs
                ),
                "status": "ok",
                "config": config,
                "metrics": metrics,
                "timings": {"seconds": t.get("seconds", 0.0)},
                "source": str(path),
            }
        )
    return records


def eval_records(obj: dict, path: str | Path = "") -> list[dict]:
    """One ok sweep record per problem of a `reasonkv eval --out` summary."""
    model, dataset = obj["model"], _dataset_name(str(obj["dataset"]))
    method, knobs = obj["method"], obj.get("knobs", {})
    budget = _budget(method, obj.get("budget"))
    decoding = [obj.get(k) for k in ("greedy", "temperature", "top_p", "max_new_tokens", "think_budget")]
    total_tokens = sum(sum(p["lengths"]) for p in obj["problems"])
    seconds = obj.get("generate_seconds", 0.0)
    records = []
    for p in obj["problems"]:
        tokens = sum(p["lengths"])
        config = {
            "kind": EVAL,
            "model": model,
            "dataset": dataset,
            "item": p["id"],
            "seed": obj.get("seed", 0),
            "method": method,
            "budget": budget,
            "knobs": knobs,
        }
        metrics = {
            "pass@1": p.get("pass@1"),
            "answer": p.get("answer"),
            "predictions": p.get("predictions"),
            "correct": p["correct"],
            "lengths": p["lengths"],
            "truncated": p["truncated"],
            "generated_tokens": tokens,
        }
        share = seconds * tokens / total_tokens if total_tokens else 0.0
        records.append(
            {
                "key": _key(EVAL, model, dataset, config["seed"], method, budget, knobs, decoding, p["id"]),
                "status": "ok",
                "config": config,
                "metrics": metrics,
                "timings": {"generate_seconds": share},
                "source": str(path),
            }
        )
    return records


def read_any(path: str | Path) -> tuple[list[dict], int]:
    """The sweep records a results file of any kind holds, and its unreadable lines (sweep
    JSONL only); a RecordError when the file is no results file or lacks a field."""
    kind, obj = file_kind(path)
    if kind == SWEEP:
        return read_results(path)
    try:
        return (replay_records(obj, path) if kind == REPLAY else eval_records(obj, path)), 0
    except (KeyError, TypeError) as err:
        raise RecordError(f"{path}: a {kind} --out JSON without the field {err}") from None
