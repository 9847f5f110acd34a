"""ReasonAlloc budget arithmetic (arXiv 2606.11164): pure torch.

Two levels, both with exact integer totals:
- layers: B_l ∝ demand_l^(1/τ), clipped to [lo, hi] and water-filled so Σ_l B_l = L·B
  (a flat demand curve, or τ → ∞, gives the uniform allocation exactly);
- heads, at every compression: b_h = floor + (total − H·floor)·u_h/Σu with the real-time
  utility u_h = 1 − Ĥ_h (normalised attention entropy; low entropy = focused = more),
  smoothed by an EMA; largest-remainder rounding keeps Σ_h b_h = total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from reasonkv.core.policy.base import Observation, candidate_mask, grouped_logits, masked_softmax
from reasonkv.core.policy.contract import (
    Allocator,
    HeadAllocator,
    LayerView,
    PolicyState,
    QueryWindowView,
    SplitRequest,
)
from reasonkv.core.policy.knob import knob, tokens, unit
from reasonkv.core.policy.rounding import fill_to_caps, largest_remainder, water_fill


def layer_budgets(
    demand: torch.Tensor, n_kv_heads: int, budget: int, tau: float = 1.0, lo: int = 0, hi: int | None = None
) -> torch.Tensor:
    """[L, H] per-head budgets, the same for every head of a layer, Σ = L·H·budget exactly.

    demand [L] > 0 is the profiled per-layer demand; tau = inf gives the uniform allocation.
    """
    n_layers = demand.numel()
    if math.isinf(tau) or bool((demand == demand[0]).all()):
        weights = torch.ones(n_layers, dtype=torch.float64)
    else:
        # Relative to the largest demand, so a small tau underflows the weights of the
        # other layers to 0 instead of overflowing the largest to inf.
        demand = demand.double().clamp(min=1e-12)
        weights = (demand / demand.max()) ** (1.0 / tau)
    per_layer = water_fill(weights, n_layers * budget, lo, hi)
    return per_layer[:, None].expand(n_layers, n_kv_heads).clone()


QUERY_CHUNK = 256
"""Queries per block when measuring a prefill's entropies, so the probabilities stay O(chunk × cache)."""


