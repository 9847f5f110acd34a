"""Trace-replay fidelity: how far a compressed cache's next-token distributions drift from
the full cache's while a real reasoning trace is teacher-forced through the model.

At every trace position p (each fed trace token, predicting token p+1) we record
KL(full ‖ compressed), whether the two argmaxes agree, and the NLL of the true next token
under both (their mean difference gives the perplexity ratio).

One pass per trace serves every method: the full cache advances block by block (256
tokens), its log-probs and probs for the block are kept (2 × [block, vocab] float32,
~100 MB for a 49K vocabulary) while each method's cache advances through the same block,
then discarded. Several traces can go as one left-padded batch (`replay_batch`: each row
compresses as if alone); blocks then narrow to block // rows columns (at least 32).
Nothing of size [trace, vocab] is ever stored, and the reference costs one forward per
block however many methods share it.

Each method's cache is fed in chunks that end exactly where step-by-step decoding would
compress or, with quantized storage, move a group out of its full-precision residual
(`chunk_plan`): in between nothing is evicted or quantized, so a chunked forward sees the
same cache as single-token steps and gives the same logits (tests prove it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from reasonkv.core.cache import CompressedCache
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.models import max_positions
from reasonkv.harness.replay_plot import plot_fidelity  # noqa: F401 (its old home: callers import it here)
from reasonkv.harness.replay_run import ReplayRun
from reasonkv.harness.traces import ReplayInput, check_replay_input
from reasonkv.methods.api import make_cache
from reasonkv.methods.resolved import resolve_method

BLOCK = 256
"""Reference block (and the chunk of never-compressing caches): tokens per full-cache forward."""
BIN = 128
"""Default width, in trace tokens, of the position bins of the curves."""
COMPARE_ROWS = 64
"""Positions compared at a time (temporaries of COMPARE_ROWS × vocabulary floats)."""
FULL_CACHE = resolve_method("full")
"""The reference every replay compares with: the full cache, resolved once."""


# ------------------------------------------------------------------ chunk plan
def chunk_plan(cache: CompressedCache) -> int | None:
    """The most tokens `cache` can take in one forward without crossing a compression point
    or, with quantized storage, a point where a group leaves the full-precision residual
    (None = unbounded: it never compresses or quantizes). Call it after the prompt's forward."""
    steps = [s for s in (cache.steps_until_compress(), cache.steps_until_settle()) if s is not None]
    return min(steps) if steps else None


