"""What an analysis returns: the per-query statistics of one trace and each method's replay."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reasonkv.harness.analyze.revisits import RevisitRule, missed_revisits


@dataclass
class MethodResult:
    """One method's replay of the trace: when it evicted each token, and its fidelity."""

    label: str
    method: str
    budget: int | None
    knobs: dict
    evicted_at: torch.Tensor  # [L, H, n] (NEVER_EVICTED = held to the end)
    kl_sum: float = 0.0
    top1_sum: float = 0.0
    positions: int = 0
    forwards: int = 0
    compressions: int = 0
    seconds: float = 0.0
    live_weighted: float = 0.0

    @property
    def live_tokens(self) -> float:
        """Mean KV tokens per head that each trace position attended to (as `reasonkv replay` reports)."""
        return self.live_weighted / self.positions if self.positions else 0.0

    @property
    def mean_kl(self) -> float | None:
        return self.kl_sum / self.positions if self.positions else None

    @property
    def top1(self) -> float | None:
        return self.top1_sum / self.positions if self.positions else None


@dataclass
class TraceAnalysis:
    """Everything `reasonkv analyze` draws. L layers, H KV heads, N recorded trace queries,
    n tokens, B distance bins, K = rule.top_k."""

    trace_id: str
    input_ids: torch.Tensor  # [n]
    prompt_len: int
    rule: RevisitRule
    stride: int
    positions: torch.Tensor  # [N] sequence index of each recorded query
    persistent: torch.Tensor  # [L, H, n] bool: the heads' persistent keys (excluded like sinks)
    far_frac: torch.Tensor  # [L, H, N]
    is_global: torch.Tensor  # [L, H, N] bool
    eligible: torch.Tensor  # [N] bool
    mean_dist: torch.Tensor  # [L, H, N]
    dist_hist: torch.Tensor  # [L, H, N, B]
    edges: torch.Tensor  # [B + 1]
    entropy: torch.Tensor  # [L, H, N] normalised, group mean (the profiler's signal)
    needed: torch.Tensor  # [L, H, N, K] key positions, -1 = none
    needed_weight: torch.Tensor  # [L, H, N, K]
    needed_mass: float
    maps: dict[int, torch.Tensor]  # layer -> [H, W, n] attention rows of the window queries
    map_positions: torch.Tensor  # [W]
    pre_queries: dict[int, torch.Tensor]  # layer -> [n, Hq, D] pre-RoPE queries of every token
    group_size: int
    layers: list[int] = field(default_factory=list)  # the layers with maps and pre-RoPE queries
    methods: list[MethodResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def n_layers(self) -> int:
        return self.far_frac.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.far_frac.shape[1]

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.numel())

    def global_fraction(self) -> torch.Tensor:
        """[L, H] share of the eligible recorded queries that are global (0 when none is eligible)."""
        n = int(self.eligible.sum())
        return self.is_global.float().sum(-1) / max(n, 1)

    def entropy_curve(self) -> torch.Tensor:
        """[L] mean normalised entropy over heads and recorded queries (the trace's Reasoning Wave)."""
        return self.entropy.mean((1, 2))

    def class_histograms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([L, H, B], [L, H, B]): mean distance histogram of the eligible local and of the global queries."""
        ok = self.eligible[None, None, :]
        glob, loc = self.is_global & ok, ~self.is_global & ok

        def mean_of(mask: torch.Tensor) -> torch.Tensor:
            total = (self.dist_hist * mask[..., None]).sum(2)
            return total / mask.sum(-1, keepdim=True).clamp(min=1)

        return mean_of(loc), mean_of(glob)

    def missed(self, result: MethodResult) -> dict:
        """Missed revisits of one method: counts over the global queries, in total, per layer
        ([L]) and per layer and KV head ([L][H])."""
        counts = missed_revisits(self.needed, self.positions, result.evicted_at) * self.is_global
        needed = (self.needed >= 0).sum(-1) * self.is_global  # [L, H, N]
        return {
            "missed_keys": int(counts.sum()),
            "needed_keys": int(needed.sum()),
            "missed_fraction": float(counts.sum()) / max(1, int(needed.sum())),
            "global_queries": int(self.is_global.sum()),
            "queries_with_missed": int((counts > 0).sum()),
            "per_layer": counts.sum((1, 2)).tolist(),
            "needed_per_layer": needed.sum((1, 2)).tolist(),
            "per_head": counts.sum(2).tolist(),
        }
