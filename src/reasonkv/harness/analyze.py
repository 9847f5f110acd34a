"""Thought revisiting, measured: which queries look far back, what they need, and who evicted it.

Both papers rest on observations about attention in long chains of thought; this module
makes them on a user's own model and trace. A replay of a trace with the full cache (an
observer scorer on the NEVER schedule, like the profiler) records, per layer and KV head,
each trace query's attention over the cache (the mean over the GQA group's query heads),
and from it:

- the classification of every query as local or global ("thought revisiting"), by the rule
  below (`RevisitRule`, `classify`);
- the attention-weighted distance histogram (`distance_histogram`);
- the keys each global query needed (`needed_keys`);
- the normalised attention entropy (the Reasoning Wave signal of reasonkv.harness.profile).

Method caches replay the same trace in lock-step (chunks that end where single-token
decoding would compress, as eval/replay does), and the step at which each of them evicted
each token (`update_eviction_times`) gives the missed revisits: needed keys that were
already gone when the global query came (`missed_revisits`).

The rule. Positions are sequence indices, d = query_pos − key_pos; a is the query's
attention over the keys it may see (one KV head: the mean over its query heads).
- Excluded keys: the first `n_sink` tokens (attention sinks) and the head's persistent keys,
  keys that are among the `top_k` strongest far keys of at least a share σ (`persistent`) of
  the recorded queries that see them at distance ≥ D (and at least `min_support` such
  queries: see `persistent_keys`). Those are secondary sinks (small models park much of
  their attention on a few early tokens, for every query); any method keeps them, since
  recent queries attend them too, so no revisit is needed to keep them.
- Far keys: not excluded, d ≥ D. Far mass F: the sum of the `top_k` largest a over far keys
  (the whole far mass of a diffuse head is large only because late in a trace most keys are far).
- f = F / (mass on keys not excluded), 0 when that is 0.
- A query is eligible when query_pos − D ≥ n_sink; it is GLOBAL when eligible and f ≥ φ
  (`fraction`), LOCAL otherwise. A head's global share counts eligible queries only.
Needed keys of a query: its top far keys in decreasing attention (ties: the older key), the
shortest prefix that reaches `mass` × F. A needed key j of the query at position p is MISSED
by a method when the method had evicted j before p (evicted_at[j] ≤ p: the first position
whose query could no longer see it).

The arithmetic functions are pure torch (hand-made attention rows in, tensors out).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from reasonkv.core.policy.base import EMPTY, Observation, grouped_logits, masked_softmax
from reasonkv.core.policy.rope import unapply_rope
from reasonkv.core.policy.scorers.beacon import add_points

NEVER_EVICTED = torch.iinfo(torch.int64).max
"""`evicted_at` of a token that is still held (or not yet seen)."""


# --------------------------------------------------------------------- the rule
@dataclass(frozen=True)
class RevisitRule:
    """Global ("thought revisiting") vs local queries: see the module docstring."""

    distance: int
    """D: keys at least this many tokens back are far."""
    fraction: float = 0.3
    """φ: a query is global when its top-k far keys hold at least this share of its mass."""
    n_sink: int = 4
    """The first n_sink tokens of the sequence are sinks: left out of every mass."""
    top_k: int = 8
    """Far mass = the mass of the k strongest far keys."""
    persistent: float | None = 0.5
    """σ: a key among the top-k far keys of at least this share of the queries that see it far
    is a persistent key of the head, excluded like a sink (None = no persistent keys)."""
    min_support: int = 16
    """A key needs at least this many queries that see it far before it can be persistent."""

    def __post_init__(self) -> None:
        if self.distance < 1:
            raise ValueError(f"the revisit distance D must be at least 1 token, got {self.distance}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"the global fraction φ must be in (0, 1], got {self.fraction}")
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be non-negative, got {self.n_sink}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")
        if self.persistent is not None and not 0.0 < self.persistent <= 1.0:
            raise ValueError(f"the persistent-key share σ must be in (0, 1] (or None), got {self.persistent}")
        if self.min_support < 1:
            raise ValueError(f"min_support must be at least 1, got {self.min_support}")

    def describe(self) -> str:
        persistent = (
            ""
            if self.persistent is None
            else f" and the head's persistent keys (in the top {self.top_k} far keys of ≥ "
            f"{self.persistent:g} of the queries that see them far, ≥ {self.min_support} such queries)"
        )
        return (
            f"a query at position p is global when p − {self.distance} ≥ {self.n_sink} and its {self.top_k} "
            f"strongest keys at least {self.distance} tokens back hold ≥ {self.fraction:g} of its attention "
            f"mass, sinks (the first {self.n_sink} tokens){persistent} left out of both masses"
        )


def default_distance(n_tokens: int) -> int:
    """D scaled to the trace: an eighth of it (256 for 2K tokens), at least 16."""
    return max(16, n_tokens // 8)


def _masks(
    query_pos: torch.Tensor, key_pos: torch.Tensor, rule: RevisitRule, excluded: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """visible, counted (visible, not a sink, not excluded), far: bool [..., T]
    for query_pos [...] and key_pos / excluded broadcastable to [..., T]."""
    qp = query_pos[..., None]
    visible = (key_pos >= 0) & (key_pos <= qp) & (key_pos != EMPTY)
    counted = visible & (key_pos >= rule.n_sink)
    if excluded is not None:
        counted = counted & ~excluded
    far = counted & (qp - key_pos >= rule.distance)
    return visible, counted, far


def eligible(query_pos: torch.Tensor, rule: RevisitRule) -> torch.Tensor:
    """bool [...]: a non-sink key at distance ≥ D exists for the query."""
    return query_pos - rule.distance >= rule.n_sink


def far_keys(
    attn: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    rule: RevisitRule,
    excluded: torch.Tensor | None = None,
    k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k (default rule.top_k) strongest far keys of attention rows attn [..., T]:
    (positions [..., K], -1 where there is no far key of positive attention; weights [..., K]) in decreasing
    attention, ties to the lower slot (in a full cache: the older key); K = min(k, T).
    query_pos [...]; key_pos [..., T] or [T] (EMPTY = no key); excluded bool like key_pos
    (True = a persistent key)."""
    _, _, far = _masks(query_pos, key_pos, rule, excluded)
    far_attn = torch.where(far, attn, attn.new_zeros(()))
    k = min(rule.top_k if k is None else k, attn.shape[-1])
    # Sort by (attention desc, slot asc) — full cache slots are positions, so ties go to the older key.
    vals, order = far_attn.sort(dim=-1, descending=True, stable=True)
    vals, order = vals[..., :k], order[..., :k]
    present = far.expand_as(far_attn).gather(-1, order) & (vals > 0)  # a zero-weight key is no pick
    positions = key_pos.expand_as(attn).gather(-1, order)
    return torch.where(present, positions, -1), torch.where(present, vals, vals.new_zeros(()))


