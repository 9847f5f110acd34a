"""The one decode step (`LayerStep`) over requests' paged slots (`PagedRowsStorage`, the
storage vLLM's adapter gives it) keeps exactly what `CompressedLayer` keeps in transformers, fed
the same queries, keys and values: the vLLM adapter's decisions are the HF path's, and what
differs between the two engines is only where K/V live.

The HF run is recorded layer by layer (each forward's new keys and values, its queries and
positions, and the tokens each head holds afterwards); the same forwards are then replayed into
one step per layer over a plain contiguous store that the storage's writes compact, whole or
with the prompt cut into chunks as vLLM's chunked prefill feeds it.
"""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import greedy_loop, random_prompt, tiny_model
from reasonkv.core.layer import CompressedLayer
from reasonkv.core.policy.base import EMPTY
from reasonkv.core.step import LayerStep, window_keep
from reasonkv.core.storage import gather_slots
from reasonkv.serving.paged_rows import PENDING_QUERIES, PagedRowsStorage
from reasonkv.serving.prefix_sharing import NOTHING_SHARED, PromptSharing, prompt_sharing
from sync_helpers import SyncRecorder

METHODS = [
    ("streaming", 24, {}),
    ("h2o", 24, {}),
    ("tova", 24, {}),
    ("snapkv", 16, {"interval": 8}),
    ("rkv", 16, {"interval": 8}),
    ("random", 32, {}),
    ("recent-query", 32, {}),
    ("beaconkv", 32, {}),
    ("initial-recent", 32, {}),
    ("rpc", 8, {"ratio": 2.0}),
    ("snapkv", 16, {"interval": 8, "phase": "decode"}),
]


def record(monkeypatch, model, method, budget, knobs, prompt_len=20, steps=60, seed=3):
    """Each layer's forwards: (keys, values, query, positions, held index per head)."""
    forwards: dict[int, list] = {}
    pending: dict[int, list] = {}
    update, after = CompressedLayer.update, CompressedLayer.after_attention

    def spy_update(self, key_states, value_states, *args, **kwargs):
        pending[self.layer_idx] = [key_states.clone(), value_states.clone()]
        return update(self, key_states, value_states, *args, **kwargs)

    def spy_after(self, query, positions, scaling):
        after(self, query, positions, scaling)
        index = self.token_index[0]
        held = [sorted(int(i) for i in row if i != EMPTY) for row in index]
        pos = positions if positions is not None else torch.arange(self.new_start, self.seen)[None]
        forwards.setdefault(self.layer_idx, []).append(
            (*pending.pop(self.layer_idx), query.clone(), pos[0].clone(), held, scaling)
        )

    monkeypatch.setattr(CompressedLayer, "update", spy_update)
    monkeypatch.setattr(CompressedLayer, "after_attention", spy_after)
    cache = reasonkv.make_cache(model, method, budget, **knobs)
    greedy_loop(model, random_prompt(prompt_len, seed=seed), cache, steps)
    monkeypatch.undo()
    return cache, forwards


class Store:
    """Requests' K/V of one layer in contiguous tensors, read and compacted as vLLM's paged cache
    is through `TileLayout` (`read(ids, length, values)`, `move(ids, slots, kept)`)."""

    def __init__(self) -> None:
        self.keys: dict = {}  # request -> [1, H, length, D]
        self.values: dict = {}
        self.written: list[torch.Tensor] = []  # per row compacted: [K] bool, the slots written

    def append(self, rid, new_k, new_v) -> None:
        old_k, old_v = self.keys.get(rid), self.values.get(rid)
        self.keys[rid] = new_k if old_k is None else torch.cat([old_k, new_k], dim=2)
        self.values[rid] = new_v if old_v is None else torch.cat([old_v, new_v], dim=2)

    def trim(self, rid, length: int) -> None:
        """Slots past the storage's length are free (the engine gives their blocks back): a
        compaction that moves nothing only shortens the request."""
        self.keys[rid], self.values[rid] = (kv[rid][:, :, :length] for kv in (self.keys, self.values))

    def read(self, ids, length: int, values: bool):
        def rows(kv):
            return torch.cat(
                [torch.nn.functional.pad(kv[r], (0, 0, 0, length - kv[r].shape[2])) for r in ids]
            )

        return rows(self.keys), (rows(self.values) if values else None)

    def move(self, ids, slots: torch.Tensor, kept: list[int], read) -> None:
        for r, (rid, k) in enumerate(zip(ids, kept, strict=True)):
            row = slots[r, :, :k]
            # Which slots change; read by the tests after the run, not here (a host sync).
            self.written.append((row != torch.arange(k)).any(0))
            for kv in (self.keys, self.values):
                kv[rid] = gather_slots(kv[rid][0], row)[None]

    @property
    def moved_from(self) -> list[int]:
        """The first slot each compaction wrote (of those that wrote one)."""
        return [int(changed.int().argmax()) for changed in self.written if bool(changed.any())]


