"""What a worker does with a task: replay or evaluate its units, one record per unit.

A task's records are written when it ends; an interrupted task writes nothing, and its
units rerun on resume. A resumed replay task runs only its missing methods: each method's
numbers depend on the trace and the shared reference alone, not on which other methods
ran beside it.
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
import zlib

import torch

from reasonkv.harness.sweep.units import Task, Unit, placement
from reasonkv.methods.api import make_cache
from reasonkv.methods.knobs import BudgetError
from reasonkv.methods.resolved import ResolvedMethod
from reasonkv.util.records import utc_timestamp


def _record(unit: Unit, status: str, **fields) -> dict:
    return {
        "key": unit.key,
        "status": status,
        "kind": unit.config["kind"],
        "config": unit.config,
        **placement(unit.config),
        **fields,
    }


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
        finished=utc_timestamp(),
    )


def replay_task(model, tokenizer, task: Task) -> list[dict]:
    """Replay the task's traces (one, or several as one batch) under its runs in one pass;
    one record per unit. Units a task does not hold (done before a resume) are not rerun
    unless the rectangle traces × runs needs them, and then not written again."""
    from reasonkv.core.models import max_positions
    from reasonkv.harness.replay import STATE_PEAKS, ReplayRun, replay_batch
    from reasonkv.harness.traces import check_replay_input, replay_input

    c = task.units[0].config
    limit = max_positions(model.config)
    records: list[dict] = []
    inputs, input_of = [], {}
    for u in task.units:
        if u.item["id"] in input_of or any(r["key"] == u.key for r in records):
            continue
        try:
            inp = replay_input(tokenizer, u.item, c["max_tokens"], where=u.source)
            check_replay_input(inp, limit, u.source)
        except Exception as err:  # a trace that cannot be replayed (too short or long) fails alone
            records += [error_record(v, err) for v in task.units if v.item["id"] == u.item["id"]]
            continue
        input_of[u.item["id"]] = len(inputs)
        inputs.append(inp)
    runs: dict[tuple, ReplayRun] = {}
    refused: set[tuple] = set()
    for u in task.units:
        if _run_id(u) in runs or _run_id(u) in refused or u.item["id"] not in input_of:
            continue
        try:  # a method that cannot run (budget below its protected window) fails alone
            run = ReplayRun.of(_setting(u))
            make_cache(model, run.resolved)
        except Exception as err:
            refused.add(_run_id(u))
            records += [error_record(v, err) for v in task.units if _run_id(v) == _run_id(u)]
            continue
        runs[_run_id(u)] = run
    pending = [u for u in task.units if u.item["id"] in input_of and _run_id(u) in runs]
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
            records += replay_task(model, tokenizer, dataclasses.replace(task, units=[u]))
        return records
    wall = time.perf_counter() - start
    column = {rid: j for j, rid in enumerate(runs)}
    for u in pending:
        inp = inputs[input_of[u.item["id"]]]
        r = results[input_of[u.item["id"]]][column[_run_id(u)]]
        d = r.to_dict(c["bin"])
        metrics = {k: d[k] for k in ("positions", "mean_kl", "top1", "ppl_ratio", "nll", "nll_full")}
        metrics.update(
            tokens=int(inp.input_ids.shape[1]),
            prompt_len=inp.prompt_len,
            live_tokens=r.live_tokens,
            peak_live_tokens=r.peak_live_tokens,
            peak_kv_bytes=r.peak_kv_bytes,
            decode_peak_live_tokens=r.decode_peak_live_tokens,
            decode_peak_kv_bytes=r.decode_peak_kv_bytes,
            mean_kv_bytes=r.mean_kv_bytes,
            peak_kv_bytes_16bit=r.peak_kv_bytes_16bit,
            decode_peak_kv_bytes_16bit=r.decode_peak_kv_bytes_16bit,
            mean_kv_bytes_16bit=r.mean_kv_bytes_16bit,
            **{name: getattr(r, name) for name in STATE_PEAKS},
            batch_rows=len(inputs),
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
        records.append(
            _record(u, "ok", metrics=metrics, timings=timings, source=u.source, finished=utc_timestamp())
        )
    return records


def _setting(u: Unit) -> ResolvedMethod:
    """The unit's resolved setting; a budget its method cannot run at is raised here (anew: the
    grid's error is shared by many units), so that the unit fails as one whose cache refuses
    the model does."""
    if isinstance(u.resolved, BudgetError):
        raise BudgetError(str(u.resolved)) from u.resolved  # the record shows where it was refused
    return u.resolved


def _run_id(u: Unit) -> tuple:
    c = u.config
    return (c["method"], c["budget"], json.dumps(c["knobs"], sort_keys=True))


def eval_task(model, tokenizer, task: Task) -> list[dict]:
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
                _setting(u),
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
            compressions=problem["compressions"],
        )
        timings = {"seconds": time.perf_counter() - start, "generate_seconds": result["generate_seconds"]}
        records.append(
            _record(u, "ok", metrics=metrics, timings=timings, source=u.source, finished=utc_timestamp())
        )
    return records