# ------------------------------------------------------------------ comparison
def reference_stats(ref_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """What every method's comparison needs from the full cache's logits [..., k, V], computed once
    per block: log-probs and probs (float32, or float64 for float64 input), argmax, NLL."""
    logp = torch.log_softmax(ref_logits.to(torch.promote_types(ref_logits.dtype, torch.float32)), dim=-1)
    return {
        "logp": logp,
        "p": logp.exp(),
        "argmax": ref_logits.argmax(-1),
        "nll_full": -logp.gather(-1, targets[..., None].to(logp.device))[..., 0],
    }


def compare_to_reference(
    ref: dict[str, torch.Tensor], logits: torch.Tensor, targets: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per position [..., k]: KL(full ‖ this), top-1 agreement, NLL of `targets` under both.
    Exactly 0 KL when the logits are bitwise the reference's (same log-softmax, zero differences).
    Computed COMPARE_ROWS positions at a time, so the [positions, V] temporaries of a large
    batch chunk stay small."""
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    p, logp = ref["p"].reshape(-1, vocab), ref["logp"].reshape(-1, vocab)
    flat_targets = targets.reshape(-1, 1).to(logits.device)
    kl = torch.empty(flat.shape[0], dtype=logp.dtype, device=logits.device)
    nll = torch.empty_like(kl)
    for a in range(0, flat.shape[0], COMPARE_ROWS):
        sl = slice(a, a + COMPARE_ROWS)
        logq = torch.log_softmax(flat[sl].to(logp.dtype), dim=-1)
        kl[sl] = (p[sl] * (logp[sl] - logq)).sum(-1)
        nll[sl] = -logq.gather(-1, flat_targets[sl])[:, 0]
    return {
        "kl": kl.clamp(min=0.0).reshape(shape),  # rounding can dip below 0
        "top1": ref["argmax"] == logits.argmax(-1),
        "nll_full": ref["nll_full"],
        "nll": nll.reshape(shape),
    }


def compare_logits(
    ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per position [k]: KL(ref ‖ other), top-1 agreement, NLL of `targets` under both.
    ref_logits, logits: [..., k, V] (unnormalised); targets: [..., k] the true next tokens."""
    return compare_to_reference(reference_stats(ref_logits, targets), logits, targets)


# --------------------------------------------------------------------- results
STATE_PEAKS = (
    "peak_state_bytes",
    "decode_peak_state_bytes",
    "peak_state_bytes_16bit",
    "decode_peak_state_bytes_16bit",
)
"""The per-sequence peaks of everything a cache holds, as a replay result and a sweep record name them."""


@dataclass
class ReplayResult:
    """Per-position fidelity of one method on one trace (all tensors [positions], position i
    is trace token i: the fed token prompt_len + i predicting token prompt_len + i + 1)."""

    trace_id: str
    run: ReplayRun
    prompt_len: int
    kl: torch.Tensor
    top1: torch.Tensor
    nll_full: torch.Tensor
    nll: torch.Tensor
    live_tokens: float = 0.0
    """Mean KV tokens per head that each trace position attended to (the cache it saw)."""
    # Peaks per sequence (a batch's K/V bytes over its rows), over the whole run and over the
    # trace positions only: a prompt longer than the budget is held whole for its one forward.
    peak_live_tokens: float = 0.0  # the most KV tokens per head any token attended to
    peak_kv_bytes: float = 0.0  # the most K/V storage held at once
    decode_peak_live_tokens: float = 0.0
    decode_peak_kv_bytes: float = 0.0
    mean_kv_bytes: float = 0.0  # held after each forward, averaged over the positions it served
    # The same three with floating-point elements priced at 16 bits (as served in bf16/fp16).
    peak_kv_bytes_16bit: float = 0.0
    decode_peak_kv_bytes_16bit: float = 0.0
    mean_kv_bytes_16bit: float = 0.0
    # Everything a sequence holds (K/V, slot indices, query windows, beacons, scores, policy
    # state): its peaks, as run and at 16 bits. This is what decides how many sequences fit.
    peak_state_bytes: float = 0.0
    decode_peak_state_bytes: float = 0.0
    peak_state_bytes_16bit: float = 0.0
    decode_peak_state_bytes_16bit: float = 0.0
    forwards: int = 0
    compressions: int = 0
    """Compression events over the trace, all layers together."""
    seconds: float = 0.0

    @property
    def positions(self) -> int:
        return int(self.kl.numel())

    def sums(self) -> dict[str, float]:
        return _sums(self.kl, self.top1, self.nll_full, self.nll)

    def curve(self, bin_size: int = BIN) -> list[dict]:
        return curve_of([self], bin_size)

    def to_dict(self, bin_size: int = BIN, per_position: bool = False) -> dict:
        out = {
            "trace": self.trace_id,
            **self.run.to_dict(),
            "prompt_len": self.prompt_len,
            **metrics(self.sums()),
            "live_tokens": self.live_tokens,
            "peak_live_tokens": self.peak_live_tokens,
            "peak_kv_bytes": self.peak_kv_bytes,
            "decode_peak_live_tokens": self.decode_peak_live_tokens,
            "decode_peak_kv_bytes": self.decode_peak_kv_bytes,
            "mean_kv_bytes": self.mean_kv_bytes,
            "peak_kv_bytes_16bit": self.peak_kv_bytes_16bit,
            "decode_peak_kv_bytes_16bit": self.decode_peak_kv_bytes_16bit,
            "mean_kv_bytes_16bit": self.mean_kv_bytes_16bit,
            **{name: getattr(self, name) for name in STATE_PEAKS},
            "forwards": self.forwards,
            "compressions": self.compressions,
            "seconds": self.seconds,
            "curve": self.curve(bin_size),
        }
        if per_position:
            out["per_position"] = {
                "kl": self.kl.tolist(),
                "top1": self.top1.int().tolist(),
                "nll_full": self.nll_full.tolist(),
                "nll": self.nll.tolist(),
            }
        return out


def _sums(kl, top1, nll_full, nll) -> dict[str, float]:
    return {
        "n": int(kl.numel()),
        "kl": float(kl.sum()),
        "top1": float(top1.double().sum()),
        "nll_full": float(nll_full.sum()),
        "nll": float(nll.sum()),
    }


def metrics(s: dict[str, float]) -> dict[str, float | int | None]:
    """Pooled sums -> mean KL, top-1 agreement, perplexity ratio exp(mean NLL − mean NLL full)."""
    n = s["n"]
    if n == 0:
        return {
            "positions": 0,
            "mean_kl": None,
            "top1": None,
            "ppl_ratio": None,
            "nll": None,
            "nll_full": None,
        }
    return {
        "positions": n,
        "mean_kl": s["kl"] / n,
        "top1": s["top1"] / n,
        "ppl_ratio": math.exp((s["nll"] - s["nll_full"]) / n),
        "nll": s["nll"] / n,
        "nll_full": s["nll_full"] / n,
    }


def curve_of(results: list[ReplayResult], bin_size: int = BIN) -> list[dict]:
    """Metrics per bin of trace position [start, end), pooled over `results` (traces)."""
    if bin_size <= 0:
        raise ValueError(f"bin size must be positive, got {bin_size}")
    longest = max((r.positions for r in results), default=0)
    out = []
    for start in range(0, longest, bin_size):
        sl = slice(start, start + bin_size)
        parts = [r for r in results if r.positions > start]
        s = _sums(
            *(torch.cat([getattr(r, name)[sl] for r in parts]) for name in ("kl", "top1", "nll_full", "nll"))
        )
        out.append(
            {"start": start, "end": min(start + bin_size, longest), "traces": len(parts), **metrics(s)}
        )
    return out


def summarize(results: list[ReplayResult], bin_size: int = BIN) -> list[dict]:
    """One row per run (method, budget, knobs), pooled over traces: every position of every
    trace weighs the same. Rows keep the order in which runs first appear."""
    groups: dict[str, list[ReplayResult]] = {}
    for r in results:
        groups.setdefault(_run_key(r.run), []).append(r)
    rows = []
    for group in groups.values():
        run = group[0].run
        total = {"n": 0, "kl": 0.0, "top1": 0.0, "nll_full": 0.0, "nll": 0.0}
        for r in group:
            for k, v in r.sums().items():
                total[k] += v
        weights = [r.positions for r in group]
        rows.append(
            {
                **run.to_dict(),
                "label": run.label,
                "traces": len(group),
                **metrics(total),
                "live_tokens": sum(r.live_tokens * w for r, w in zip(group, weights, strict=True))
                / max(1, sum(weights)),
                "seconds": sum(r.seconds for r in group),
                "curve": curve_of(group, bin_size),
            }
        )
    return rows


def _run_key(run: ReplayRun) -> str:
    return f"{run.method}|{run.budget}|{sorted(run.knobs.items())}"


# ---------------------------------------------------------------------- replay
@dataclass
class _Lane:
    """One method's cache advancing through the traces (one batch row each), with its records."""

    run: ReplayRun
    cache: CompressedCache
    stepwise: bool
    records: list[dict[str, torch.Tensor]] = field(default_factory=list)
    live_weighted: torch.Tensor | None = None  # [B] live tokens summed over positions
    peak_live: torch.Tensor | None = None  # [B] over the trace positions
    prefill_peak_kv: tuple[int, int, int, int] = (0, 0, 0, 0)  # the meter's peaks in the prompt's forward
    kv_weighted: torch.Tensor | None = None  # [B] K/V bytes per row summed over positions
    kv_weighted_16bit: torch.Tensor | None = None  # the same at 16 bits
    forwards: int = 0
    seconds: float = 0.0


@dataclass
class _Batch:
    """Traces laid out as one left-padded batch: every prompt ends at column `prompt_cols`, so
    column prompt_cols + i is trace position i of every row; shorter rows are padded at the end
    too (masked, and their positions there are never read)."""

    ids: torch.Tensor  # [B, columns]
    mask: torch.Tensor | None  # [B, columns] long, None when nothing is padded
    positions: torch.Tensor | None  # [B, columns] RoPE positions, None when nothing is padded
    prompt_cols: int
    lengths: list[int]  # trace positions per row (tokens after the prompt, minus the last)

    def forward(self, model, cache, a: int, b: int, **kwargs):
        if self.mask is not None:
            kwargs.update(attention_mask=self.mask[:, :b], position_ids=self.positions[:, a:b])
        return model(input_ids=self.ids[:, a:b], **cache_arg(cache), **kwargs)


def _layout(inputs: list[ReplayInput], device) -> _Batch:
    prompt_cols = max(inp.prompt_len for inp in inputs)
    trace_cols = max(int(inp.input_ids.shape[1]) - inp.prompt_len for inp in inputs)
    b, cols = len(inputs), prompt_cols + trace_cols
    ids = torch.zeros(b, cols, dtype=torch.long)
    mask = torch.zeros(b, cols, dtype=torch.long)
    for r, inp in enumerate(inputs):
        pad = prompt_cols - inp.prompt_len
        n = int(inp.input_ids.shape[1])
        ids[r, pad : pad + n] = inp.input_ids[0]
        mask[r, pad : pad + n - 1] = 1  # a trace's last token is only a target, never fed
    lengths = [int(inp.input_ids.shape[1]) - inp.prompt_len - 1 for inp in inputs]
    if bool(mask[:, : prompt_cols + max(lengths)].all()):  # the columns ever fed
        return _Batch(ids.to(device), None, None, prompt_cols, lengths)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return _Batch(ids.to(device), mask.to(device), positions.to(device), prompt_cols, lengths)


def replay_batch(
    model,
    inputs: list[ReplayInput],
    runs: list[ReplayRun],
    *,
    block: int = BLOCK,
    stepwise: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[list[ReplayResult]]:
    """Replay several traces under every run in one pass: the traces form one left-padded
    batch (each method's cache compresses each row on its own, as if alone), so a forward
    serves every trace, and all methods share the full-cache reference. Returns
    results[trace][run]. A row's numbers equal its replay alone up to float rounding of the
    batched matmuls (tests compare them).

    stepwise=True feeds the method caches one token per forward (the slow reference that the
    chunk plan must equal); progress(k) is called each time one run has fed k more trace
    columns, so it moves with each run (in all: `replay_work(inputs, runs, batch=True)`).
    Per-row `seconds` is the lane's time divided by the rows (they shared every forward). A
    trace longer than the model's max_position_embeddings is a ValueError that names it."""
    if not inputs:
        raise ValueError("replay needs at least one trace")
    limit = max_positions(model.config)
    for inp in inputs:  # before any forward: a trace past the model's positions is refused
        check_replay_input(inp, limit)
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    device = next(model.parameters()).device
    batch = _layout(inputs, device)
    rows = len(inputs)
    lanes = []
    for run in runs:
        lanes.append(_Lane(run, make_cache(model, run.resolved), stepwise))
    reference = make_cache(model, FULL_CACHE)
    p0 = batch.prompt_cols
    # The reference keeps 2 × [rows, block, V] floats per block: a batch takes narrower blocks.
    block = max(min(block, 32), block // rows)
    end = p0 + max(batch.lengths)  # the last column of the longest trace predicts nothing
    valid_to = torch.tensor([p0 + n for n in batch.lengths])  # [B] first column past each row's positions
    with torch.no_grad():
        batch.forward(model, reference, 0, p0, logits_to_keep=1)
        for lane in lanes:
            t0 = time.perf_counter()
            batch.forward(model, lane.cache, 0, p0, logits_to_keep=1)
            lane.seconds += time.perf_counter() - t0
            lane.live_weighted = torch.zeros(rows, dtype=torch.float64)
            lane.kv_weighted = torch.zeros(rows, dtype=torch.float64)
            lane.kv_weighted_16bit = torch.zeros(rows, dtype=torch.float64)
            lane.peak_live = torch.zeros(rows, dtype=torch.float64)
            lane.prefill_peak_kv = lane.cache.kv_meter.restart_peak()
        for a in range(p0, end, block):
            b = min(a + block, end)
            targets = batch.ids[:, a + 1 : b + 1]
            ref = reference_stats(batch.forward(model, reference, a, b).logits, targets)
            for lane in lanes:
                t0 = time.perf_counter()
                _advance(model, lane, batch, a, b, ref, targets, valid_to, progress)
                lane.seconds += time.perf_counter() - t0
            del ref  # [B, block, V] twice: freed before the next block
    results: list[list[ReplayResult]] = [[] for _ in inputs]
    for lane in lanes:
        cat = {
            k: torch.cat([r[k] for r in lane.records], dim=1).cpu() for k in ("kl", "top1", "nll_full", "nll")
        }
        row_compressions = lane.cache.row_compressions()
        meter = lane.cache.kv_meter
        for r, inp in enumerate(inputs):
            n = batch.lengths[r]
            results[r].append(
                ReplayResult(
                    trace_id=inp.id,
                    run=lane.run,
                    prompt_len=inp.prompt_len,
                    **{k: v[r, :n] for k, v in cat.items()},
                    live_tokens=float(lane.live_weighted[r]) / n,
                    peak_live_tokens=max(float(lane.peak_live[r]), float(inp.prompt_len)),
                    peak_kv_bytes=max(lane.prefill_peak_kv[0], meter.peak) / rows,
                    decode_peak_live_tokens=float(lane.peak_live[r]),
                    decode_peak_kv_bytes=meter.peak / rows,
                    mean_kv_bytes=float(lane.kv_weighted[r]) / n,
                    peak_kv_bytes_16bit=max(lane.prefill_peak_kv[1], meter.peak_16bit) / rows,
                    decode_peak_kv_bytes_16bit=meter.peak_16bit / rows,
                    mean_kv_bytes_16bit=float(lane.kv_weighted_16bit[r]) / n,
                    peak_state_bytes=max(lane.prefill_peak_kv[2], meter.peak_state) / rows,
                    decode_peak_state_bytes=meter.peak_state / rows,
                    peak_state_bytes_16bit=max(lane.prefill_peak_kv[3], meter.peak_state_16bit) / rows,
                    decode_peak_state_bytes_16bit=meter.peak_state_16bit / rows,
                    forwards=lane.forwards,
                    compressions=int(row_compressions[r]),
                    seconds=lane.seconds / rows,
                )
            )
    return results


def _live_per_head(cache: CompressedCache) -> torch.Tensor:
    """[B] mean over layers and heads of the real tokens each row holds."""
    layers = [layer for layer in cache.layers if layer.is_initialized]
    if not layers:
        return torch.zeros(1, dtype=torch.float64)
    return sum(layer.n_valid.double().mean(-1).cpu() for layer in layers) / len(layers)


def _advance(
    model,
    lane: _Lane,
    batch: _Batch,
    a: int,
    b: int,
    ref: dict[str, torch.Tensor],
    targets: torch.Tensor,
    valid_to: torch.Tensor,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Feed columns [a, b) into the lane's cache in chunks that end at its compression points,
    calling progress(k) after each chunk of k columns."""
    pos = a
    while pos < b:
        plan = 1 if lane.stepwise else chunk_plan(lane.cache)
        k = b - pos if plan is None else min(plan, b - pos)
        live = _live_per_head(lane.cache)
        logits = batch.forward(model, lane.cache, pos, pos + k).logits
        lane.records.append(
            compare_to_reference(
                {name: t[:, pos - a : pos - a + k] for name, t in ref.items()},
                logits,
                targets[:, pos - a : pos - a + k],
            )
        )
        # The i-th token of the chunk attends to the live cache before it plus i tokens: the
        # same count as in single-token decoding (compression comes after the chunk). Only a
        # row's own positions count (not the padding after a shorter trace).
        k_row = (valid_to - pos).clamp(min=0, max=k).double()
        lane.live_weighted += k_row * live + k_row * (k_row + 1) / 2
        lane.peak_live = torch.maximum(lane.peak_live, live + k_row)
        lane.kv_weighted += k_row * (lane.cache.kv_meter.current / batch.ids.shape[0])
        lane.kv_weighted_16bit += k_row * (lane.cache.kv_meter.current_16bit / batch.ids.shape[0])
        lane.forwards += 1
        pos += k
        if progress is not None:
            progress(k)


def replay_work(inputs: list[ReplayInput], runs: list[ReplayRun], batch: bool = False) -> int:
    """The progress total of replaying `inputs` under `runs`: runs × trace positions (one by one)
    or runs × the longest trace's positions (one `replay_batch`)."""
    lengths = [int(i.input_ids.shape[1]) - 1 - i.prompt_len for i in inputs]
    return len(runs) * (max(lengths, default=0) if batch else sum(lengths))


def replay_methods(
    model,
    input_ids: torch.Tensor,
    prompt_len: int,
    runs: list[ReplayRun],
    *,
    trace_id: str = "trace",
    block: int = BLOCK,
    stepwise: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[ReplayResult]:
    """Replay one trace (input_ids [1, n], the first `prompt_len` tokens are the prompt)
    under every run in one pass, sharing the full-cache reference. Returns one result per
    run, in order (see `replay_batch` for several traces in one pass)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"replay takes one trace at a time: input_ids [1, n], got {tuple(input_ids.shape)}")
    inp = ReplayInput(trace_id, input_ids, prompt_len)
    return replay_batch(model, [inp], runs, block=block, stepwise=stepwise, progress=progress)[0]


def replay_trace(
    model,
    input_ids: torch.Tensor,
    prompt_len: int,
    method: str,
    budget: int | None = None,
    knobs: dict | None = None,
    **kwargs,
) -> ReplayResult:
    """Replay one trace under one method (see `replay_methods` for several in one pass)."""
    return replay_methods(
        model, input_ids, prompt_len, [ReplayRun(method, budget, dict(knobs or {}))], **kwargs
    )[0]


def reference_logits(model, input_ids: torch.Tensor, prompt_len: int, block: int = BLOCK) -> torch.Tensor:
    """The full-cache logits [n − 1 − prompt_len, V] at the trace positions, computed the way
    the replay computes its reference (prompt forward, then blocks). For tests and plots."""
    cache = make_cache(model, FULL_CACHE)
    ids = input_ids.to(next(model.parameters()).device)
    n = int(ids.shape[1])
    out = []
    with torch.no_grad():
        model(input_ids=ids[:, :prompt_len], **cache_arg(cache), logits_to_keep=1)
        for a in range(prompt_len, n - 1, block):
            out.append(model(input_ids=ids[:, a : min(a + block, n - 1)], **cache_arg(cache)).logits[0])
    return torch.cat(out)