class Request:
    """One request's layer as vLLM's adapter runs it: the step over a paged storage, whose reads
    and writes go to a contiguous store here (the engine's paged cache there)."""

    def __init__(
        self, layer_idx: int, cache, states: list, prompt_end: int, wait: int = PENDING_QUERIES,
        rid="r", store: Store | None = None, shared: int = 0,
    ) -> None:  # fmt: skip
        self.rid, self.store = rid, Store() if store is None else store
        self.storage = PagedRowsStorage(2, 16, tuple(cache.policy.scorer.state_names), torch.float32, "cpu")
        self.storage.add_row(rid, shared)
        self.step = LayerStep(
            layer_idx, cache.budgets[layer_idx], cache.policy, states, self.storage,
            prompt_end=prompt_end, query_wait=wait,
        )  # fmt: skip
        self.step.advance(shared)

    @property
    def moved_from(self) -> list[int]:
        return self.store.moved_from

    @property
    def keys(self) -> torch.Tensor:
        return self.store.keys[self.rid]

    def feed(self, new_k, new_v, query, positions, scaling) -> bool:
        """One forward; whether it compressed."""
        if self.rid in self.store.keys:
            self.store.trim(self.rid, self.storage.length(self.rid))
        self.store.append(self.rid, new_k, new_v)
        self.storage.bind(self.store.read, self.store.move)
        self.storage.compacted.clear()
        self.storage.extend(query.shape[2])
        self.step.advance(query.shape[2])
        self.step.after_attention(query, positions[None], scaling)
        self.storage.unbind()
        return bool(self.storage.compacted)

    def held(self) -> list[list[int]]:
        return [sorted(row) for row in self.storage.token_index[0].tolist()]


def replay(request: Request, steps: list, chunk: int | None = None, shared: int = 0) -> int:
    """Feed a recorded layer's forwards to `request` (the first one, the prompt, in chunks of
    `chunk` tokens if given; its first `shared` tokens stored but never fed, as a prefix-cache
    hit leaves them), asserting after each that it holds what the HF cache held and, in the
    prompt's chunks, every token so far; returns the compressions."""
    compressions = 0
    first, *rest = steps
    new_k, new_v, query, positions, held, scaling = first
    n = query.shape[2]
    if shared:
        request.store.append(request.rid, new_k[:, :, :shared], new_v[:, :, :shared])
    for start in range(shared, n, chunk or n):
        end = min(start + (chunk or n), n)
        compressions += request.feed(
            new_k[:, :, start:end],
            new_v[:, :, start:end],
            query[:, :, start:end],
            positions[start:end],
            scaling,
        )
        if end < n:
            assert request.held() == [list(range(end))] * 2, f"prompt chunk ending at {end}"
    assert request.held() == held, "after the prompt"
    for new_k, new_v, query, positions, held, scaling in rest:
        compressions += request.feed(new_k, new_v, query, positions, scaling)
        assert request.held() == held, f"layer {request.step.layer_idx} after token {request.step.seen}"
    request.store.trim(request.rid, request.storage.length(request.rid))
    return compressions


