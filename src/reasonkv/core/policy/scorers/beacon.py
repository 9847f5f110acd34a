"""BeaconKV (Kim et al., ICML 2026, arXiv 2609.04971): score keys with beacon queries.

Long chains of thought revisit old context at sparse, unpredictable steps, and the queries
that do so cluster in pre-RoPE space. So besides the `recent` newest queries, every attention
(query) head keeps a small buffer of its own diverse old queries ("beacons"), maintained by
continual farthest-point sampling (FPS) with cosine distance: a query enters its head's
buffer when it leaves the recent window; when the buffer reaches `beacon_max` it shrinks to
`beacon_min` by greedy FPS seeded with the newest point. At scoring time beacons are rotated
to the current position (as if issued now), recent queries keep their own positions, each
query head scores the keys of its KV head with its beacons and recent queries, and a KV
head's score is the max over its group:

    s_j = max over query heads g of the group, over q in beacons_g ∪ recent_g, of softmax_j(q·k_j/√d)

(softmax over the head's real keys, causal for recent queries; `aggregation="mean"`
averages over all those points instead). Sinks and recent tokens are protected by the
cache; the schedule is the max/min threshold (at B_max evict B_max/8).

Defaults, each the paper's stated choice (docs/results.md, "The BeaconKV paper's ablations", has
the sentence each follows and what the report traces say of it): `beacon_max=32`,
`beacon_min=16`, `recent=16` ("beacon budget at most 32, at least 16; 16 recent queries");
`aggregation="max"`; beacons rotated to the current step, recent queries at their own positions;
the method's threshold schedule evicts B_max/8 at B_max; "prefix tokens and the most recent few
tokens are always kept" read as 4 sinks + 16 recent tokens (`protect_prompt=False`);
`beacon_scope="query_head"` ("every attention head keeps a bounded buffer"). Ours, where the
paper says only "historical pre-RoPE queries": `beacon_feed="generated"` (chosen on the tuning
traces: never worse there than feeding the prompt's queries too); `upkeep_every=8` (batches the
feed; the buffers hold the same points).

`beacon_scope="kv_head"` keeps one buffer per KV head fed by its G query heads (each head's
vector is a point), for the ablation. `beacon_feed` says which queries may become beacons:
all, only generated ones, or all but the first `n_sink` positions (the position-0 query is an
outlier that FPS never drops). Where the paper is silent: points identical in direction
(cosine distance 0) to a held beacon are not added again; FPS ties go to the older point; no
token pooling by default.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from reasonkv.core.policy.base import (
    MAX_KERNEL,
    Observation,
    candidate_mask,
    grouped_logits,
    masked_softmax,
    pool_tokens,
)
from reasonkv.core.policy.contract import LayerView, PolicyState, QueryWindowView, Scorer
from reasonkv.core.policy.knob import knob, tokens
from reasonkv.core.policy.rope import apply_rope, unapply_rope
from reasonkv.core.policy.vector_codes import decode_vectors, encode_vectors

DUPLICATE_EPS = 1e-5
"""Cosine distance at or below which a point counts as identical (fp32 rounding of 0)."""


FPS_ROWS_ON_DEMAND_ABOVE = 256
"""Above this many points, farthest-point sampling computes only the m distance rows it visits,
not the N x N matrix: the all-queries ablation's N grows with the sequence (a 2K-token trace's
matrix is 4.5 GB on the default model). BeaconKV's own buffers stay far below it, so its FPS
runs exactly as before (one matrix product; the two differ in the last bits of a distance)."""


def _units(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def farthest_point_sample(
    points: torch.Tensor, m: int, seed: torch.Tensor | int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Greedy FPS with cosine distance: points [..., N, D] -> [..., m] chosen indices, ascending.

    Starts from `seed` (an index, or [...] indices), then repeatedly adds the point whose
    distance to its nearest chosen point is largest (ties: the lowest index). With `valid`
    [..., N] only those points are candidates; a row with fewer than m ends in index N.
    """
    n = points.shape[-2]
    u = _units(points.float())
    seed = torch.as_tensor(seed, device=points.device).expand(points.shape[:-2])[..., None]  # [..., 1]
    # A point's distance to itself is set below any real one (cosine distances are >= 0 up to
    # rounding), so once chosen its nearest-chosen distance is -1: argmax never picks it
    # again and no separate "chosen" mask has to be kept in the loop. An invalid point looks
    # chosen from the start, and is never counted.
    if n > FPS_ROWS_ON_DEMAND_ABOVE:

        def row(i: torch.Tensor) -> torch.Tensor:  # the distances of point i, computed now
            ui = u.gather(-2, i[..., None].expand(*i.shape[:-1], 1, u.shape[-1]))  # [..., 1, D]
            r = (1.0 - ui @ u.transpose(-1, -2)).squeeze(-2).scatter(-1, i, -1.0)
            return r if valid is None else r.masked_fill(~valid, -1.0)

    else:
        dist = 1.0 - u @ u.transpose(-1, -2)  # [..., N, N]
        dist.diagonal(dim1=-2, dim2=-1).fill_(-1.0)
        if valid is not None:
            dist = dist.masked_fill(~valid[..., None, :], -1.0)

        def row(i: torch.Tensor) -> torch.Tensor:  # dist[..., i, :]
            return dist.gather(-2, i[..., None].expand(*i.shape[:-1], 1, n)).squeeze(-2)

    nearest = row(seed)
    for _ in range(min(m, n) - 1):
        nearest = torch.minimum(nearest, row(nearest.argmax(-1, keepdim=True)))
    chosen = nearest < -0.5
    if valid is not None:
        chosen = chosen & valid
    slots = torch.arange(n, device=points.device).expand_as(chosen)
    return torch.where(chosen, slots, n).sort(dim=-1).values[..., : min(m, n)]