def _entropies(obs: Observation, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalised entropy H(a) / log(n) of each observed query's attention a over the n
    real keys it may see, per query head ([B, H, G, W]), and the attention itself."""
    allowed = candidate_mask(obs)  # [B, H, 1, W, T]
    probs = masked_softmax(grouped_logits(obs.queries, keys, obs.scaling), allowed)
    ent = -(probs * probs.clamp(min=1e-30).log()).sum(-1)  # [B, H, G, W]
    n = allowed.sum(-1).float()  # [B, H, 1, W]
    return torch.where(n > 1, ent / n.clamp(min=2).log(), torch.zeros_like(ent)), probs


def query_entropy(obs: Observation, keys: torch.Tensor) -> torch.Tensor:
    """[B, H, W] normalised attention entropy of each observed query, averaged over the group's
    query heads (0 for padding queries). Runs at every decode step of every layer, so it is
    written for few tensor ops: xlogy is 0 where a probability is 0."""
    parts = []
    for start in range(0, obs.queries.shape[2], QUERY_CHUNK):
        sl = slice(start, start + QUERY_CHUNK)
        block = replace(obs, queries=obs.queries[:, :, sl], query_index=obs.query_index[:, sl])
        allowed = candidate_mask(block)  # [B, H, 1, W, T]
        logits = grouped_logits(block.queries, keys, block.scaling).masked_fill(~allowed, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        ent = -torch.special.xlogy(p, p).sum(-1)  # [B, H, G, W]; NaN for a query with no key
        n = allowed.sum(-1)  # [B, H, 1, W]
        parts.append(torch.where(n > 1, ent / n.clamp(min=2).log(), 0.0).mean(2))
    return torch.cat(parts, dim=-1) * obs.query_valid[:, None, :]


def running_mean(
    previous: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, decay: float
) -> torch.Tensor:
    """Exponential moving average r <- decay·r + (1 − decay)·v over the valid values [B, H, W]
    (valid [B, W]) in order, from `previous` [B, H] (−1: none yet, then it starts at the first
    valid value). Closed form, so a chunk of W queries gives what W single steps would."""
    valid_f = valid.to(values.dtype)[:, None, :]  # [B, 1, W]
    after = valid_f.flip(-1).cumsum(-1).flip(-1) - valid_f  # valid values after each one
    weights = valid_f * (1.0 - decay) * decay**after
    n = valid_f.sum(-1)  # [B, 1]
    first = values.gather(-1, valid.long().argmax(-1)[:, None, None].expand(-1, values.shape[1], 1))[..., 0]
    start = torch.where(previous < 0, first, previous)
    updated = start * decay**n + (weights * values).sum(-1)
    return torch.where(n > 0, updated, previous)


def attention_stats(obs: Observation, keys: torch.Tensor, topk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head [B, H], averaged over the group's heads and the valid observed queries:
    the normalised entropy H(a) / log(n) of each query's attention a over the n real keys it
    may see, and the attention mass its `topk` strongest keys capture (0 = skip)."""
    norm, probs = _entropies(obs, keys)
    valid = obs.query_valid[:, None, None, :].float()
    denom = (valid.sum((-1, -2)) * norm.shape[2]).clamp(min=1)
    entropy = (norm * valid).sum((-1, -2)) / denom
    if topk <= 0:
        return entropy, torch.zeros_like(entropy)
    mass = probs.topk(min(topk, probs.shape[-1]), dim=-1).values.sum(-1)  # [B, H, G, W]
    return entropy, (mass * valid).sum((-1, -2)) / denom


def normalised_entropy(obs: Observation, keys: torch.Tensor) -> torch.Tensor:
    """[B, H] mean normalised attention entropy of the observed queries (see attention_stats)."""
    return attention_stats(obs, keys)[0]


def split_by_utility(
    total: torch.Tensor, utility: torch.Tensor, floor: torch.Tensor, cap: torch.Tensor
) -> torch.Tensor:
    """[B, H] integers: floor + a share of the rest ∝ utility, each ≤ cap, Σ_h = total [B]."""
    b, h = utility.shape
    total = total.long()
    floor = torch.minimum(floor.expand(b, h), cap)
    u = utility.clamp(min=1e-6)
    rest = (total - floor.sum(-1)).clamp(min=0)
    out = floor.double() + u / u.sum(-1, keepdim=True) * rest[:, None]
    # Heads that cannot use their share (fewer real tokens than it) give the excess back.
    out = fill_to_caps(out, cap, weights=u)
    target = torch.minimum(total, cap.sum(-1))
    return torch.minimum(largest_remainder(out, target), cap)


@dataclass
class ReasonAllocAllocator(Allocator):
    """Layer level: per-layer budgets ∝ profiled demand^(1/τ), exact total L·H·B.

    profile: path of a profile JSON (None = the packaged profile of the model). The
    profile is resolved by the caller (api layer) through `stats["load_demand"]`, which
    keeps this module free of model code. layer_level=False gives uniform layers (the
    head-only ablation).
    """

    profile: str | None = knob(None)
    tau: float = knob(1.0, gt=0.0)
    layer_level: bool = True

    def allocate(
        self, n_layers: int, n_kv_heads: int, budget: int, stats: dict | None = None
    ) -> torch.Tensor:
        if not self.layer_level:
            return torch.full((n_layers, n_kv_heads), budget, dtype=torch.long)
        stats = stats or {}
        if "load_demand" not in stats:
            raise ValueError("ReasonAllocAllocator needs stats['load_demand'] (make_cache provides it)")
        demand = torch.tensor(stats["load_demand"](self.profile), dtype=torch.float64)
        if demand.numel() != n_layers:
            raise ValueError(f"the profile has {demand.numel()} layers, the model {n_layers}")
        return layer_budgets(demand, n_kv_heads, budget, self.tau, lo=int(stats.get("min_budget", 0)))


@dataclass
class UtilityState(PolicyState):
    """One layer's head utilities, [B, H]: the last one used (−1 before a row's first
    compression) and the running entropy of every step's queries (−1 before any), with the
    count of the newest queries still waiting in the layer's query window to be folded in."""

    utility: torch.Tensor
    entropy: torch.Tensor
    window: QueryWindowView | None = None
    pending: int = 0
    ROW_FIELDS = ("utility", "entropy")


@dataclass
class EntropyHeadSplit(HeadAllocator):
    """Head level, at every compression: move budget inside a layer towards heads with high
    real-time utility u_h (EMA-smoothed), keeping the layer total and a per-head floor.

    prefer="focused": u = 1 − Ĥ (the paper: low entropy = information-rich = more budget);
    "diffuse": u = Ĥ (the other direction, to measure which wins).
    utility="step" (the paper): Ĥ is a running mean over every decode step's queries
    (`step_ema` per query); "compression": Ĥ of the scorer's window at each compression,
    smoothed across compressions by `ema`.
    floor_ratio: each head keeps at least floor_ratio × (layer total / H) tokens, and never
    fewer than the protected window (the starvation guard).
    """

    floor_ratio: float = unit(0.25)
    ema: float = unit(0.5)
    prefer: Literal["focused", "diffuse"] = "focused"
    utility: Literal["step", "compression"] = "step"
    step_ema: float = unit(0.95, open_high=True)
    entropy_every: int = tokens(32)
    """Decode queries wait in the layer's query window and enter the running entropy this many
    at a time, in one pass (or before any compression, so no key they saw is gone yet). Keys
    added after a query are causally masked, so the result is that of every single step."""

    @property
    def query_backlog(self) -> int:
        """The queries the layer's window must hold for the queue (see entropy_every)."""
        return self.entropy_every if self.utility == "step" else 0

    def new_state(self, view: LayerView) -> UtilityState:
        b, h, _, device = view.shape
        unset = torch.full((b, h), -1.0, device=device)
        return UtilityState(unset, unset.clone(), view.window)

    def on_step(self, step: Observation, keys: torch.Tensor, state: PolicyState | None) -> None:
        """Queue this forward's queries; fold the queue in when it would outgrow entropy_every."""
        if self.utility != "step" or not isinstance(state, UtilityState):
            return
        q = step.queries.shape[2]
        if state.pending + q <= self.entropy_every:
            state.pending += q  # they stay in the layer's query window until folded in
            return
        if state.pending:  # the queued ones are the window's newest: fold them in with this step's
            win, n = state.window, state.pending
            step = replace(
                step,
                queries=torch.cat([win.queries[:, :, -n:], step.queries], dim=2),
                query_index=torch.cat([win.query_index[:, -n:], step.query_index], dim=1),
            )
        self._fold(step, keys, state)

    def _fold(self, obs: Observation, keys: torch.Tensor, state: UtilityState) -> None:
        ent = query_entropy(obs, keys)
        state.entropy = running_mean(state.entropy, ent, obs.query_valid, self.step_ema)
        state.pending = 0

    def flush(self, obs: Observation, keys: torch.Tensor, state: UtilityState) -> None:
        """Fold the queued queries (the window's newest `pending`) in, over `keys` before any
        eviction; the split calls it, and so may anyone who reads the running entropy."""
        if state.pending and state.window is not None and state.window.queries is not None:
            n, win = state.pending, state.window
            self._fold(
                replace(obs, queries=win.queries[:, :, -n:], query_index=win.query_index[:, -n:]), keys, state
            )

    def split(self, request: SplitRequest, state: PolicyState | None = None) -> torch.Tensor:
        if request.keys is None:
            raise ValueError("EntropyHeadSplit needs the layer's keys to measure attention entropy")
        ent = normalised_entropy(request.obs, request.keys)
        if self.utility == "step" and isinstance(state, UtilityState):
            self.flush(request.obs, request.keys, state)
            ent = torch.where(state.entropy >= 0, state.entropy, ent)  # every step's, where measured
        utility = 1.0 - ent if self.prefer == "focused" else ent
        previous = state.utility if isinstance(state, UtilityState) else None
        if self.utility == "step":
            previous = None  # the running entropy is the smoothing; no second EMA on top
        if previous is not None and previous.shape == utility.shape:
            seen = previous >= 0  # -1: this row has not compressed yet
            utility = torch.where(seen, self.ema * previous + (1.0 - self.ema) * utility, utility)
        else:
            previous = torch.full_like(utility, -1.0)
        # Only rows that compress now move their average: a row's budgets must not depend on
        # when other rows of the batch compress.
        rows = request.rows
        compressing = rows[:, None] if rows is not None else torch.ones_like(utility, dtype=torch.bool)
        if isinstance(state, UtilityState):
            state.utility = torch.where(compressing, utility, state.utility)
        h = utility.shape[1]
        layer_total = request.layer_total
        even = layer_total.double() / h
        floor = (self.floor_ratio * even).floor().long().clamp(min=request.min_tokens)
        return split_by_utility(layer_total, utility, floor[:, None], request.n_valid)