@pytest.mark.parametrize("chunk", [None, 8], ids=["one-prefill", "chunks-of-8"])
@pytest.mark.parametrize(("method", "budget", "knobs"), METHODS, ids=lambda v: str(v))
def test_the_paged_step_keeps_what_the_cache_keeps(monkeypatch, method, budget, knobs, chunk) -> None:
    """Also with the 20-token prompt fed in chunks of 8: every schedule counts from the prompt's
    true end (RPC's prompt length, SnapKV's phase="decode" count), whatever the chunking."""
    model = tiny_model("llama")
    cache, forwards = record(monkeypatch, model, method, budget, knobs)
    states = [None] * len(forwards)
    compressions = 0
    for layer_idx, steps in forwards.items():
        compressions += replay(Request(layer_idx, cache, states, prompt_end=20), steps, chunk)
    assert compressions > 0, "the run never compressed: the comparison would prove nothing"


POOLED = [m for m in METHODS if m[2].get("phase") != "decode"]
"""The methods whose rows join one state (`Schedule.joins_rows`): all but a count from the
prompt's end, which is one number for every row."""
ARRIVALS = {"a": (0, 20, 3, 56), "b": (5, 28, 4, 50), "c": (12, 12, 5, 54)}
"""request -> (the step its prompt arrives at, prompt length, seed, decode steps)."""


@pytest.mark.parametrize(("method", "budget", "knobs"), POOLED, ids=lambda v: str(v))
def test_a_pool_of_requests_at_different_positions_keeps_what_each_cache_keeps(
    monkeypatch, method, budget, knobs
) -> None:
    """vLLM's adapter runs one step a layer over its running requests, as rows of one storage:
    each request's prompt runs in a storage of its own, which joins the pool once the prompt is
    complete; every decode step then feeds all rows at once, the rows that compress are scored
    apart from the others and put back, and a finished request leaves. Each row keeps, at every
    step, exactly what its own HF cache kept (recorded alone)."""
    model = tiny_model("llama")
    runs = {}
    for rid, (_, prompt_len, seed, steps) in ARRIVALS.items():
        cache, runs[rid] = record(monkeypatch, model, method, budget, knobs, prompt_len, steps, seed)
    compressed = {rid: 0 for rid in ARRIVALS}
    apart = uneven = 0
    for layer_idx in runs["a"]:
        store, pool, fed = Store(), None, {rid: 0 for rid in ARRIVALS}
        for t in range(max(start + steps + 1 for start, _, _, steps in ARRIVALS.values())):
            joining = []
            for rid, (start, prompt_len, _, _) in ARRIVALS.items():
                if t == start:  # the prompt, in a storage and step of its own
                    new = Request(
                        layer_idx, cache, [None] * len(runs[rid]), prompt_end=prompt_len, rid=rid, store=store
                    )
                    k, v, query, positions, held, scaling = runs[rid][layer_idx][0]
                    compressed[rid] += new.feed(k, v, query, positions, scaling)
                    assert new.held() == held
                    fed[rid] = 1
                    joining.append(new)
            if pool is not None:
                rows = list(pool.storage.ids)
                for rid in rows:
                    store.trim(rid, pool.storage.length(rid))
                forwards = [runs[rid][layer_idx][fed[rid]] for rid in rows]
                for rid, (k, v, *_rest) in zip(rows, forwards, strict=True):
                    store.append(rid, k, v)
                query = torch.cat([f[2] for f in forwards])
                positions = torch.stack([f[3] for f in forwards])  # [R, 1]
                pool.storage.bind(store.read, store.move)
                pool.storage.compacted.clear()
                pool.storage.extend(1)
                pool.step.advance(1, positions[:, 0])
                rows_compressed = pool.step.after_attention(query, positions, forwards[0][5])
                pool.storage.unbind()
                if rows_compressed is not None and not bool(rows_compressed.all()):
                    apart += 1
                queued = getattr(pool.step.states.scorer, "pending", None)  # BeaconKV's queue a row
                uneven += isinstance(queued, list) and len(set(queued)) > 1
                assert pool.storage.ids == rows, "rows scored apart are put back in their place"
                for r, rid in enumerate(rows):
                    held = [sorted(i for i in h if i != EMPTY) for h in pool.storage.token_index[r].tolist()]
                    assert held == forwards[r][4], f"{rid}, layer {layer_idx}, forward {fed[rid]}"
                    compressed[rid] += rid in pool.storage.compacted
                    fed[rid] += 1
                done = [r for r, rid in enumerate(rows) if fed[rid] == len(runs[rid][layer_idx])]
                if done:  # finished requests leave
                    stay = torch.tensor([r for r in range(len(rows)) if r not in done], dtype=torch.long)
                    pool.step.select_rows(stay)
                    pool.storage.select_rows(stay)
            for new in joining:  # after the step, a request past its prompt joins the pool
                if pool is None or not pool.storage.ids:
                    pool = new
                else:
                    pool.step.join_rows(new.step)
                    pool.storage.join_rows(new.storage)
        assert all(fed[rid] == len(runs[rid][layer_idx]) for rid in ARRIVALS)
    assert all(compressed.values()), f"every request must compress: {compressed}"
    assert apart, "no step compressed some rows and not others: the rows apart were never tested"
    if method == "beaconkv":  # rows scored apart were fed apart: the others kept their queue
        assert uneven, "no row's queue ever differed from the others': feeding apart was never tested"