def add_points(
    beacons: torch.Tensor, count: torch.Tensor, points: torch.Tensor, valid: torch.Tensor, beacon_min: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Continual FPS: feed points [B, H, P, D] (oldest first; `valid` [B, H, P]) into the
    buffers beacons [B, H, M, D] holding `count` [B, H] points in arrival order.

    Equivalent to adding the points one at a time: a point identical in direction to a held
    (or earlier, same-call) point is skipped; when a buffer reaches M it shrinks to
    `beacon_min` by FPS seeded with its newest point. Points go in chunks small enough that
    no buffer can fill before a chunk's last point, so the chunked result is the sequential one.
    """
    b, h, m_max, d = beacons.shape
    start, total = 0, points.shape[2]
    slots = torch.arange(m_max, device=beacons.device)
    earlier = torch.ones(m_max, m_max, dtype=torch.bool, device=beacons.device).tril(-1)
    # One slot past the end takes the skipped points, so the scatter needs no condition.
    buf = torch.cat([beacons, beacons.new_zeros(b, h, 1, d)], dim=2)
    while start < total:
        k = min(total - start, m_max - int(count.max()))
        chunk, ok = points[:, :, start : start + k].float(), valid[:, :, start : start + k]
        u, held = _units(chunk), _units(buf[:, :, :m_max].float())
        in_use = (slots < count[..., None])[:, :, None, :]  # [B, H, 1, M]
        dup_held = ((u @ held.transpose(-1, -2) >= 1.0 - DUPLICATE_EPS) & in_use).any(-1)
        same = u @ u.transpose(-1, -2) >= 1.0 - DUPLICATE_EPS
        dup_prev = (same & earlier[:k, :k] & ok[:, :, None, :]).any(-1)
        add = ok & ~dup_held & ~dup_prev
        slot = torch.where(add, count[..., None] + add.cumsum(-1) - 1, m_max)
        buf.scatter_(2, slot[..., None].expand(-1, -1, -1, d), chunk.to(buf.dtype))
        count = count + add.sum(-1)
        full = count == m_max
        if bool(full.any()):
            keep = farthest_point_sample(buf[:, :, :m_max], beacon_min, m_max - 1)  # seeded with the newest
            kept = buf.gather(2, keep[..., None].expand(-1, -1, -1, d))
            shrunk = torch.cat([kept, buf.new_zeros(b, h, m_max + 1 - beacon_min, d)], dim=2)
            buf = torch.where(full[..., None, None], shrunk, buf)
            count = torch.where(full, beacon_min, count)
        start += k
    return buf[:, :, :m_max].clone(memory_format=torch.contiguous_format), count  # not a view of buf


def _weakly(group: list) -> list:
    """The cache's list of scorer states, referred to weakly where it allows it: a state in it
    that held it strongly would make a reference cycle and keep a dropped cache's storage alive
    until the next garbage collection."""
    try:
        return weakref.proxy(group)
    except TypeError:  # a plain list (tests build states by hand)
        return group


@dataclass
class BeaconState(PolicyState):
    """One layer's beacon buffers and the bookkeeping of its queue of leaving queries."""

    beacons: torch.Tensor  # [B, X, M, D] pre-RoPE, the model's dtype or int8 codes; X = query or KV heads
    count: torch.Tensor  # [B, X] points held, in arrival order
    window: QueryWindowView  # the layer's query window (the queue lives in its backlog)
    group: list  # every layer's scorer state: queues are fed for all layers in one pass
    n_sink: int = 0  # positions below this never feed the buffers under beacon_feed="no_sinks"
    pending: int = 0  # queued queries; below 0 when scoring fed the next leaving ones ahead
    forwards: int = 0
    step_size: int = 0  # queries in the layer's latest forward
    scale: torch.Tensor | None = None  # [B, X, M, 1]: beacon_bits=8, each beacon's scale
    ROW_FIELDS = ("beacons", "count", "scale")

    def join_rows(self, other: BeaconState) -> None:
        """Rows of settled states (no queued query: `BeaconKVScorer.settle`); the counts of
        forwards are this state's (the pool's)."""
        if self.pending or other.pending:
            raise ValueError("BeaconKV: rows with queued queries cannot join; settle both first")
        other.forwards, other.step_size = self.forwards, self.step_size
        super().join_rows(other)

    def rebind(self, old_window: QueryWindowView, window: QueryWindowView, layer_states: list) -> None:
        super().rebind(old_window, window, layer_states)
        self.group = _weakly(layer_states)

    def points(self) -> torch.Tensor:
        """The held beacons as vectors [B, X, M, D] (fp32 when stored as codes)."""
        return self.beacons if self.scale is None else decode_vectors(self.beacons, self.scale)

    def hold(self, points: torch.Tensor, count: torch.Tensor) -> None:
        """Keep `points` [B, X, M, D] as the buffers (as codes again, scales in the model's dtype,
        when they are codes)."""
        if self.scale is None:
            self.beacons = points
        else:
            self.beacons, self.scale = encode_vectors(points, self.scale.dtype)
        self.count = count


@dataclass
class BeaconKVScorer(Scorer):
    beacon_max: int = tokens(32, minimum=2)
    beacon_min: int = tokens(16)
    recent: int = tokens(16)
    aggregation: Literal["max", "mean"] = "max"
    pooling: Literal["max", "avg", "none"] = "none"
    kernel: int = knob(7, ge=1, le=MAX_KERNEL)
    step_reads_keys: ClassVar[bool] = False  # on_step only counts and feeds queries
    upkeep_every: int = tokens(8)
    """Queries leaving the recent window wait in a queue and enter the buffers this many at a
    time (all layers in one pass), or when scoring needs the buffers. Continual FPS fed in
    chunks equals FPS fed one point at a time (`add_points`), so the beacons do not depend on
    it. The queue is the cache's own query history (`query_backlog`), so a decode step only
    counts: no tensor op per layer. Why batch: a feed of all layers costs about as much for one
    query as for many. Why not more: the queue is held beside the K/V (`recent` + this many
    queries a head and layer). Measured: docs/performance.md (benchmarks/beacon_upkeep.py)."""
    beacon_scope: Literal["query_head", "kv_head"] = "query_head"
    beacon_feed: Literal["all", "generated", "no_sinks"] = "generated"
    beacon_bits: Literal[16, 8] = 16
    """How the beacon buffers are held: in the model's dtype (16), or as int8 codes with one
    scale a beacon (8: half the bytes at 16 bits; FPS compares directions, which a per-vector
    scale keeps, so only each element's rounding changes)."""
    window_bits: Literal[16, 8] = 16
    """How the cache holds the recent queries (and the backlog): 16 or 8 (codes, a scale each)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_sizes()

    def _check_sizes(self) -> None:
        """The buffer sizes fit continual FPS (a subclass with other upkeep checks its own)."""
        if not 1 <= self.beacon_min < self.beacon_max:
            raise ValueError(
                f"need 1 <= beacon_min < beacon_max, got {self.beacon_min} and {self.beacon_max}"
            )

    @property
    def window(self) -> int:
        """The cache keeps the `recent` newest queries (a property, so it is not a separate knob)."""
        return self.recent

    @property
    def query_backlog(self) -> int:
        """...and the `upkeep_every` before them: the queue of queries not yet fed."""
        return self.upkeep_every

    def keeps_old_prompt_queries(self) -> bool:
        """Beacons fed by prompt queries (`beacon_feed` other than "generated") outlive the window."""
        return self.beacon_feed != "generated"

    def state_vectors(self, n_query_heads: int, n_kv_heads: int) -> int:
        """The beacon buffers: `beacon_max` a query head (or a KV head, by `beacon_scope`)."""
        return self.beacon_max * (n_query_heads if self.beacon_scope == "query_head" else n_kv_heads)

    def new_state(self, view: LayerView) -> BeaconState:
        b, h, d, device = view.shape
        x = view.n_query_heads if self.beacon_scope == "query_head" else h
        # The model's dtype (the queries'): fp32 buffers would double a bf16 model's.
        beacons = torch.zeros(b, x, self.beacon_max, d, device=device, dtype=view.dtype)
        scale = None
        if self.beacon_bits == 8:
            beacons, scale = encode_vectors(beacons)
        return BeaconState(
            beacons=beacons,
            count=torch.zeros(b, x, dtype=torch.long, device=device),
            window=view.window,
            group=_weakly(view.scorer_states),
            n_sink=view.n_sink,
            scale=scale,
        )

    def settle(
        self, state: BeaconState, rope_inv_freq: torch.Tensor | None, attention_scaling: float
    ) -> None:
        """Feed the queued queries (every layer of the group, in one pass)."""
        if state is not None and state.pending > 0:
            self.flush(state, rope_inv_freq, attention_scaling)

    # ------------------------------------------------------------- buffer upkeep
    def on_step(self, step: Observation, keys: torch.Tensor | None) -> None:
        """Queue the queries that leave the recent window with this forward for the beacon buffers.

        When this runs, the layer's window holds the previous queries (the `recent` newest,
        and before them the `pending` queued ones: the cache keeps `query_backlog` =
        `upkeep_every` of those) and `step` holds this forward's. Of the two in order, all but
        the newest `recent` have left; those not fed yet are the queue, and this hook only
        counts them. When the queue would outgrow the backlog it is fed (in lock-step decoding
        every layer's queue is full then, and all layers are fed in one pass); more leaving
        queries than the backlog holds (a prompt) are fed at once. Fed queries are rotated back
        to pre-RoPE; padding queries never enter.
        """
        st: BeaconState = step.scorer_state
        b, _, q, _ = step.queries.shape
        if st.beacons.shape[0] != b:
            raise RuntimeError("BeaconKV: the batch changed size mid-generation; start a new cache")
        st.forwards, st.step_size = st.forwards + 1, q
        win = st.window
        held = win.size
        n_out = self._leaving(held, q)
        if n_out == 0:
            return
        if step.rope_inv_freq is None:
            raise ValueError("BeaconKV needs the model's RoPE inverse frequencies (rope_inv_freq)")
        if st.pending + n_out > self.upkeep_every:  # the backlog cannot hold them all
            self.flush(st, step.rope_inv_freq, step.rope_attention_scaling)
        if n_out <= self.upkeep_every:
            # They stay in the cache's backlog until fed (pending < 0: fed ahead by `flush`).
            st.pending += n_out
            return
        # More than the backlog keeps (a prompt): feed them now, from (previous, this step).
        first_recent = held - min(held, self.recent)  # the previous recent queries all leave

        def leaving(old: torch.Tensor | None, new: torch.Tensor, dim: int) -> torch.Tensor:
            if old is not None and first_recent < held:
                new = torch.cat([old.narrow(dim, first_recent, held - first_recent), new], dim)
            return new.narrow(dim, 0, n_out)

        queue = (
            leaving(win.queries, step.queries, 2),
            leaving(win.query_index, step.query_index, 1),
            leaving(win.query_positions, step.query_positions, 1),
        )
        self._feed([st], [queue], step.rope_inv_freq, step.rope_attention_scaling)

    def _leaving(self, held: int, q: int) -> int:
        """How many queries leave the recent window when q arrive after `held` kept ones."""
        return max(held + q - self.recent, 0) - max(held - self.recent, 0)

    def flush(
        self,
        state: BeaconState,
        inv_freq: torch.Tensor | None,
        attention_scaling: float = 1.0,
        ahead: bool = False,
    ) -> None:
        """Feed the queued queries of every layer in `state.group` into their beacon buffers, in
        one FPS pass (buffers stacked along the batch axis: 30 times fewer small ops on the
        default model). Scoring calls it, and so may anyone who reads the buffers.

        With `ahead` (scoring), a layer that has not run this forward yet is also fed the
        queries this forward will push out of its recent window (its oldest recent ones), so
        its own scoring finds nothing left to feed; arrival order, hence the buffers, is unchanged.
        """
        forward, q = state.forwards, state.step_size
        fed, queues = [], []
        for st in state.group:
            if not isinstance(st, BeaconState) or st.window.size == 0:  # no forward kept yet
                continue
            win, held = st.window, st.window.size
            first_recent = held - min(held, self.recent)
            n_ahead = 0
            if ahead and st.forwards < forward:
                n_ahead = self._leaving(held, q)
                if n_ahead > min(held - first_recent, self.upkeep_every):
                    n_ahead = 0  # some are still to come (a long chunk): they are fed then
            start, end = first_recent - st.pending, first_recent + n_ahead
            if start >= end:  # nothing queued (or already fed ahead)
                continue
            st.pending = -n_ahead
            fed.append(st)
            queues.append(win.span(start, end))  # decodes only the queued queries of 8-bit windows
        if fed:
            self._feed(fed, queues, inv_freq, attention_scaling)

    def _feed(
        self,
        members: list[BeaconState],
        queues: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        inv_freq: torch.Tensor | None,
        attention_scaling: float,
    ) -> None:
        """Feed each layer's queue of leaving queries [B, Hq, n, D], with their indices and
        positions [B, n], into its buffers, all in one pass."""
        if inv_freq is None:
            raise ValueError("BeaconKV needs the model's RoPE inverse frequencies (rope_inv_freq)")
        n = max(q[1].shape[1] for q in queues)
        if all(q[1].shape[1] == n for q in queues):
            leaving, index, positions = (torch.cat(parts) for parts in zip(*queues, strict=True))
        else:  # shorter queues end in invalid (index -1) points, which add_points skips
            leaving = torch.cat([F.pad(q[0], (0, 0, 0, n - q[0].shape[2])) for q in queues])
            index = torch.cat([F.pad(q[1], (0, n - q[1].shape[1]), value=-1) for q in queues])
            positions = torch.cat([F.pad(q[2], (0, n - q[2].shape[1])) for q in queues])
        b, hq, _, d = leaving.shape
        pre = unapply_rope(leaving, positions[:, None], inv_freq, attention_scaling)
        fed = index >= 0  # [B', n] padding never enters
        if self.beacon_feed == "generated":
            prompt_end = torch.cat([m.window.prompt_end for m in members])
            fed = fed & (index >= prompt_end[:, None])
        elif self.beacon_feed == "no_sinks":
            fed = fed & (positions >= members[0].n_sink)
        if self.beacon_scope == "query_head":  # each query head feeds its own buffer
            points, valid = pre, fed[:, None, :].expand(b, hq, n)
        else:  # one buffer per KV head: the group's G heads are G points per query
            h = members[0].beacons.shape[1]
            g = hq // h
            points = pre.reshape(b, h, g, n, d).transpose(2, 3).reshape(b, h, n * g, d)
            valid = fed[:, None, :, None].expand(b, h, n, g).reshape(b, h, -1)
        if self.beacon_bits == 8:  # rounded as they will be held before FPS sees them, so the
            # beacons do not depend on how many arrive at once (upkeep_every)
            points = decode_vectors(*encode_vectors(points, members[0].scale.dtype))
        if len(members) == 1:
            beacons, count = members[0].points(), members[0].count
        else:  # buffers that grow (an ablation's) may differ in length: pad to the longest
            held = [m.points() for m in members]
            longest = max(p.shape[2] for p in held)
            if any(p.shape[2] != longest for p in held):  # BeaconKV's never: no extra copy
                held = [F.pad(p, (0, 0, 0, longest - p.shape[2])) for p in held]
            beacons = torch.cat(held)
            count = torch.cat([m.count for m in members])
        beacons, count = self._admit(beacons, count, points, valid)
        rows = members[0].count.shape[0]
        if len(members) == 1:
            members[0].hold(beacons, count)
            return
        # Copies, not views of the stacked tensors: each layer then holds its own buffers (and
        # only them), and the stack is freed.
        for m, buf, cnt in zip(members, beacons.split(rows), count.split(rows), strict=True):
            m.hold(buf.clone() if m.scale is None else buf, cnt.clone())  # codes are new tensors

    def _admit(
        self, beacons: torch.Tensor, count: torch.Tensor, points: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """How fed points [B', X, P, D] (`valid` [B', X, P]) enter the buffers: continual FPS."""
        return add_points(beacons, count, points, valid, self.beacon_min)

    # ------------------------------------------------------------------ scoring
    def _scoring_points(self, st: BeaconState) -> tuple[torch.Tensor, torch.Tensor]:
        """The points that score [B, X, M, D] and how many each buffer has: the held beacons
        (an ablation that holds every past query picks its set from them here)."""
        return st.points(), st.count

    def score(self, obs: Observation, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        st: BeaconState | None = obs.scorer_state
        if st is not None:
            self.flush(st, obs.rope_inv_freq, obs.rope_attention_scaling, ahead=True)
        logits = grouped_logits(obs.queries, keys, obs.scaling)
        probs = masked_softmax(logits, candidate_mask(obs))  # recent queries: [B, H, G, W, T]
        b, h, g, w, t = probs.shape
        parts = [probs.reshape(b, h, g * w, t)]
        n_points = (obs.query_valid.sum(-1) * g)[:, None].expand(b, h)
        if st is not None and bool(st.count.any()):
            beacons, count = self._scoring_points(st)  # [B, X, M, D], X = H or H*G
            positions = obs.query_positions if obs.query_positions is not None else obs.query_index
            now = torch.where(obs.query_valid, positions, -1).amax(-1).clamp(min=0)  # newest query's position
            rotated = apply_rope(
                beacons.float(), now[:, None, None], obs.rope_inv_freq, obs.rope_attention_scaling
            )
            held = torch.arange(beacons.shape[2], device=keys.device) < count[..., None]  # [B, X, M]
            # A query head's beacons score the keys of its KV head: group them as G·M points.
            rotated, held = rotated.reshape(b, h, -1, rotated.shape[-1]), held.reshape(b, h, -1)
            logits = torch.einsum("bhmd,bhtd->bhmt", rotated, keys.float()) * obs.scaling
            parts.append(masked_softmax(logits, held[..., None] & obs.key_valid[:, :, None, :]))
            n_points = n_points + count.reshape(b, h, -1).sum(-1)
        probs = torch.cat(parts, dim=2)  # every observation point: [B, H, P, T], zeros for absent ones
        if self.aggregation == "max":
            scores = probs.amax(dim=2) if probs.shape[2] else probs.new_zeros(b, h, t)
        else:
            scores = probs.sum(dim=2) / n_points.clamp(min=1)[..., None].to(probs.dtype)
        return pool_tokens(scores, self.kernel, self.pooling)
