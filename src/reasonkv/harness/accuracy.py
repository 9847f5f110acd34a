"""Task accuracy under a KV budget: generate answers to math problems and judge the last \\boxed{}.

Each problem becomes a chat-templated user turn ending with INSTRUCTION. Every generate call
gets a fresh reasonkv cache (make_cache), so batch rows and samples never share KV state.
Reported beside pass@1 (and pass@k, maj@k for n samples, each with a bootstrap standard
error: eval_stats): mean generated length and truncation rate (a method that makes
the model ramble until the cap looks "accurate-but-long" otherwise), generated tokens per
second of generate() wall time (prefill included), and the KV bytes per sequence sampled
after every decoding step: K/V storage (peak, mean) and the bytes of live tokens (peak, mean).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from reasonkv.core.hf_compat import cache_arg
from reasonkv.harness.answers import extract_boxed, grader, is_correct
from reasonkv.harness.eval_stats import aggregate
from reasonkv.methods.api import GREEDY, make_cache
from reasonkv.methods.resolved import ResolvedMethod, resolve_method

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
THINK_CLOSE = "\n</think>\n\n"


def build_prompt(tokenizer, problem: str) -> str:
    """The text fed to the model: the chat template around problem + INSTRUCTION when the
    tokenizer has one (generation prompt added), else a plain Problem/Solution frame."""
    user = f"{problem}\n\n{INSTRUCTION}"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
    return f"Problem: {user}\nSolution: "


def eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end a completion: the generation config's EOS (int or list), else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


class _KVMeter(StoppingCriteria):
    """Never stops anything: after every step, records per sequence the K/V storage the cache
    holds (kv_bytes, allocated capacity) and the bytes of the tokens it keeps live."""

    def __init__(self, cache, rows: int, samples: list[tuple[float, float]]) -> None:
        self.cache, self.rows, self.samples = cache, rows, samples

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        mem = self.cache.memory()
        layers = [x for x in self.cache.layers if x.is_initialized and x.storage.allocated]
        live = sum(x.live_kv_bytes() for x in layers)
        self.samples.append((mem["kv_bytes"] / self.rows, live / self.rows))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass
class Completion:
    tokens: list[int]  # generated tokens (EOS included, padding excluded)
    finished: bool  # ended with an EOS token (not cut by max_new_tokens)


def _split_row(row: list[int], eos: set[int]) -> Completion:
    for i, tok in enumerate(row):
        if tok in eos:
            return Completion(row[: i + 1], True)
    return Completion(row, False)


def _generate(
    model, inputs: dict, cache, max_new_tokens: int, sampling: dict, kv_samples: list[tuple[float, float]]
):
    rows = int(inputs["input_ids"].shape[0])
    meter = StoppingCriteriaList([_KVMeter(cache, rows, kv_samples)])
    return model.generate(
        **inputs, **cache_arg(cache), max_new_tokens=max_new_tokens, stopping_criteria=meter, **sampling
    )


def _think_then_answer(
    model,
    tokenizer,
    inputs: dict,
    cache,
    eos: set[int],
    max_new_tokens: int,
    think_budget: int,
    sampling: dict,
    kv_samples: list[tuple[float, float]],
) -> Completion:
    """One sequence: think for at most think_budget tokens; if the text has not closed
    `</think>` by then, append THINK_CLOSE and let it answer with the tokens left."""
    width = inputs["input_ids"].shape[1]
    out = _generate(model, inputs, cache, think_budget, sampling, kv_samples)
    first = _split_row(out[0, width:].tolist(), eos)
    left = max_new_tokens - len(first.tokens)
    if first.finished or left <= 0:
        return first
    tail: list[int] = []
    if "</think>" not in tokenizer.batch_decode([first.tokens], skip_special_tokens=False)[0]:
        tail = list(tokenizer(THINK_CLOSE, add_special_tokens=False)["input_ids"])[:left]
        left -= len(tail)
    if left <= 0:
        return Completion(first.tokens + tail, False)
    ids = torch.cat([out, torch.tensor([tail], dtype=out.dtype, device=out.device)], dim=1)
    # The cache already holds everything but the last generated token; generate feeds only
    # the tokens past cache.get_seq_length().
    more = _generate(
        model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, cache, left, sampling, kv_samples
    )
    rest = _split_row(more[0, ids.shape[1] :].tolist(), eos)
    return Completion(first.tokens + tail + rest.tokens, rest.finished)


def _row_compressions(cache, rows: int) -> list[int | None]:
    """Compressions each batch row took part in, summed over the layers (None when the cache
    cannot tell)."""
    counts = getattr(cache, "row_compressions", None)
    if counts is None:
        return [None] * rows
    got = [int(c) for c in counts().tolist()]
    if not got:  # no layer has run a step with rows yet: nothing compressed
        return [0] * rows
    return got if len(got) == rows else [None] * rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def evaluate(
    model,
    tokenizer,
    problems: list[dict],
    method: str | ResolvedMethod = "snapkv",
    budget: int | None = 128,
    knobs: dict | None = None,
    n_samples: int = 1,
    greedy: bool = False,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int = 1024,
    seed: int = 0,
    batch_size: int = 1,
    think_budget: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict:
    """Generate n_samples completions per problem (rows of id, problem, answer) under `method`
    at `budget` and score them (`method` may be a `resolve_method` value: then it holds the
    budget and knobs, and those given here are not read).

    pass@1 is the mean correctness over every sample of every problem; with n_samples > 1,
    pass@k and maj@k too (eval_stats), and every aggregate has a bootstrap standard error
    under "stderr". Each sample records the compressions its cache made. Sampling (T, top-p)
    is seeded per generate call from `seed` and the call's first unit, so a run repeats
    exactly for the same seed, problems and batch_size. think_budget (one sequence per call):
    cap the thinking part of a thinking model, see _think_then_answer; max_new_tokens stays
    the cap on everything generated. progress(done, total, last problem id) after each call.
    """
    resolved = method if isinstance(method, ResolvedMethod) else resolve_method(method, budget, knobs)
    method, budget, knobs = resolved.name, resolved.budget, dict(resolved.knobs)
    if n_samples < 1 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError("n_samples, batch_size and max_new_tokens must be positive")
    if greedy and n_samples > 1:
        raise ValueError("greedy decoding gives the same completion every time: use n_samples=1 or sampling")
    if think_budget is not None:
        if not 0 < think_budget < max_new_tokens:
            raise ValueError(f"think_budget must be in 1..max_new_tokens-1, got {think_budget}")
        batch_size = 1  # the continuation step is per sequence
    make_cache(model, resolved)  # fail on what needs the model before any generation

    eos = eos_ids(model, tokenizer)
    pad = getattr(tokenizer, "pad_token_id", None)
    if greedy:
        sampling = dict(GREEDY)
    else:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": None}
    sampling["pad_token_id"] = pad
    chat = bool(getattr(tokenizer, "chat_template", None))

    units = [(p, s) for p in range(len(problems)) for s in range(n_samples)]
    completions: dict[tuple[int, int], Completion] = {}
    compressions: dict[tuple[int, int], int | None] = {}
    kv_samples: list[tuple[float, float]] = []
    gen_seconds = 0.0
    for start in range(0, len(units), batch_size):
        batch = units[start : start + batch_size]
        prompts = [build_prompt(tokenizer, problems[p]["problem"]) for p, _ in batch]
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        cache = make_cache(model, resolved)
        torch.manual_seed(seed * 1_000_003 + start)
        began = time.perf_counter()
        with torch.no_grad():
            if think_budget is not None:
                done = [
                    _think_then_answer(
                        model,
                        tokenizer,
                        inputs,
                        cache,
                        eos,
                        max_new_tokens,
                        think_budget,
                        sampling,
                        kv_samples,
                    )
                ]
            else:
                out = _generate(model, inputs, cache, max_new_tokens, sampling, kv_samples)
                width = inputs["input_ids"].shape[1]
                done = [_split_row(row, eos) for row in out[:, width:].tolist()]
        gen_seconds += time.perf_counter() - began
        completions.update(zip(batch, done, strict=True))
        compressions.update(zip(batch, _row_compressions(cache, len(batch)), strict=True))
        if progress is not None:
            progress(start + len(batch), len(units), problems[batch[-1][0]]["id"])

    per_problem = []
    for p, row in enumerate(problems):
        samples = [completions[(p, s)] for s in range(n_samples)]
        texts = tokenizer.batch_decode([c.tokens for c in samples], skip_special_tokens=True)
        preds = [extract_boxed(t) for t in texts]
        correct = [is_correct(pred, row["answer"]) for pred in preds]
        per_problem.append(
            {
                "id": row["id"],
                "prompt": build_prompt(tokenizer, row["problem"]),
                "answer": row["answer"],
                "predictions": preds,
                "correct": correct,
                "pass@1": sum(correct) / n_samples,
                "lengths": [len(c.tokens) for c in samples],
                "truncated": [not c.finished for c in samples],
                "outputs": texts,
                "compressions": [compressions[(p, s)] for s in range(n_samples)],
            }
        )
    flat = lambda key: [v for r in per_problem for v in r[key]]  # noqa: E731
    n = max(len(units), 1)
    generated = sum(flat("lengths"))
    storage, live = [s for s, _ in kv_samples], [x for _, x in kv_samples]
    stats = aggregate(per_problem, n_samples)
    return {
        "method": method,
        "budget": budget,
        "knobs": knobs,
        "n_problems": len(problems),
        "n_samples": n_samples,
        "greedy": greedy,
        "temperature": None if greedy else temperature,
        "top_p": None if greedy else top_p,
        "max_new_tokens": max_new_tokens,
        "think_budget": think_budget,
        "seed": seed,
        "batch_size": batch_size,
        "pass@1": sum(flat("correct")) / n,
        **{k: v for k, v in stats["scores"].items() if k != "pass@1"},
        "stderr": stats["stderr"],
        "grader": grader(),
        "mean_length": generated / n,
        "truncation_rate": sum(flat("truncated")) / n,
        "generated_tokens": generated,
        "generate_seconds": gen_seconds,
        "tokens_per_second": generated / gen_seconds if gen_seconds > 0 else 0.0,
        # Per sequence, over every decoding step: K/V storage, and the part holding live tokens.
        "peak_kv_bytes": max(storage, default=0.0),
        "mean_kv_bytes": _mean(storage),
        "peak_live_kv_bytes": max(live, default=0.0),
        "mean_live_kv_bytes": _mean(live),
        "problems": per_problem,
    }


def sample_rows(result: dict) -> list[dict]:
    """One row per generated sample of an `evaluate` result, in problem then sample order: the
    problem id, sample index, prompt, output text, extracted and gold answers, whether it was
    judged correct, tokens generated, whether max_new_tokens cut it, and the compressions its
    cache made (summed over layers; None when the cache could not tell)."""
    rows = []
    for problem in result["problems"]:
        for s, output in enumerate(problem["outputs"]):
            rows.append(
                {
                    "id": problem["id"],
                    "sample": s,
                    "prompt": problem.get("prompt"),
                    "output": output,
                    "extracted_answer": problem["predictions"][s],
                    "gold_answer": problem["answer"],
                    "correct": problem["correct"][s],
                    "tokens_generated": problem["lengths"][s],
                    "truncated": problem["truncated"][s],
                    "compressions": problem.get("compressions", [None] * len(problem["outputs"]))[s],
                }
            )
    return rows
