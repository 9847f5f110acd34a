"""`reasonkv demo`: one math problem, the full cache against two methods at a small budget.

It shows the three things the package is about, on the bundled SmolLM2-135M: the cache
really shrinks (KV bytes, live tokens per head), decoding keeps going through evictions,
and where the compressed run's text first departs from the full cache's (greedy decoding,
so any difference is caused by the eviction).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from reasonkv.core.models import DEFAULT_MODEL, load_model
from reasonkv.methods.api import GREEDY, generate, make_cache
from reasonkv.methods.registry import get_method
from reasonkv.util.formatting import format_bytes
from reasonkv.util.runtime import quiet_loading, set_threads
from reasonkv.util.tables import fill_table

PROBLEM = (
    "A store sells notebooks for $4 each and pens for $1.50 each. Maya buys some notebooks and "
    "twice as many pens, and she pays with a $50 bill. Her change is $15. "
    "How many notebooks did she buy? Then check the answer: compute the cost of the notebooks, "
    "the cost of the pens, their sum, and the change. "
    "Explain every step, and put the final answer in \\boxed{}."
)
"""A MATH-style word problem (answer 5). Asking for the check keeps the answer long enough
that prompt + answer pass budget + interval, so SnapKV compresses too, not only StreamingLLM."""

DEMO_MAX_NEW_TOKENS = 256
"""A cap, not a target: the full cache stops by itself at ~166 tokens (prompt 122 + 134 reach
SnapKV's first trigger, 128 + 128), while StreamingLLM's text drifts and runs to the cap. 256
keeps three runs plus the model load under 3 minutes on 2 CPU cores, with room for a busy host."""


@dataclass
class DemoRun:
    method: str
    tokens: list[int]
    text: str
    seconds: float
    memory: dict

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.n_tokens / max(self.seconds, 1e-9)


def memory_summary(cache) -> dict:
    """cache.memory() plus the mean live tokens per (layer, head) and compressions per layer."""
    mem = dict(cache.memory())
    live = mem.get("live_tokens")
    mem["live_mean"] = float(live.float().mean()) if live is not None else 0.0
    n_layers = max(len(cache.layers), 1)
    mem["compressions"] = round(cache.n_compressions / n_layers, 1)
    return mem


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """Index of the first generated token that differs (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def count_prompt_tokens(tokenizer, prompt: str) -> int:
    """Prompt length as reasonkv.generate feeds it (chat template when there is one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return len(tokenizer(prompt)["input_ids"])


def run_method(model, tokenizer, method: str, budget: int, prompt: str, max_new_tokens: int) -> DemoRun:
    cache = make_cache(model, method, budget)
    start = time.perf_counter()
    texts, new = generate(
        model,
        tokenizer,
        prompt,
        cache=cache,
        max_new_tokens=max_new_tokens,
        **GREEDY,
    )
    seconds = time.perf_counter() - start
    return DemoRun(method, new[0].tolist(), texts[0], seconds, memory_summary(cache))


def results_table(runs: list[DemoRun], budget: int, prompt_tokens: int) -> Table:
    full = runs[0]
    table = Table(
        title=f"budget {budget} tokens per KV head · prompt {prompt_tokens} tokens · greedy",
        caption="KV: key/value storage; physical: every tensor the cache holds. live: mean real tokens "
        "per (layer, KV head) at the end; evictions: compression rounds per layer; diverges: first "
        "generated token that differs from the full cache.",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        caption_justify="left",
        padding=(0, 1, 0, 0),
    )
    rows = []
    for run in runs:
        if run is full:
            diverge = "reference"
        else:
            at = first_divergence(full.tokens, run.tokens)
            diverge = "identical" if at is None else f"token {at}"
        rows.append(
            [
                run.method,
                str(run.n_tokens),
                f"{run.tokens_per_second:.1f}",
                format_bytes(run.memory["kv_bytes"]),
                format_bytes(run.memory["physical_bytes"]),
                f"{run.memory['live_mean']:.1f}",
                f"{run.memory['compressions']:g}",
                diverge,
            ]
        )
    columns = ("method", "tokens", "tok/s", "KV", "physical", "live", "evictions", "diverges")
    return fill_table(table, columns, rows)


def run_demo(
    model: str = DEFAULT_MODEL,
    budget: int = 128,
    max_new_tokens: int = DEMO_MAX_NEW_TOKENS,
    methods: tuple[str, ...] = ("snapkv", "streaming"),
    prompt: str = PROBLEM,
    console: Console | None = None,
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype | None = "auto",
) -> list[DemoRun]:
    """Run the full cache and `methods` at `budget` on one problem; print and return the runs
    (the model on `device` in `dtype`, as load_model takes them)."""
    console = console or Console(highlight=False)
    set_threads()
    # Validate before the slow load: a typo should not cost 20 seconds.
    for name in methods:
        get_method(name)
    if budget <= 0:
        raise ValueError(f"budget must be a positive number of tokens per KV head, got {budget}")

    start = time.perf_counter()
    with console.status(f"loading {model}…"), quiet_loading():
        lm, tokenizer = load_model(model, device=device, dtype=dtype)
    console.print(f"loaded {model} in {time.perf_counter() - start:.1f} s", markup=False)
    console.print(f"Problem: {prompt}\n", markup=False)
    prompt_tokens = count_prompt_tokens(tokenizer, prompt)

    runs: list[DemoRun] = []
    order = ["full", *[m for m in methods if m != "full"]]
    for i, name in enumerate(order, 1):
        label = "full cache" if name == "full" else f"{name} at budget {budget}"
        with console.status(f"[{i}/{len(order)}] {label}: generating up to {max_new_tokens} tokens…"):
            run = run_method(lm, tokenizer, name, budget, prompt, max_new_tokens)
        runs.append(run)
        console.print(
            f"[{i}/{len(order)}] {label}: {run.n_tokens} tokens in {run.seconds:.1f} s", markup=False
        )

    console.print()
    console.print("Full-cache answer:", style="bold")
    console.print(runs[0].text.strip(), markup=False)
    console.print()
    console.print(results_table(runs, budget, prompt_tokens))
    return runs
