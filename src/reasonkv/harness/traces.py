"""Reasoning traces for replay: loading the jsonl and turning a row into model input.

A row has `problem` and `trace` (a jsonl per model in the reference data folder). The
problem goes into the model's chat template as the user turn and the trace is the
assistant's text, so the replayed tokens look like the model's own chain of thought.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from reasonkv.util.records import RecordError, describe_json, not_utf8, pick_by_id, read_jsonl_objects


@dataclass
class ReplayInput:
    id: str
    input_ids: torch.Tensor  # [1, n] prompt + trace tokens
    prompt_len: int  # tokens before the trace starts


def load_traces(
    path: str | Path,
    limit: int | None = None,
    variant: str | None = "well_posed",
    ids: list[str] | None = None,
) -> list[dict]:
    """Rows of a trace jsonl (each needs `id`, `problem`, `trace`), in file order. A line that
    is not such a row is a RecordError (a ValueError) naming the file and line.

    variant: keep only rows whose `variant` field equals it (None = all rows).
    ids: keep only these ids (in the given order); limit: the first N after filtering.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trace file at {path}")
    rows = [check_trace_row(row, f"{path}:{n}") for n, row in read_jsonl_objects(path, "trace row")]
    if variant is not None:
        rows = [r for r in rows if r.get("variant", variant) == variant]
    if ids is not None:
        rows = pick_by_id(rows, ids, "trace", path)
    return rows[:limit] if limit is not None else rows


def load_problem_rows(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows of a jsonl whose `problem` strings the model will answer to write its own traces,
    in file order (the first `limit`); a row without a `problem` string names its line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no problem file at {path}")
    rows = []
    for n, row in read_jsonl_objects(path, "problem row"):
        if "problem" not in row:
            raise RecordError(f"{path}:{n}: each row needs a `problem` field")
        if not isinstance(row["problem"], str):
            raise RecordError(f"{path}:{n}: `problem` must be a string, got {describe_json(row['problem'])}")
        rows.append(row)
    return rows[:limit] if limit is not None else rows


def check_trace_row(row: dict, where: str) -> dict:
    """A trace row with `problem` and `trace` strings and an `id` (a number becomes its string);
    anything else is a RecordError naming `where` (file:line) and the field."""
    missing = {"id", "problem", "trace"} - set(row)
    if missing:
        raise RecordError(f"{where}: trace rows need {sorted(missing)}")
    for key in ("problem", "trace"):
        if not isinstance(row[key], str):
            raise RecordError(f"{where}: `{key}` must be a string, got {describe_json(row[key])}")
        if (why := not_utf8(row[key])) is not None:
            raise RecordError(f"{where}: `{key}` is {why}")
    if isinstance(row["id"], int) and not isinstance(row["id"], bool):
        row["id"] = str(row["id"])
    if not isinstance(row["id"], str) or not row["id"]:
        raise RecordError(f"{where}: `id` must be a non-empty string or an integer, got {row['id']!r}")
    return row


def replay_input(tokenizer, row: dict, max_tokens: int | None = None) -> ReplayInput:
    """Chat-templated prompt + trace tokens, truncated to `max_tokens` in total."""
    user = [{"role": "user", "content": row["problem"]}]
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    else:
        prompt = f"Problem: {row['problem']}\nSolution: "
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    trace_ids = tokenizer(row["trace"], add_special_tokens=False)["input_ids"]
    ids = prompt_ids + trace_ids
    if max_tokens is not None:
        if max_tokens <= len(prompt_ids):
            raise ValueError(
                f"max_tokens={max_tokens} leaves no trace after the {len(prompt_ids)}-token prompt"
            )
        ids = ids[:max_tokens]
    return ReplayInput(row["id"], torch.tensor([ids]), len(prompt_ids))
