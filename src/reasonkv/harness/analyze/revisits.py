"""The revisit rule and its arithmetic on attention rows: pure torch, tensors in and out.

Positions are sequence indices, d = query_pos − key_pos; a is a query's attention over the
keys it may see (one KV head: the mean over its query heads).
- Excluded keys: the first `n_sink` tokens (attention sinks) and the head's persistent keys,
  those among the `top_k` strongest far keys of at least a share σ (`persistent`) of the
  recorded queries that see them at distance ≥ D (and at least `min_support` such queries:
  see `persistent_keys`). They are secondary sinks (small models park much of their attention
  on a few early tokens, for every query); any method keeps them, since recent queries attend
  them too, so no revisit is needed to keep them.
- Far keys: not excluded, d ≥ D. Far mass F: the sum of the `top_k` largest a over far keys
  (the whole far mass of a diffuse head is large only because late in a trace most keys are far).
- f = F / (mass on keys not excluded), 0 when that is 0.
- A query is eligible when query_pos − D ≥ n_sink; it is GLOBAL ("thought revisiting") when
  eligible and f ≥ φ (`fraction`), LOCAL otherwise. A head's global share counts eligible
  queries only.
Needed keys of a query: its top far keys in decreasing attention (ties: the older key), the
shortest prefix that reaches `mass` × F. A needed key j of the query at position p is MISSED
by a method when the method had evicted j before p (evicted_at[j] ≤ p: the first position
whose query could no longer see it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonkv.core.policy.base import EMPTY

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


def key_masks(
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


def _counted_attention(
    attn: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    rule: RevisitRule,
    excluded: torch.Tensor | None,
) -> torch.Tensor:
    """attn [..., T] with zeros on the keys that are not counted (unseen, sinks, excluded)."""
    _, counted, _ = key_masks(query_pos, key_pos, rule, excluded)
    return torch.where(counted, attn, attn.new_zeros(()))


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
    _, _, far = key_masks(query_pos, key_pos, rule, excluded)
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
    zero = attn.new_zeros(())
    total = _counted_attention(attn, query_pos, key_pos, rule, excluded).sum(-1)
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
    dist = (query_pos[..., None] - key_pos).clamp(min=0)
    n_bins = edges.numel() - 1
    bins = (torch.bucketize(dist, edges.to(dist.device), right=True) - 1).clamp(0, n_bins - 1)
    mass = _counted_attention(attn, query_pos, key_pos, rule, excluded)
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
    mass = _counted_attention(attn, query_pos, key_pos, rule, excluded)
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
