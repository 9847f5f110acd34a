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
    return [row for _, row in load_traces_where(path, limit, variant, ids)]


def load_traces_where(
    path: str | Path,
    limit: int | None = None,
    variant: str | None = "well_posed",
    ids: list[str] | None = None,
) -> list[tuple[str, dict]]:
    """`load_traces`, each row with where it came from ("file:line"), for errors that name it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trace file at {path}")
    rows = [
        (f"{path}:{n}", check_trace_row(row, f"{path}:{n}"))
        for n, row in read_jsonl_objects(path, "trace row")
    ]
    if variant is not None:
        rows = [(w, r) for w, r in rows if r.get("variant", variant) == variant]
    if ids is not None:
        where = {id(r): w for w, r in rows}
        rows = [(where[id(r)], r) for r in pick_by_id([r for _, r in rows], ids, "trace", path)]
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


def replay_input(
    tokenizer, row: dict, max_tokens: int | None = None, *, where: str | None = None
) -> ReplayInput:
    """Chat-templated prompt + trace tokens, truncated to `max_tokens` in total. A `max_tokens`
    that leaves no trace is a ValueError naming the trace (its id, and `where`, e.g. "file:line",
    when given); `check_replay_input` checks the result against a replay's needs."""
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
                f"{trace_name(row['id'], where)}: max_tokens={max_tokens} leaves no trace after "
                f"its {len(prompt_ids)}-token prompt"
            )
        ids = ids[:max_tokens]
    return ReplayInput(row["id"], torch.tensor([ids]), len(prompt_ids))


def trace_name(trace_id: str, where: str | None = None) -> str:
    """How an error names a trace: "file:line (trace 'id')", or "trace 'id'"."""
    return f"{where} (trace {trace_id!r})" if where else f"trace {trace_id!r}"


def check_replay_input(
    inp: ReplayInput, max_positions: int | None = None, where: str | None = None
) -> ReplayInput:
    """`inp` if it can be replayed: input_ids [1, n] with a prompt of at least one token, at least
    2 trace tokens (one fed, one predicted), and, when `max_positions` is given (the model's
    max_position_embeddings), n tokens within it: positions past what the model was built for
    would be compared as if they meant something. Otherwise a one-line ValueError naming it."""
    name = trace_name(inp.id, where)
    shape = tuple(inp.input_ids.shape)
    if len(shape) != 2 or shape[0] != 1:
        raise ValueError(f"{name}: input_ids must be [1, n], got {shape}")
    n = shape[1]
    if inp.prompt_len < 1:
        raise ValueError(f"{name}: needs a prompt of at least 1 token, got {inp.prompt_len}")
    if n - inp.prompt_len < 2:
        raise ValueError(
            f"{name}: {n - inp.prompt_len} trace token(s) after its {inp.prompt_len}-token prompt; "
            "replay needs at least 2"
        )
    if max_positions is not None and n > max_positions:
        raise ValueError(
            f"{name}: {n} tokens ({inp.prompt_len} prompt + {n - inp.prompt_len} trace) run past the "
            f"model's {max_positions} positions (max_position_embeddings); use max_tokens of at most "
            f"{max_positions}"
        )
    return inp
