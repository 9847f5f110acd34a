"""Reasoning traces for replay: loading the jsonl and turning a row into model input.

A row has `problem` and `trace` (a jsonl per model in the reference data folder). The
problem goes into the model's chat template as the user turn and the trace is the
assistant's text, so the replayed tokens look like the model's own chain of thought.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from reasonkv.util.records import pick_by_id


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
    """Rows of a trace jsonl (each needs `id`, `problem`, `trace`), in file order.

    variant: keep only rows whose `variant` field equals it (None = all rows).
    ids: keep only these ids (in the given order); limit: the first N after filtering.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trace file at {path}")
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = {"id", "problem", "trace"} - set(row)
            if missing:
                raise ValueError(f"{path}:{n}: trace rows need {sorted(missing)}")
            rows.append(row)
    if variant is not None:
        rows = [r for r in rows if r.get("variant", variant) == variant]
    if ids is not None:
        rows = pick_by_id(rows, ids, "trace", path)
    return rows[:limit] if limit is not None else rows


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
