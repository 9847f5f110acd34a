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

import functools
import weakref
from dataclasses import dataclass, field
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
from reasonkv.core.policy.fps import add_points
from reasonkv.core.policy.knob import knob, tokens
from reasonkv.core.policy.rope import apply_rope, unapply_rope
from reasonkv.core.policy.vector_codes import decode_vectors, encode_vectors


def _skipping(
    leaving: torch.Tensor, index: torch.Tensor, positions: torch.Tensor, skip: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A queue whose rows skip their first `skip[r]` queries: those get index -1 (never fed)."""
    if skip is not None and any(skip):
        first = torch.tensor(skip, device=index.device)[:, None]
        index = index.masked_fill(torch.arange(index.shape[1], device=index.device) < first, -1)
    return leaving, index, positions


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
    pending: list[int] = field(default_factory=list)
    """Each row's queued queries (the newest ones before the recent window; below 0 when that
    many of the recent ones were fed ahead). A row's own: rows scored apart from their pool are
    fed apart (`BeaconKVScorer.settle` with rows)."""
    forwards: int = 0
    step_size: int = 0  # queries in the layer's latest forward
    scale: torch.Tensor | None = None  # [B, X, M, 1]: beacon_bits=8, each beacon's scale
    ROW_FIELDS = ("beacons", "count", "scale", "pending")

    def join_rows(self, other: BeaconState) -> None:
        """The counts of forwards are this state's (the pool's). Rows may join with queries
        queued: windows join aligned at their newest query, where each row's queue is counted
        from."""
        other.forwards, other.step_size = self.forwards, self.step_size
        super().join_rows(other)

    def rebind(self, old_window: QueryWindowView, window: QueryWindowView, layer_states: list) -> None:
        super().rebind(old_window, window, layer_states)
        self.group = _weakly(layer_states)

    def points(self) -> torch.Tensor:
        """The held beacons as vectors [B, X, M, D] (fp32 when stored as codes)."""
        return self.beacons if self.scale is None else decode_vectors(self.beacons, self.scale)

    def hold(self, points: torch.Tensor, count: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Keep `points` [B, X, M, D] as the buffers (as codes again, scales in the model's dtype,
        when they are codes); with `rows`, as those rows' buffers only."""
        scale = None
        if self.scale is not None:  # codes are per vector: a row's do not depend on the others
            points, scale = encode_vectors(points, self.scale.dtype)
        if rows is None:
            self.beacons, self.scale, self.count = points, scale, count
            return

        def put(held: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            width = max(held.shape[2], new.shape[2])  # buffers that grow (an ablation's)
            held, new = (F.pad(t, (0, 0, 0, width - t.shape[2])) for t in (held, new))
            return held.index_copy(0, rows, new.to(held.dtype))

        self.beacons = put(self.beacons, points)
        if scale is not None:
            self.scale = put(self.scale, scale)
        self.count = self.count.index_copy(0, rows, count)


@dataclass
class BeaconKVScorer(Scorer):
    beacon_max: int = tokens(32, minimum=2)
    beacon_min: int = tokens(16)
    recent: int = tokens(16)
    aggregation: Literal["max", "mean"] = "max"
    pooling: Literal["max", "avg", "none"] = "none"
    kernel: int = knob(7, ge=1, le=MAX_KERNEL)
    step_reads_keys: ClassVar[bool] = False  # on_step only counts and feeds queries
    steps_may_wait: ClassVar[bool] = True  # ... so it may count a run of waiting ones at once
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
            pending=[0] * b,
            scale=scale,
        )

    def settle(
        self,
        state: BeaconState,
        rope_inv_freq: torch.Tensor | None,
        attention_scaling: float,
        rows: list[int] | None = None,
    ) -> None:
        """Feed the queued queries (every layer of the group, in one pass). With `rows` (to be
        scored apart), only theirs, and ahead as scoring would (`flush`)."""
        if state is None:
            return
        pending = state.pending if rows is None else [state.pending[r] for r in rows]
        if max(pending, default=0) > 0:
            self.flush(state, rope_inv_freq, attention_scaling, ahead=rows is not None, rows=rows)

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
        held = win.joined_size  # what this forward's queries join (they wait no longer)
        n_out = self._leaving(held, q)
        if n_out == 0:
            return
        if step.rope_inv_freq is None:
            raise ValueError("BeaconKV needs the model's RoPE inverse frequencies (rope_inv_freq)")
        if max(st.pending, default=0) + n_out > self.upkeep_every:  # the backlog cannot hold them all
            self.flush(st, step.rope_inv_freq, step.rope_attention_scaling)
        if n_out <= self.upkeep_every:
            # They stay in the cache's backlog until fed (pending < 0: fed ahead by `flush`).
            st.pending = [p + n_out for p in st.pending]
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
        rows: list[int] | None = None,
    ) -> None:
        """Feed the queued queries of every layer in `state.group` into their beacon buffers, in
        one FPS pass (buffers stacked along the batch axis: 30 times fewer small ops on the
        default model). Scoring calls it, and so may anyone who reads the buffers.

        With `ahead` (scoring), a layer that has not run this forward yet is also fed the
        queries this forward will push out of its recent window (its oldest recent ones), so
        its own scoring finds nothing left to feed; arrival order, hence the buffers, is unchanged.
        With `rows`, only those rows are fed (a pool's rows that compress apart).
        """
        forward, q = state.forwards, state.step_size
        fed, queues = [], []
        at = None if rows is None else torch.tensor(rows, device=state.count.device)  # one copy a feed
        for st in state.group:
            # Of each window what has joined: a layer's queue counts only those (queries that
            # wait are counted by its `on_step` when they join).
            if not isinstance(st, BeaconState) or st.window.joined_size == 0:  # no forward kept yet
                continue
            win, held = st.window, st.window.joined_size
            first_recent = held - min(held, self.recent)
            n_ahead = 0
            if ahead and st.forwards < forward:
                n_ahead = self._leaving(held, q)
                if n_ahead > min(held - first_recent, self.upkeep_every):
                    n_ahead = 0  # some are still to come (a long chunk): they are fed then
            pending = st.pending if rows is None else [st.pending[r] for r in rows]
            most = max(pending)
            start, end = first_recent - most, first_recent + n_ahead
            if start >= end:  # nothing queued (or already fed ahead)
                continue
            # Every row is fed up to `end` now; a row whose own queue starts later (fed apart
            # before) skips the span's first queries.
            done = [min(p, -n_ahead) for p in pending]
            if rows is None:
                st.pending = done
            else:
                st.pending = list(st.pending)
                for r, p in zip(rows, done, strict=True):
                    st.pending[r] = p
            fed.append(st)
            span = win.span(start, end, join=False)  # decodes only the queued queries of 8-bit windows
            if at is not None:
                span = tuple(t.index_select(0, at.to(t.device)) for t in span)
            queues.append((*span, [most - p for p in pending]))
        if fed:
            self._feed(fed, queues, inv_freq, attention_scaling, at)

    def _feed(
        self,
        members: list[BeaconState],
        queues: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple],
        inv_freq: torch.Tensor | None,
        attention_scaling: float,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Feed each layer's queue of leaving queries [B, Hq, n, D], with their indices and
        positions [B, n], into its buffers, all in one pass. A queue may carry a fourth part:
        how many of its first queries each row skips (fed before). With `rows`, the queues
        are those rows' ([R'] indices) and so are the buffers fed."""
        if inv_freq is None:
            raise ValueError("BeaconKV needs the model's RoPE inverse frequencies (rope_inv_freq)")
        if len({m.count.shape[0] for m in members}) > 1:  # the stacked buffers are split by rows
            raise RuntimeError("BeaconKV: the layers fed in one pass hold different rows")
        queues = [_skipping(*q) for q in queues]

        def picked(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t.index_select(0, rows.to(t.device))

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
            prompt_end = torch.cat([picked(m.window.prompt_end) for m in members])
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
            beacons, count = picked(members[0].points()), picked(members[0].count)
        else:  # buffers that grow (an ablation's) may differ in length: pad to the longest
            held = [picked(m.points()) for m in members]
            longest = max(p.shape[2] for p in held)
            if any(p.shape[2] != longest for p in held):  # BeaconKV's never: no extra copy
                held = [F.pad(p, (0, 0, 0, longest - p.shape[2])) for p in held]
            beacons = torch.cat(held)
            count = torch.cat([picked(m.count) for m in members])
        beacons, count = self._admit(beacons, count, points, valid)
        if len(members) == 1:
            members[0].hold(beacons, count, rows)
            return
        # Copies, not views of the stacked tensors: each layer then holds its own buffers (and
        # only them), and the stack is freed.
        n = members[0].count.shape[0] if rows is None else len(rows)
        for m, buf, cnt in zip(members, beacons.split(n), count.split(n), strict=True):
            m.hold(buf.clone() if m.scale is None and rows is None else buf, cnt.clone(), rows)

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
        if st is not None and max(st.pending, default=0) > 0:  # else fed (ahead) already
            self.flush(st, obs.rope_inv_freq, obs.rope_attention_scaling, ahead=True)
        keys = keys.float()  # once, for the recent queries' logits and the beacons'
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
            logits = torch.einsum("bhmd,bhtd->bhmt", rotated, keys) * obs.scaling
            parts.append(masked_softmax(logits, held[..., None] & obs.key_valid[:, :, None, :]))
            n_points = n_points + count.reshape(b, h, -1).sum(-1)
        if self.aggregation == "max":  # each part's max, then theirs: no copy of every point's row
            maxima = [p.amax(dim=2) for p in parts if p.shape[2]]
            scores = functools.reduce(torch.maximum, maxima) if maxima else probs.new_zeros(b, h, t)
        else:
            probs = torch.cat(parts, dim=2)  # every observation point: [B, H, P, T], zeros for absent ones
            scores = probs.sum(dim=2) / n_points.clamp(min=1)[..., None].to(probs.dtype)
        return pool_tokens(scores, self.kernel, self.pooling)