def test_heads_that_keep_different_counts_are_refused() -> None:
    """A block table holds every head of a layer at one length (a head allocator cannot run)."""
    storage = PagedRowsStorage(2, 4, (), torch.float32, "cpu")
    storage.add_row("r", 6)
    storage.bind(None, lambda ids, slots, kept, read: None)
    slots = torch.tensor([[[0, 1, 2], [0, 1, 6]]])
    with pytest.raises(RuntimeError, match="one count for every head"):
        storage.keep_slots(slots, torch.tensor([[3, 2]]), torch.zeros(1, 2, 6))


def test_kept_slots_are_gathered_head_by_head() -> None:
    kv = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    slots = torch.tensor([[0, 3], [1, 4]])
    assert torch.equal(gather_slots(kv, slots), kv.gather(1, slots[..., None].expand(-1, -1, 3)))


TIES = [("tova", 24, {}), ("snapkv", 16, {"interval": 8}), ("beaconkv", 32, {})]
"""(H2O is not here: its sums over different numbers of steps do not tie. A tie-break reversed in
the paged storage's selection fails all three.)"""


@pytest.mark.parametrize(("method", "budget", "knobs"), TIES, ids=lambda v: str(v))
def test_on_exact_ties_the_paged_step_keeps_what_the_cache_keeps(monkeypatch, method, budget, knobs) -> None:
    """Zero queries make every attention weight equal, so every score ties exactly: which of the
    tied tokens survive is then decided by tie-breaking alone. The HF path evicts every-step
    methods one slot at a time into holes (`evict_one`) where the paged storage selects and
    compacts (`select_tokens`); both must break ties the same way."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    cache, forwards = record(monkeypatch, model, method, budget, knobs)
    first = forwards[0][-1][2]  # the last forward's query of layer 0: all zero
    assert not first.any(), "the queries must be zero for every score to tie"
    assert replay(Request(1, cache, [None] * len(forwards), prompt_end=20), forwards[1]) > 0


def test_waiting_decode_queries_join_the_window_as_step_by_step_keeps_would() -> None:
    """A scorer that does not observe steps (SnapKV) lets decode queries wait before they join the
    window; what the window then holds (queries, indices, positions) is what a window fed one
    query a step holds, whenever it is read, and no more than PENDING_QUERIES wait. The engine may
    reuse its tensors after the step: what waits must not change with them."""
    from reasonkv.core.query_window import QueryWindow

    model = tiny_model("llama")
    cache = reasonkv.make_cache(model, "snapkv", 512, window=5)
    request = Request(0, cache, [None], prompt_end=6)
    step, window = request.step, request.step.window
    reference = QueryWindow()
    torch.manual_seed(0)
    waited = 0
    for i in range(3 * PENDING_QUERIES + 3):
        q = 6 if i == 0 else 1  # the prompt, then one token a step
        first = step.seen
        query = torch.randn(1, 4, q, 16)
        positions = torch.arange(first, first + q) + 100  # positions need not equal indices
        engine_query, engine_positions = query.clone(), positions.clone()
        assert not request.feed(
            torch.randn(1, 2, q, 16), torch.randn(1, 2, q, 16), engine_query, engine_positions, 0.25
        )
        engine_query.zero_(), engine_positions.zero_()  # the engine's buffers, reused for the next step
        index, pos = reference.label(query, first, None, positions[None])
        reference.keep(query, index, pos, step.window_keep)
        assert len(window._waiting) < PENDING_QUERIES
        waited = max(waited, len(window._waiting))
        if i % 11 == 10:  # now and then, more than PENDING_QUERIES steps apart: reading joins what waits
            assert torch.equal(window.queries, reference.queries)
            assert torch.equal(window.query_index, reference.query_index)
            assert torch.equal(window.query_positions, reference.query_positions)
            assert window._waiting == []
    assert waited == PENDING_QUERIES - 1  # the cap was reached and joined, not only read away
    assert request.storage.length("r") == step.seen == request.keys.shape[2]
    assert torch.equal(request.storage.token_index[0], torch.arange(step.seen).expand(2, -1))


PAGED_PER_COMPRESSION = {"beaconkv": 6, "initial-recent": 4, "rpc": 6}
"""The most host syncs of one (request, layer) step that compresses, as measured; 3 for the
others: the schedule's decision, `select_tokens`' widest keep, and `keep_slots`' one read of
its counts (the heads' least and most kept, and the slots that keep their token). BeaconKV's
decode queries wait, so a compressing step first joins them: counting them may feed the
backlog (one sync), and scoring then feeds the rest ahead (one more)."""
PAGED_FEEDS = {"beaconkv": 1, "initial-recent": 2}
"""BeaconKV's backlog feed (core/test_host_syncs.py): at most one sync (two for initial-recent's
fixed set) on a step that does not compress, once every `upkeep_every` steps."""


@pytest.mark.parametrize(("method", "budget", "knobs"), METHODS, ids=lambda v: str(v))
def test_host_syncs_of_the_paged_step(monkeypatch, method, budget, knobs) -> None:
    """What the paged step would make a GPU wait for, per decode step of one (request, layer):
    nothing on a step that neither compresses nor feeds BeaconKV's buffers, and at most a few
    reads (the schedule's decision, the kept count) on one that compresses."""
    model = tiny_model("llama")
    cache, forwards = record(monkeypatch, model, method, budget, knobs)
    states = [None] * len(forwards)
    seen = {"quiet": [], "compressing": []}
    for layer_idx, (first, *rest) in forwards.items():
        request = Request(layer_idx, cache, states, prompt_end=20)
        new_k, new_v, query, positions, _, scaling = first
        request.feed(new_k, new_v, query, positions, scaling)
        for new_k, new_v, query, positions, _, scaling in rest:
            with SyncRecorder() as recorder:
                compressed = request.feed(new_k, new_v, query, positions, scaling)
            seen["compressing" if compressed else "quiet"].append(len(recorder.calls))
    assert seen["compressing"], "the setting must compress"
    assert max(seen["quiet"]) <= PAGED_FEEDS.get(method, 0), seen
    assert max(seen["compressing"]) <= PAGED_PER_COMPRESSION.get(method, 3), seen


SHARING = [
    ("rpc", 8, {"ratio": 2.0}),
    ("snapkv", 16, {"interval": 8, "protect_prompt": True}),
    ("snapkv", 16, {"interval": 8, "phase": "decode", "protect_prompt": True}),
    ("rkv", 16, {"interval": 8, "protect_prompt": True}),
    ("h2o", 56, {"protect_prompt": True}),  # above the prompt: it evicts generated tokens, moving others
    ("tova", 24, {"protect_prompt": True}),
    ("streaming", 24, {"protect_prompt": True}),
    ("beaconkv", 32, {"protect_prompt": True}),
]
SHARED_PROMPT, SHARED_BLOCK = 48, 8


@pytest.mark.parametrize("chunk", [None, 8], ids=["one-prefill", "chunks-of-8"])
@pytest.mark.parametrize(("method", "budget", "knobs"), SHARING, ids=lambda v: str(v))
def test_after_a_shared_prefix_the_paged_step_keeps_what_the_whole_prompt_keeps(
    monkeypatch, method, budget, knobs, chunk
) -> None:
    """A prefix-cache hit stores the prompt's first tokens without a forward: the step never sees
    their queries. Where `prompt_sharing` allows the hit (the prompt protected, the window's
    queries all after it), the request keeps at every step what the HF cache keeps, and no
    compaction writes a slot of the prompt (its blocks keep the tokens the cache names them by)."""
    model = tiny_model("llama")
    cache, forwards = record(monkeypatch, model, method, budget, knobs, prompt_len=SHARED_PROMPT)
    sharing = prompt_sharing(cache.policy, SHARED_PROMPT, SHARED_BLOCK)
    assert sharing.named == SHARED_PROMPT
    assert sharing.hit == (SHARED_PROMPT - window_keep(cache.policy)) // SHARED_BLOCK * SHARED_BLOCK > 0
    states = [None] * len(forwards)
    compressions, moved_from = 0, []
    for layer_idx, steps in forwards.items():
        request = Request(layer_idx, cache, states, prompt_end=SHARED_PROMPT, shared=sharing.hit)
        compressions += replay(request, steps, chunk, shared=sharing.hit)
        moved_from += request.moved_from
    assert compressions > 0, "the run never compressed: the comparison would prove nothing"
    assert moved_from, "no compaction moved a token: the prompt's slots were never at risk"
    # Not shown: that a larger hit would change the kept tokens. Every scorer here leaves its
    # window's newest tokens out of the candidates, so a window still holding prompt queries has
    # nothing to decide; hiding all but the last block changed nothing for rpc, nor for beaconkv
    # fed prompt queries (which prompt_sharing still gives no hit: it is conservative there).
    assert min(moved_from) >= SHARED_PROMPT


@pytest.mark.parametrize(
    ("method", "knobs", "expected"),
    [
        ("snapkv", {}, NOTHING_SHARED),  # the prompt may be evicted: its blocks may be rewritten
        ("beaconkv", {}, NOTHING_SHARED),
        ("beaconkv", {"protect_prompt": True, "beacon_feed": "all"}, PromptSharing(0, 40)),
        ("beaconkv", {"protect_prompt": True, "beacon_feed": "no_sinks"}, PromptSharing(0, 40)),
        ("beaconkv", {"protect_prompt": True}, PromptSharing(16, 40)),  # keeps 16 + 8 queries
        ("rpc", {}, PromptSharing(8, 40)),  # keeps its 32 recent queries
        ("h2o", {"protect_prompt": True}, PromptSharing(40, 40)),  # its sums of prompt keys never decide
        ("adakv-snapkv", {}, NOTHING_SHARED),  # AdaKV refuses protect_prompt
        ("pyramidkv", {"protect_prompt": True}, PromptSharing(32, 40)),  # its SnapKV window of 8 queries
    ],
    ids=lambda v: str(v),
)
def test_what_a_compressed_prompt_may_share(method, knobs, expected) -> None:
    """Nothing where the prompt may be evicted; its full blocks where it is kept, and hits only
    where the scorer keeps nothing of older prompt queries (beacons fed by the prompt do)."""
    cache = reasonkv.make_cache(tiny_model("llama"), method, 64, **knobs)
    assert prompt_sharing(cache.policy, 45, 8) == expected


def test_a_scorer_that_observes_every_forward_or_a_head_split_takes_no_hit() -> None:
    """By default a scorer with its own `on_step` may keep what older prompt queries showed it,
    and a head allocator keeps what it measured: neither may start after a shared prefix."""
    from reasonkv.core.policy.allocators.reasonalloc import EntropyHeadSplit
    from reasonkv.core.policy.contract import Scorer
    from reasonkv.core.policy.schedules import EveryStep
    from reasonkv.core.step import LayerPolicy

    class Observing(Scorer):
        def on_step(self, step, keys) -> None:
            pass

    plain = LayerPolicy(Scorer(), EveryStep(), protect_prompt=True)
    assert prompt_sharing(plain, 45, 8) == PromptSharing(40, 40)
    observing = LayerPolicy(Observing(), EveryStep(), protect_prompt=True)
    assert prompt_sharing(observing, 45, 8) == PromptSharing(0, 40)
    split = LayerPolicy(Scorer(), EveryStep(), protect_prompt=True, head_allocator=EntropyHeadSplit())
    assert prompt_sharing(split, 45, 8) == PromptSharing(0, 40)


def test_rows_copied_out_go_back_only_to_their_own_places() -> None:
    """`put_rows` writes a compacted copy of some rows back where they were: those rows change,
    the others and the order do not, the pool narrows to its longest row, and a copy of other
    rows is refused."""
    storage = PagedRowsStorage(1, 4, ("mass",), torch.float32, "cpu")
    storage.add_row("a")
    storage.extend(6)
    for rid, held in (("b", 4), ("c", 6)):
        other = PagedRowsStorage(1, 4, ("mass",), torch.float32, "cpu")
        other.add_row(rid)
        other.extend(held)
        storage.join_rows(other)
    storage.token_state["mass"].copy_(torch.arange(18.0).view(3, 1, 6))
    rows = [0, 2]
    part = storage.rows_copy(torch.tensor(rows))
    part.bind(
        lambda ids, n, v: (torch.zeros(len(ids), 1, n, 4), torch.zeros(len(ids), 1, n, 4)), lambda *a: None
    )
    part.keep_slots(torch.tensor([[[1, 3, 4]], [[0, 2, 5]]]), torch.tensor([[3], [3]]), torch.zeros(2, 1, 6))
    storage.put_rows(rows, part, torch.tensor(rows))
    assert storage.ids == ["a", "b", "c"] and storage.lengths() == [3, 4, 3]
    assert storage.token_index[:, 0].tolist() == [[1, 3, 4, EMPTY], [0, 1, 2, 3], [0, 2, 5, EMPTY]]
    assert storage.token_state["mass"][:, 0].tolist() == [[1, 3, 4, 0], [6, 7, 8, 9], [12, 14, 17, 0]]
    with pytest.raises(ValueError, match="places they were copied from"):
        storage.put_rows([1, 2], part, torch.tensor([1, 2]))


@pytest.mark.parametrize(
    ("method", "budget", "knobs"), [("beaconkv", 32, {}), ("beaconkv", 32, {"upkeep_every": 3})]
)
def test_layers_run_in_engine_order_feed_the_beacons_the_hf_cache_feeds(
    monkeypatch, method, budget, knobs
) -> None:
    """As vLLM runs them: every layer of a step, then the next step, all layers' states in one
    group, decode queries waiting. A layer's feed reads the other layers' windows as joined
    while their queries wait, so each layer keeps what its HF cache keeps at every step, and
    at the end holds the same beacons, counts and queue."""
    model = tiny_model("llama")
    cache, forwards = record(monkeypatch, model, method, budget, knobs, steps=120)
    layers = sorted(forwards)
    states = [None] * len(layers)
    requests = {layer: Request(layer, cache, states, prompt_end=20) for layer in layers}
    compressions = 0
    for t in range(len(forwards[layers[0]])):
        for layer in layers:
            new_k, new_v, query, positions, held, scaling = forwards[layer][t]
            compressions += requests[layer].feed(new_k, new_v, query, positions, scaling)
            assert requests[layer].held() == held, f"layer {layer}, forward {t}"
    assert compressions > len(layers), "several compressions a layer, or the test proves little"
    for layer in layers:
        hf, paged = cache.layers[layer].step.states.scorer, states[layer]
        paged.window.join()  # what still waits is counted when it joins
        assert torch.equal(hf.count, paged.count) and torch.equal(hf.points(), paged.points())