def far_fraction(
    attn: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    rule: RevisitRule,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """f [...]: mass of the top_k far keys / mass on keys not excluded (0 when that is 0)."""
    _, counted, _ = _masks(query_pos, key_pos, rule, excluded)
    zero = attn.new_zeros(())
    total = torch.where(counted, attn, zero).sum(-1)
    far_mass = far_keys(attn, query_pos, key_pos, rule, excluded)[1].sum(-1)
    return torch.where(total > 0, far_mass / total.clamp(min=torch.finfo(attn.dtype).tiny), zero)


def classify(
    attn: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    rule: RevisitRule,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [...]: True = global (thought revisiting), False = local. See the module docstring."""
    f = far_fraction(attn, query_pos, key_pos, rule, excluded)
    return eligible(query_pos, rule) & (f >= rule.fraction)


def needed_keys(
    attn: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    rule: RevisitRule,
    mass: float = 0.5,
    excluded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The far keys a query needs: (positions [..., K] with -1 padding, weights [..., K]):
    the shortest prefix of its top far keys (see `far_keys`) that reaches `mass` × far mass."""
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"needed mass must be in (0, 1], got {mass}")
    positions, weights = far_keys(attn, query_pos, key_pos, rule, excluded)
    before = weights.cumsum(-1) - weights  # mass of the stronger keys already taken
    take = (positions >= 0) & (before < mass * weights.sum(-1, keepdim=True))
    return torch.where(take, positions, -1), torch.where(take, weights, weights.new_zeros(()))


def count_hits(hits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Add one to hits [..., n] at every position in positions [..., Q, K] (-1 = none): how
    often each key was among a query's top far keys."""
    flat = positions.flatten(-2)
    n = hits.shape[-1]
    ones = (flat >= 0).to(hits.dtype)
    grown = torch.cat([hits, hits.new_zeros(*hits.shape[:-1], 1)], dim=-1)
    grown.scatter_add_(-1, torch.where(flat >= 0, flat, n), ones)  # -1 -> a scratch column
    return grown[..., :n]


def far_support(query_pos: torch.Tensor, n_tokens: int, rule: RevisitRule) -> torch.Tensor:
    """[n_tokens]: how many of the queries query_pos [N] see each key at distance ≥ D."""
    keys = torch.arange(n_tokens)
    return (query_pos.cpu()[None, :] - keys[:, None] >= rule.distance).sum(-1)


def persistent_keys(
    top: torch.Tensor, support: torch.Tensor, rule: RevisitRule, rounds: int = 4
) -> torch.Tensor:
    """bool [..., n]: the persistent keys of heads (see the module docstring).

    top [..., N, M]: each eligible query's strongest far keys (sinks aside; M > rule.top_k,
    -1 = none), in decreasing attention; support [n]: how many of those queries see each key
    at distance ≥ D (`far_support`). A key is persistent when it has at least `min_support`
    queries and is among the top_k far keys, persistent keys excluded, of at least a share σ
    of them. Excluding the strongest persistent keys lets weaker ones into the top_k, so this
    is a fixpoint: each round counts the top_k from the lists with the keys found so far
    skipped, up to `rounds` rounds or until nothing changes (exact while a list holds top_k
    keys that are not persistent). All False when `rule.persistent` is None."""
    n = support.numel()
    found = torch.zeros(*top.shape[:-2], n + 1, dtype=torch.bool)
    if rule.persistent is None:
        return found[..., :n]
    flat = torch.where(top >= 0, top, n).flatten(-2).long()  # -1 -> a scratch column, never counted
    enough = support >= rule.min_support
    for _ in range(rounds):
        skip = found.gather(-1, flat).view_as(top) | (top < 0)
        rank = (~skip).long().cumsum(-1)
        counted = torch.where(~skip & (rank <= rule.top_k), top, -1)
        hits = count_hits(torch.zeros(*top.shape[:-2], n), counted)
        new = enough & (hits >= rule.persistent * support.to(hits.dtype))
        if not bool((new & ~found[..., :n]).any()):
            break
        found[..., :n] |= new
    return found[..., :n]


def approx_far_fraction(
    top: torch.Tensor, weights: torch.Tensor, total: torch.Tensor, excluded: torch.Tensor, rule: RevisitRule
) -> torch.Tensor:
    """f [..., N] from each query's strongest far keys top/weights [..., N, M] (sinks aside,
    -1 = none), its mass outside the sinks total [..., N] and the persistent keys excluded
    [..., n]: the first top_k listed keys that are not excluded give the far mass, and the
    listed excluded keys leave the total. Exact unless an excluded key with weight sits
    below a list's end (the survey uses it only to pick the layers to draw)."""
    n = excluded.shape[-1]
    flat = torch.where(top >= 0, top, n).flatten(-2).long()
    padded = torch.cat([excluded, torch.ones_like(excluded[..., :1])], dim=-1)
    skip = padded.gather(-1, flat).view_as(top)
    rank = (~skip).long().cumsum(-1)
    far = torch.where(~skip & (rank <= rule.top_k), weights, 0.0).sum(-1)
    rest = total - torch.where(skip & (top >= 0), weights, 0.0).sum(-1)
    return torch.where(rest > 0, far / rest.clamp(min=1e-30), torch.zeros_like(rest))


def pick_layers(share: torch.Tensor, n: int = 3) -> list[int]:
    """The n layers (ascending) with the highest mean share of global queries over heads, share [L, H]."""
    order = share.mean(-1).argsort(descending=True, stable=True)
    return sorted(order[: min(n, share.shape[0])].tolist())


def distance_edges(max_distance: int) -> torch.Tensor:
    """Log2 bin edges [0, 1, 2, 4, …, 2^k] with 2^k > max_distance: bin i is [edges[i], edges[i+1])."""
    edges, top = [0, 1], 1
    while top <= max_distance:
        top *= 2
        edges.append(top)
    return torch.tensor(edges)


def distance_histogram(
    attn: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    edges: torch.Tensor,
    rule: RevisitRule,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., bins]: each query's counted attention mass (sinks and excluded keys aside) by
    distance bin, normalised to sum 1 (all zero when nothing is counted). Bin i holds
    distances in [edges[i], edges[i+1])."""
    _, counted, _ = _masks(query_pos, key_pos, rule, excluded)
    dist = (query_pos[..., None] - key_pos).clamp(min=0)
    n_bins = edges.numel() - 1
    bins = (torch.bucketize(dist, edges.to(dist.device), right=True) - 1).clamp(0, n_bins - 1)
    mass = torch.where(counted, attn, attn.new_zeros(()))
    out = attn.new_zeros(*mass.shape[:-1], n_bins)
    out.scatter_add_(-1, bins.expand_as(mass), mass)
    total = out.sum(-1, keepdim=True)
    return torch.where(total > 0, out / total.clamp(min=torch.finfo(attn.dtype).tiny), out)


def mean_distance(
    attn: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    rule: RevisitRule,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """[...]: attention-weighted mean of query_pos − key_pos over counted keys (0 when none)."""
    _, counted, _ = _masks(query_pos, key_pos, rule, excluded)
    mass = torch.where(counted, attn, attn.new_zeros(()))
    dist = (query_pos[..., None] - key_pos).clamp(min=0).to(attn.dtype)
    total = mass.sum(-1)
    return torch.where(total > 0, (mass * dist).sum(-1) / total.clamp(min=1e-30), total)


def normalised_entropy(probs: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """[...]: H(p) / log(n) of rows probs [..., T] over their n visible keys (0 when n ≤ 1),
    the signal of reasonkv.harness.profile."""
    ent = -(probs * probs.clamp(min=1e-30).log()).sum(-1)
    n = visible.sum(-1).to(probs.dtype)
    return torch.where(n > 1, ent / n.clamp(min=2).log(), torch.zeros_like(ent))


# --------------------------------------------------------------- missed revisits
def update_eviction_times(evicted_at: torch.Tensor, kept: torch.Tensor, seen: int) -> torch.Tensor:
    """One step of eviction bookkeeping: evicted_at [..., n] (NEVER_EVICTED = still held),
    kept [..., n] bool = the tokens the cache holds once it has seen `seen` tokens (after this
    step's compression). A token below `seen` that is not kept and had no eviction time gets
    `seen`: the first query position that can no longer attend to it."""
    n = evicted_at.shape[-1]
    seen_mask = torch.arange(n, device=evicted_at.device) < seen
    gone = seen_mask & ~kept & (evicted_at == NEVER_EVICTED)
    return torch.where(gone, torch.full_like(evicted_at, seen), evicted_at)


def eviction_times(steps: list[tuple[int, torch.Tensor]], n_tokens: int) -> torch.Tensor:
    """evicted_at [..., n_tokens] from per-step kept sets: `steps` = [(seen, kept [..., n_tokens] bool)]
    in order, the cache's content after each step."""
    if not steps:
        raise ValueError("no steps")
    out = torch.full(steps[0][1].shape[:-1] + (n_tokens,), NEVER_EVICTED, dtype=torch.long)
    for seen, kept in steps:
        out = update_eviction_times(out, kept, seen)
    return out


def missed_revisits(needed: torch.Tensor, query_pos: torch.Tensor, evicted_at: torch.Tensor) -> torch.Tensor:
    """[..., Q] number of each query's needed keys already evicted when it came.

    needed [..., Q, K] key positions (-1 = none); query_pos [Q] (or [..., Q]); evicted_at
    [..., n] from `update_eviction_times`. Key j is missed by the query at p when
    evicted_at[j] ≤ p."""
    flat = needed.clamp(min=0).flatten(-2)
    when = evicted_at.gather(-1, flat).view_as(needed)
    return ((needed >= 0) & (when <= query_pos[..., None])).sum(-1)


# --------------------------------------------------------------- PCA and beacons
def pca_2d(points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(coords [N, 2], mean [D], basis [D, 2], explained [2] variance ratios) of points [N, D]."""
    x = points.double()
    mean = x.mean(0)
    centred = x - mean
    _, s, vh = torch.linalg.svd(centred, full_matrices=False)
    basis = vh[:2].T
    var = s**2
    explained = var[:2] / var.sum().clamp(min=1e-30)
    return (centred @ basis).float(), mean.float(), basis.float(), explained.float()


def unit(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit norm (the cosine geometry BeaconKV's FPS works in)."""
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def simulate_beacons(
    pre_queries: torch.Tensor, beacon_max: int = 32, beacon_min: int = 16, recent: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """The beacons BeaconKV's continual FPS holds for one KV head after pre_queries [N, G, D]
    (pre-RoPE, oldest first, the group's G query heads): every query but the newest `recent`
    has left the recent window and entered the buffer, G points per query in (query, head)
    order. Returns (beacons [M, D], source [M] index of the point each came from, in the
    flattened N·G order), in buffer order."""
    n, g, d = pre_queries.shape
    points = pre_queries[: max(0, n - recent)].reshape(-1, d).float()
    beacons = torch.zeros(1, 1, beacon_max, d)
    count = torch.zeros(1, 1, dtype=torch.long)
    if points.shape[0]:
        valid = torch.ones(1, 1, points.shape[0], dtype=torch.bool)
        beacons, count = add_points(beacons, count, points[None, None], valid, beacon_min)
    held = beacons[0, 0, : int(count[0, 0])]
    # Beacons are copies of points: find where each came from (the nearest point, exactly 0).
    source = torch.cdist(held, points).argmin(-1) if held.shape[0] else torch.zeros(0, dtype=torch.long)
    return held, source


# ---------------------------------------------------------------------- recording
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


@dataclass
class _Recorder:
    """Scorer-shaped observer (the NEVER schedule: it never evicts). For every forward of every
    layer it computes the recorded queries' attention over the full cache. Survey mode (the
    first pass) only keeps each query's strongest far keys, for the persistent keys; the second
    pass keeps the per-query statistics with those keys excluded."""

    window: ClassVar[int] = 1
    rule: RevisitRule
    prompt_len: int
    n_tokens: int
    stride: int
    edges: torch.Tensor
    survey: bool = False
    excluded: torch.Tensor | None = None  # [L, H, n + 1] bool (the last column: EMPTY slots)
    layers: frozenset[int] = frozenset()  # maps and pre-RoPE queries are kept for these
    map_start: int = 0
    needed_mass: float = 0.5
    survey_keys: int = 32
    tops: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    top_weights: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    totals: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    stats: dict[int, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    maps: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    pre: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    positions: list[torch.Tensor] = field(default_factory=list)

    def score(self, obs, keys, values):  # pragma: no cover - NEVER schedule: no compression
        raise RuntimeError("the analyzer never evicts")

    def on_step(self, step: Observation, keys: torch.Tensor, layer) -> None:
        li = layer.layer_idx
        idx = step.query_index[0]  # [s] this forward's queries
        if not self.survey and li in self.layers:  # every query: BeaconKV's buffer sees them all
            pos = step.query_positions[0] if step.query_positions is not None else idx
            pre = unapply_rope(step.queries[0], pos[None, :], step.rope_inv_freq, step.rope_attention_scaling)
            self.pre.setdefault(li, []).append(pre.transpose(0, 1).cpu())
        sel = (idx >= self.prompt_len) & ((idx - self.prompt_len) % self.stride == 0)
        if self.survey:
            sel = sel & eligible(idx, self.rule)
        in_map = (idx >= self.map_start) if (li in self.layers and not self.survey) else torch.zeros_like(sel)
        rows = (sel | in_map).nonzero().flatten()
        if rows.numel() == 0:
            return
        qi = idx[rows]  # [r]
        kp = step.token_index[0]  # [H, T]
        logits = grouped_logits(step.queries[:, :, rows], keys, step.scaling)  # [1, H, G, r, T]
        visible = (kp[:, None, :] <= qi[None, :, None]) & (kp[:, None, :] != EMPTY)  # [H, r, T]
        probs = masked_softmax(logits, visible[None, :, None])[0]  # [H, G, r, T]
        attn = probs.mean(1)  # [H, r, T] the group's mean attention
        kpq = kp[:, None, :]
        s = sel[rows]
        if self.survey:
            a, q = attn[:, s], qi[s]
            top, weight = far_keys(a, q, kpq, self.rule, k=self.survey_keys)  # sinks aside
            pad = self.survey_keys - top.shape[-1]
            self.tops.setdefault(li, []).append(torch.nn.functional.pad(top, (0, pad), value=-1).cpu())
            self.top_weights.setdefault(li, []).append(torch.nn.functional.pad(weight, (0, pad)).cpu())
            counted = _masks(q, kpq, self.rule, None)[1]
            self.totals.setdefault(li, []).append(torch.where(counted, a, 0.0).sum(-1).cpu())
            return
        excl = None
        if self.excluded is not None:
            table = self.excluded[li].to(kp.device)  # [H, n + 1]
            excl = table.gather(1, kp.clamp(max=self.n_tokens))[:, None, :]  # [H, 1, T]
        if li == 0 and bool(sel.any()):
            self.positions.append(idx[sel].cpu())
        if bool(s.any()):
            a, q = attn[:, s], qi[s]
            need, weight = needed_keys(a, q, kpq, self.rule, self.needed_mass, excl)
            pad = self.rule.top_k - need.shape[-1]  # early blocks can have fewer keys than top_k
            rec = self.stats.setdefault(li, {})
            for name, value in (
                ("far", far_fraction(a, q, kpq, self.rule, excl)),
                ("mean_dist", mean_distance(a, q, kpq, self.rule, excl)),
                ("hist", distance_histogram(a, q, kpq, self.edges, self.rule, excl)),
                ("entropy", normalised_entropy(probs[:, :, s], visible[:, None, s]).mean(1)),
                ("needed", torch.nn.functional.pad(need, (0, pad), value=-1)),
                ("weight", torch.nn.functional.pad(weight, (0, pad))),
            ):
                rec.setdefault(name, []).append(value.cpu())
        m = in_map[rows]
        if bool(m.any()):
            # Rows over all n tokens (keys not yet seen are 0); in a full cache slots are positions.
            full = attn.new_zeros(attn.shape[0], int(m.sum()), self.n_tokens)
            order = kp.clamp(max=self.n_tokens - 1)[:, None, :].expand(-1, full.shape[1], -1)
            full.scatter_add_(2, order, torch.where(kp[:, None, :] != EMPTY, attn[:, m], 0.0))
            self.maps.setdefault(li, []).append(full.cpu())


def _rope_of(model) -> tuple[torch.Tensor | None, float]:
    """The model's RoPE inverse frequencies and attention scaling (as make_cache finds them)."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    return getattr(rotary, "inv_freq", None), float(getattr(rotary, "attention_scaling", 1.0))


def _observer_cache(model, recorder: _Recorder):
    from reasonkv.core.cache import CompressedCache, LayerPolicy
    from reasonkv.core.models import attention_modules, model_shape
    from reasonkv.core.policy.schedules import NEVER
    from reasonkv.methods.api import install_attention

    shape = model_shape(model)
    install_attention(model)
    inv_freq, att_scaling = _rope_of(model)
    modules = attention_modules(model)
    policy = LayerPolicy(
        scorer=recorder,
        schedule=NEVER,
        n_sink=0,
        n_recent=0,
        rope_inv_freq=inv_freq,
        rope_attention_scaling=att_scaling,
    )
    budgets = torch.ones(shape.n_layers, shape.n_kv_heads, dtype=torch.long)
    return CompressedCache(
        budgets, policy, method="analyze", attention_modules=modules, scaling=float(modules[0].scaling)
    )


@dataclass
class _Lane:
    result: MethodResult
    cache: object
    events_seen: int = 0


def _track_evictions(lane: _Lane) -> None:
    """After a forward: give every token the cache no longer holds its eviction time."""
    cache = lane.cache
    if len(cache.events) == lane.events_seen:
        return  # nothing compressed since the last look
    lane.events_seen = len(cache.events)
    evicted = lane.result.evicted_at
    n = evicted.shape[-1]
    for li, layer in enumerate(cache.layers):
        index = layer.token_index[0, :, : layer.used].cpu()  # [H, used]
        kept = torch.zeros(index.shape[0], n + 1, dtype=torch.bool)
        kept.scatter_(1, index.clamp(max=n), True)  # EMPTY -> the scratch column n
        evicted[li] = update_eviction_times(evicted[li], kept[:, :n], layer.seen)


def _survey(model, ids: torch.Tensor, prompt_len: int, recorder: _Recorder, block: int, progress) -> None:
    cache = _observer_cache(model, recorder)
    model(input_ids=ids[:, :prompt_len], cache=cache, logits_to_keep=1)
    for a in range(prompt_len, ids.shape[1], block):
        model(input_ids=ids[:, a : a + block], cache=cache, logits_to_keep=1)
        if progress is not None:
            progress("survey", min(block, ids.shape[1] - a))


def analyze_trace(
    model,
    input_ids: torch.Tensor,
    prompt_len: int,
    rule: RevisitRule,
    *,
    trace_id: str = "trace",
    stride: int = 1,
    window: int = 256,
    layers: list[int] | tuple[int, ...] | None = None,
    n_auto: int = 3,
    needed_mass: float = 0.5,
    runs: list | tuple = (),
    block: int = 256,
    stepwise: bool = False,
    progress: Callable[[str, int], None] | None = None,
) -> TraceAnalysis:
    """Replay one trace (input_ids [1, n]; the first `prompt_len` tokens are the prompt) with
    the full cache, recording every `stride`-th trace query: a survey pass finds the heads'
    persistent keys (skipped when rule.persistent is None), the main pass records the
    statistics and, in lock-step, replays every `runs` entry (eval.replay.ReplayRun: method,
    budget, knobs), recording when it evicted each token and its fidelity to the full cache
    (mean KL and top-1 agreement, as `reasonkv replay` measures them).

    layers: the layers whose attention rows of the last `window` queries (maps) and pre-RoPE
    queries (PCA, beacons) are kept; None = the `n_auto` layers with the most global queries
    (as the survey estimates them: `approx_far_fraction`). Method caches advance
    in chunks that end at their compression points (`stepwise=True`: one token per forward).
    progress(stage, k) is called after each block of k positions ("survey", then "replay").
    """
    from reasonkv.core.models import model_shape
    from reasonkv.harness.replay import chunk_plan, compare_to_reference, reference_stats
    from reasonkv.methods.api import make_cache
    from reasonkv.methods.registry import get_method

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"analyze takes one trace: input_ids [1, n], got {tuple(input_ids.shape)}")
    n = int(input_ids.shape[1])
    if not 1 <= prompt_len < n - 1:
        raise ValueError(f"need 1 <= prompt_len < n - 1 (a trace of 2+ tokens); got {prompt_len}, n={n}")
    if stride < 1 or block < 1 or window < 1:
        raise ValueError("stride, block and window must be positive")
    shape = model_shape(model)
    bad = [i for i in (layers or ()) if not 0 <= i < shape.n_layers]
    if bad:
        raise ValueError(f"layer(s) {bad} out of range: the model has {shape.n_layers} layers (0-based)")
    window = min(window, n - prompt_len)
    edges = distance_edges(n)
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    start = time.perf_counter()
    common = {"rule": rule, "prompt_len": prompt_len, "n_tokens": n, "stride": stride, "edges": edges}

    persistent = torch.zeros(shape.n_layers, shape.n_kv_heads, n, dtype=torch.bool)
    with torch.no_grad():
        if rule.persistent is not None or layers is None:
            survey = _Recorder(**common, survey=True)
            _survey(model, ids, prompt_len, survey, block, progress)
            trace_pos = torch.arange(prompt_len, n, stride)
            support = far_support(trace_pos[eligible(trace_pos, rule)], n, rule)
            share = torch.zeros(shape.n_layers, shape.n_kv_heads)
            for li, tops in survey.tops.items():
                top = torch.cat(tops, dim=1)
                persistent[li] = persistent_keys(top, support, rule)
                f = approx_far_fraction(
                    top,
                    torch.cat(survey.top_weights[li], 1),
                    torch.cat(survey.totals[li], 1),
                    persistent[li],
                    rule,
                )
                share[li] = (f >= rule.fraction).float().mean(-1)
            if layers is None:
                layers = pick_layers(share, n_auto)
    recorder = _Recorder(
        **common,
        excluded=torch.cat([persistent, torch.ones(*persistent.shape[:2], 1, dtype=torch.bool)], -1),
        layers=frozenset(layers),
        map_start=n - window,
        needed_mass=needed_mass,
    )
    observer = _observer_cache(model, recorder)
    lanes = []
    for run in runs:
        budget = run.budget if get_method(run.method).compresses else None
        evicted = torch.full((shape.n_layers, shape.n_kv_heads, n), NEVER_EVICTED, dtype=torch.long)
        result = MethodResult(run.label, run.method, run.budget, dict(run.knobs), evicted)
        lanes.append(_Lane(result, make_cache(model, run.method, budget, **run.knobs)))
    end = n - 1  # the last token predicts nothing: it is fed to the observer alone at the end
    with torch.no_grad():
        model(input_ids=ids[:, :prompt_len], cache=observer, logits_to_keep=1)
        for lane in lanes:
            t0 = time.perf_counter()
            model(input_ids=ids[:, :prompt_len], cache=lane.cache, logits_to_keep=1)
            _track_evictions(lane)
            lane.result.seconds += time.perf_counter() - t0
        for a in range(prompt_len, end, block):
            b = min(a + block, end)
            targets = ids[0, a + 1 : b + 1]
            out = model(input_ids=ids[:, a:b], cache=observer, logits_to_keep=0 if lanes else 1)
            ref = reference_stats(out.logits[0], targets) if lanes else None
            del out
            for lane in lanes:
                t0 = time.perf_counter()
                _advance(model, lane, ids, a, b, ref, targets, stepwise, chunk_plan, compare_to_reference)
                lane.result.seconds += time.perf_counter() - t0
            del ref  # [block, vocab] twice: freed before the next block
            if progress is not None:
                progress("replay", b - a)
        model(input_ids=ids[:, end:], cache=observer, logits_to_keep=1)
        if progress is not None:
            progress("replay", 1)
    for lane in lanes:
        lane.result.compressions = len(lane.cache.events)
    return _assemble(
        recorder, persistent, input_ids[0].cpu(), trace_id, shape, lanes, time.perf_counter() - start
    )


def _advance(model, lane: _Lane, ids, a, b, ref, targets, stepwise, chunk_plan, compare) -> None:
    """Feed [a, b) to the lane's cache in chunks that end at its compression points."""
    pos = a
    while pos < b:
        plan = 1 if stepwise else chunk_plan(lane.cache)
        k = b - pos if plan is None else min(plan, b - pos)
        layers = [layer for layer in lane.cache.layers if layer.is_initialized]
        live = sum(float(layer.n_valid.double().mean()) for layer in layers) / max(1, len(layers))
        # The i-th token of the chunk sees the cache before it plus i tokens (compression comes after).
        lane.result.live_weighted += k * live + k * (k + 1) / 2
        logits = model(input_ids=ids[:, pos : pos + k], cache=lane.cache).logits[0]
        cmp = compare(
            {name: t[pos - a : pos - a + k] for name, t in ref.items()},
            logits,
            targets[pos - a : pos - a + k],
        )
        lane.result.kl_sum += float(cmp["kl"].sum())
        lane.result.top1_sum += float(cmp["top1"].sum())
        lane.result.positions += k
        lane.result.forwards += 1
        _track_evictions(lane)
        pos += k


def _assemble(recorder: _Recorder, persistent, ids, trace_id: str, shape, lanes, seconds) -> TraceAnalysis:
    layers = sorted(recorder.stats)

    def stack(name: str) -> torch.Tensor:
        # per layer: blocks of [H, r, ...] -> [H, N, ...]; then [L, H, N, ...]
        return torch.stack([torch.cat(recorder.stats[li][name], dim=1) for li in layers])

    positions = torch.cat(recorder.positions)
    far = stack("far")
    rule = recorder.rule
    elig = eligible(positions, rule)
    return TraceAnalysis(
        trace_id=trace_id,
        input_ids=ids,
        prompt_len=recorder.prompt_len,
        rule=rule,
        stride=recorder.stride,
        positions=positions,
        persistent=persistent,
        far_frac=far,
        is_global=elig[None, None, :] & (far >= rule.fraction),  # `classify`, from the stored fractions
        eligible=elig,
        mean_dist=stack("mean_dist"),
        dist_hist=stack("hist"),
        edges=recorder.edges,
        entropy=stack("entropy"),
        needed=stack("needed"),
        needed_weight=stack("weight"),
        needed_mass=recorder.needed_mass,
        maps={li: torch.cat(parts, dim=1) for li, parts in recorder.maps.items()},
        map_positions=torch.arange(recorder.map_start, recorder.n_tokens),
        pre_queries={li: torch.cat(parts, dim=0) for li, parts in recorder.pre.items()},
        group_size=shape.group_size,
        layers=sorted(recorder.layers),
        methods=[lane.result for lane in lanes],
        seconds=seconds,
    )
