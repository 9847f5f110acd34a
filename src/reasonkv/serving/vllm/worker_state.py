"""The worker's side of the adapter: every running request's policy state, and each step's batch.

vLLM's model runner prepares a step (which requests, how many tokens each, their positions);
the attention backend runs each layer and only copies its queries here (`hold_queries`); after
the model's forward this module runs, layer by layer, the step transformers runs too
(`LayerStep`) once for each pool of requests (`RequestPool`): the requests of one policy as rows
of one `PagedRowsStorage`, read in one call and compacted in one call (`after_forward`). A
request's prompt runs in a pool of its own, which joins its policy's shared pool once the prompt
is complete. Positions stay logical (RoPE sees the true index); the physical length is the
logical one less what was dropped, and the runner's `seq_lens` and slot mapping are shifted by
that (`dropped`). The scheduler learns each new physical length from the step's output and
frees the blocks past it (`hooks`).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate

import torch

from reasonkv.core.models import ModelShape
from reasonkv.core.policy.base import EMPTY
from reasonkv.core.step import LayerPolicy, LayerStep
from reasonkv.methods.api import build_policy
from reasonkv.methods.resolved import ResolvedMethod
from reasonkv.serving.paged_rows import PENDING_QUERIES, PagedRowsStorage
from reasonkv.serving.prefix_sharing import prompt_sharing
from reasonkv.serving.vllm.paged_kv import TileLayout
from reasonkv.serving.vllm.settings import request_settings

TRACE_KINDS = ("kept", "release", "step", "preempt")

POLICIES_HELD = 64
"""Per-request settings whose built policy a worker keeps for reuse (least recently used go
first; a running request holds its own): distinct settings never grow the worker's memory."""


def trace_path(kind: str) -> str | None:
    """Where events of `kind` go: `REASONKV_VLLM_TRACE=PATH` appends one JSON object a line
    (from the worker and the scheduler processes) for every compression's kept token indices,
    every block release, every scheduler step and every preemption;
    `REASONKV_VLLM_TRACE_KINDS=step,preempt` records those kinds only. A benchmark wants that:
    H2O compresses at every step, and its kept indices (a request's whole cache, every layer)
    would be gigabytes of JSON written inside the timed run."""
    if kind not in TRACE_KINDS:
        raise ValueError(f"reasonkv: no trace event of kind {kind!r}; kinds: {', '.join(TRACE_KINDS)}")
    path = os.environ.get("REASONKV_VLLM_TRACE") or None
    kinds = os.environ.get("REASONKV_VLLM_TRACE_KINDS")
    if path is None or kinds is None:
        return path
    wanted = {k.strip() for k in kinds.split(",") if k.strip()}
    known = ", ".join(TRACE_KINDS)
    if not wanted:
        raise ValueError(f"REASONKV_VLLM_TRACE_KINDS is set but names no kind; known: {known}")
    unknown = sorted(wanted - set(TRACE_KINDS))
    if unknown:
        raise ValueError(f"REASONKV_VLLM_TRACE_KINDS: unknown {unknown}; known: {known}")
    return path if kind in wanted else None


def write_trace(kind: str, **fields) -> None:
    """Append one event of `kind` where `trace_path(kind)` says (nothing if it says None)."""
    path = trace_path(kind)
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")


class RequestPool:
    """Requests of one policy as the rows of one step and one storage a layer: vLLM runs each
    layer's step once for all of them. A request's prompt runs in a pool of its own (its rows
    may take any number of tokens a forward), which joins its policy's shared pool once the
    prompt is complete (`join`); in a shared pool every row takes one token a step. A policy
    whose rows cannot share a state (`LayerStep.join_rows`) keeps each request in its own."""

    def __init__(
        self, policy: LayerPolicy, budgets: torch.Tensor, n_layers: int, prompt_end: int | None = None
    ) -> None:
        self.policy, self.budgets = policy, budgets
        self.prompt_end = prompt_end  # a new request's pool: its prompt's length
        self.scorer_states: list = [None] * n_layers
        self.steps: dict[int, LayerStep] = {}
        self.storages: dict[int, PagedRowsStorage] = {}  # the steps hold them weakly
        self.ids: list[str] = []  # the rows' requests, in every layer's order

    def layer(self, layer_idx: int, head_dim: int, dtype: torch.dtype, device, shared: int) -> LayerStep:
        """The layer's step, made at a new request's first forward of it (the pool's one row
        then holds its first `shared` tokens: a prefix-cache hit)."""
        step = self.steps.get(layer_idx)
        if step is None:
            budgets = self.budgets[layer_idx].to(device)
            names = tuple(self.policy.scorer.state_names)
            storage = self.storages[layer_idx] = PagedRowsStorage(
                budgets.numel(), head_dim, names, dtype, device
            )
            storage.add_row(self.ids[0], shared)
            step = self.steps[layer_idx] = LayerStep(
                layer_idx, budgets, self.policy, self.scorer_states, storage,
                prompt_end=self.prompt_end, query_wait=PENDING_QUERIES,
            )  # fmt: skip
            step.advance(shared)
        return step

    @property
    def past_prompt(self) -> bool:
        return bool(self.steps) and all(step.past_prompt for step in self.steps.values())

    def _join_waiting(self) -> None:
        """Every layer's waiting decode queries join its window (observed: BeaconKV counts them)
        before any layer's rows change: a feed reads every layer of the pool, which must then
        hold the same rows and counts, and one feed then serves them all."""
        for step in self.steps.values():
            step.window.join()

    def join(self, other: RequestPool) -> None:
        """Append `other`'s rows (requests past their prompts) to this pool's, layer by layer."""
        self._join_waiting()
        other._join_waiting()
        for step in (*self.steps.values(), *other.steps.values()):
            step.settle()  # every layer's first: BeaconKV feeds all layers of a pool at once
        for layer_idx, step in self.steps.items():
            step.join_rows(other.steps[layer_idx])
            self.storages[layer_idx].join_rows(other.storages[layer_idx])
        self.ids += other.ids

    def keep_rows(self, rows: list[int]) -> None:
        """Keep rows `rows` (in that order): the others' requests leave."""
        if not self.steps:
            self.ids = [self.ids[r] for r in rows]
            return
        index = torch.tensor(rows, dtype=torch.long)
        self._join_waiting()
        for layer_idx, step in self.steps.items():
            step.select_rows(index.to(step.budgets.device))
            self.storages[layer_idx].select_rows(index.to(step.budgets.device))
        self.ids = [self.ids[r] for r in rows]

    def split(self, rows: list[int]) -> RequestPool:
        """A pool of rows `rows` alone, made from copies; they leave this one (requests that
        take no token this step while the others do)."""
        out = RequestPool(self.policy, self.budgets, len(self.scorer_states))
        out.ids = [self.ids[r] for r in rows]
        self._join_waiting()
        for layer_idx, step in self.steps.items():
            index = torch.tensor(rows, dtype=torch.long, device=step.budgets.device)
            storage = out.storages[layer_idx] = self.storages[layer_idx].rows_copy(index)
            storage.compacted = set()  # a pool of its own records its own
            out.steps[layer_idx] = step.rows_copy(index, storage, out.scorer_states)
        self.keep_rows([r for r in range(len(self.ids)) if r not in set(rows)])
        return out

    def length(self, rid: str) -> int:
        """Slots the request holds (every layer must agree)."""
        lengths = {storage.length(rid) for storage in self.storages.values()}
        if len(lengths) != 1:
            raise RuntimeError(f"reasonkv: request {rid}'s layers hold different lengths {sorted(lengths)}")
        return lengths.pop()


@dataclass
class RequestState:
    """One request's policy (None: this request is not compressed), the pool that runs it, and
    how many of its tokens no slot holds any more."""

    prompt_len: int
    shared: int = 0
    """Tokens already in its blocks at its first forward (a prefix-cache hit): stored, never
    shown to the step as queries (serving/prefix_sharing.py says when that changes nothing)."""
    pool: RequestPool | None = None
    dropped: int = 0


@dataclass
class PoolRun:
    """One pool's part of a step: its rows' places in the batch, their tokens' first offsets in
    the step's queries, and the tokens each row takes (one a row in a shared pool)."""

    pool: RequestPool
    rows: list[int]
    tokens: int
    queries: torch.Tensor  # [R * tokens] the rows' offsets in the step's queries
    positions: torch.Tensor  # [R, tokens] their RoPE positions
    first_index: torch.Tensor  # [R] each row's first token's sequence index


@dataclass
class StepBatch:
    """The requests of one forward, in the runner's order."""

    req_ids: list[str]
    first_index: list[int]  # logical index of each request's first token in this forward
    n_tokens: list[int]  # tokens of each request in this forward
    prompt_len: list[int]
    extra_args: list[dict | None]  # each request's SamplingParams.extra_args (its own settings)
    block_rows: list[torch.Tensor]  # each request's block ids
    positions: torch.Tensor  # [tokens] logical RoPE positions


@dataclass
class HeldLayer:
    """One layer's queries of this step, held from its attention call until after the forward,
    with what its step needs of that call (the layer, its paged cache, the softmax scale)."""

    layer: object
    kv_cache: torch.Tensor
    scale: float
    queries: torch.Tensor  # [capacity, Hq, D]: the step's first `tokens` rows are this step's
    tokens: int = 0


class BuiltPolicies:
    """Budgets and policy for each settings a request brings, built once: the latest
    `POLICIES_HELD` are kept (least recently used go first; a running request holds its own)."""

    def __init__(self, shape: ModelShape, rope: tuple[torch.Tensor | None, float]) -> None:
        self.shape, self.rope = shape, rope
        self._built: OrderedDict[str, tuple[torch.Tensor, LayerPolicy]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._built)

    def __call__(self, settings: ResolvedMethod) -> tuple[torch.Tensor, LayerPolicy]:
        key = json.dumps([settings.name, settings.budget, dict(settings.knobs)], sort_keys=True, default=str)
        if key in self._built:
            self._built.move_to_end(key)
            return self._built[key]
        built = build_policy(settings, self.shape, *self.rope)
        self._built[key] = built
        if len(self._built) > POLICIES_HELD:
            self._built.popitem(last=False)
        return built


class WorkerState:
    """Everything the adapter holds in one worker process."""

    def __init__(
        self, settings: ResolvedMethod, shape: ModelShape, rope: tuple[torch.Tensor, float], block_size: int
    ) -> None:
        self.settings, self.shape, self.rope = settings, shape, rope
        self.n_layers, self.block_size, self.head_dim = shape.n_layers, block_size, shape.head_dim
        self.policy_for = BuiltPolicies(shape, rope)
        self.policy_for(settings)  # the engine's own, which most requests use: built at start
        self.requests: dict[str, RequestState] = {}
        self.batch: StepBatch | None = None
        self.compressed: dict[str, int] = {}  # request -> physical length, this step
        self.pending_lengths: dict[str, int] = {}  # compressed since the last output was sent
        self.layouts: dict[tuple, TileLayout] = {}
        self.held: dict[int, HeldLayer] = {}  # layer -> its queries this step (buffers reused)
        self.pools: list[RequestPool] = []  # every compressed request's, shared or its own
        self.blocks: dict[str, torch.Tensor] = {}  # request -> its block ids, this step
        self.tables: dict[tuple, torch.Tensor] = {}  # requests -> their block table, this step
        self.trace = trace_path("kept")

    def _new_request(self, i: int) -> RequestState:
        batch = self.batch
        rid = batch.req_ids[i]
        state = RequestState(batch.prompt_len[i], shared=batch.first_index[i])
        settings = request_settings(self.settings, batch.extra_args[i])
        if settings is not None:
            budgets, policy = self.policy_for(settings)
            allowed = prompt_sharing(policy, state.prompt_len, self.block_size).hit
            if state.shared > allowed:  # the scheduler's rule (hooks._share_kept_prompts) broken
                raise RuntimeError(
                    f"reasonkv: request {rid} starts after {state.shared} cached tokens; "
                    f"its method may share at most {allowed}"
                )
            state.pool = RequestPool(policy, budgets, self.n_layers, prompt_end=state.prompt_len)
            state.pool.ids = [rid]
            self.pools.append(state.pool)
        return state

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            state = self.requests.pop(rid, None)
            pool = None if state is None else state.pool
            if pool is None:
                continue
            pool.keep_rows([r for r, other in enumerate(pool.ids) if other != rid])
            if not pool.ids:
                self.pools.remove(pool)

    def dropped(self, rid: str) -> int:
        state = self.requests.get(rid)
        return 0 if state is None else state.dropped

    def layout(self, dtype: torch.dtype, isa: str, kv_cache_dtype: str, stored: torch.dtype) -> TileLayout:
        """The tile layout of a cache of `kv_cache_dtype` (a tensor of `stored`) for a model of
        `dtype`, learnt once."""
        key = (dtype, isa, kv_cache_dtype)
        if key not in self.layouts:
            layout = TileLayout(self.block_size, self.head_dim, dtype, isa, kv_cache_dtype)
            if (layout.stored is None) != (stored == dtype):  # it would read bytes as numbers
                raise RuntimeError(
                    f"reasonkv: a {stored} cache for kv_cache_dtype {kv_cache_dtype!r} and a {dtype} model"
                )
            self.layouts[key] = layout
        return self.layouts[key]

    def begin_step(self, batch: StepBatch) -> None:
        """A forward is about to run over `batch`: no layer holds queries of it yet."""
        self.batch = batch
        for held in self.held.values():
            held.tokens = 0
        self.blocks = dict(zip(batch.req_ids, batch.block_rows, strict=True))
        self.tables = {}

    def hold_queries(
        self, layer_idx: int, layer, query: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> None:
        """In the attention call: copy one layer's queries [tokens, Hq, D] (post-RoPE) into this
        step's buffer for the layer. Nothing else: no policy, no host sync (the buffer grows
        only when a forward has more tokens than any before, a size the host already knows)."""
        if self.batch is None:
            return
        held = self.held.get(layer_idx)
        n = query.shape[0]
        if held is None or held.queries.shape[0] < n or held.queries.dtype != query.dtype:
            held = self.held[layer_idx] = HeldLayer(layer, kv_cache, scale, torch.empty_like(query))
        held.layer, held.kv_cache, held.scale, held.tokens = layer, kv_cache, scale, n
        held.queries[:n].copy_(query)

    def after_forward(self) -> None:
        """After the model's forward: each layer's step, once for each pool of requests, over the
        queries the attention calls held; the requests that compress compact their slots."""
        batch = self.batch
        if batch is None:
            return
        starts = [0, *accumulate(batch.n_tokens)]
        layers = sorted(i for i, held in self.held.items() if held.tokens)
        if starts[-1] and len(layers) != self.n_layers:  # every decoder layer attends every step
            raise RuntimeError(f"reasonkv: {len(layers)} of {self.n_layers} layers held this step's queries")
        runs = self._pool_runs(starts)
        for layer_idx in layers:
            held = self.held[layer_idx]
            if held.tokens != starts[-1]:
                raise RuntimeError(
                    f"reasonkv: layer {layer_idx} held {held.tokens} queries, the step has {starts[-1]}"
                )
            for run in runs:
                self._layer_step(layer_idx, held, run)
        self._join_pools()

    def _pool_runs(self, starts: list[int]) -> list[PoolRun]:
        """This step's pools and their rows' tokens. A pool some of whose requests take no token
        this step (vLLM ran out of its token budget for them) leaves them in a pool of their own."""
        batch = self.batch
        for i, rid in enumerate(batch.req_ids):
            if starts[i + 1] > starts[i] and rid not in self.requests:
                self.requests[rid] = self._new_request(i)
        where = {rid: i for i, rid in enumerate(batch.req_ids) if starts[i + 1] > starts[i]}
        runs = []
        for pool in list(self.pools):
            absent = [r for r, rid in enumerate(pool.ids) if rid not in where]
            if len(absent) == len(pool.ids):
                continue
            if absent:
                self._split(pool, absent)
            # In a shared pool every row takes one token; a row that takes more (a streaming
            # session's next input) runs in a pool of its own this step.
            odd = [r for r, rid in enumerate(pool.ids) if batch.n_tokens[where[rid]] != 1]
            if odd and len(pool.ids) > 1:
                for rid in [pool.ids[r] for r in (odd if len(odd) < len(pool.ids) else odd[1:])]:
                    runs.append(self._run(self._split(pool, [pool.ids.index(rid)]), where, starts))
            runs.append(self._run(pool, where, starts))
        return runs

    def _split(self, pool: RequestPool, rows: list[int]) -> RequestPool:
        """Rows `rows` of `pool` to a pool of their own (joined again after the step)."""
        out = pool.split(rows)
        self.pools.append(out)
        for rid in out.ids:
            self.requests[rid].pool = out
        return out

    def _run(self, pool: RequestPool, where: dict[str, int], starts: list[int]) -> PoolRun:
        """`pool`'s part of this step (its rows all take the same number of tokens)."""
        batch = self.batch
        rows = [where[rid] for rid in pool.ids]
        q = batch.n_tokens[rows[0]]
        offsets = torch.tensor([starts[i] + t for i in rows for t in range(q)])
        positions = batch.positions[offsets.to(batch.positions.device)].view(len(rows), q)
        first_index = torch.tensor([batch.first_index[i] for i in rows])
        return PoolRun(pool, rows, q, offsets, positions, first_index)

    def _join_pools(self) -> None:
        """After the step: a pool whose requests are past their prompts joins its policy's
        shared pool (the first such pool becomes it)."""
        shared: dict[int, RequestPool] = {}
        for pool in list(self.pools):
            if not (pool.policy.joins_rows and pool.past_prompt):
                continue
            main = shared.setdefault(id(pool.policy), pool)
            if main is pool:
                continue
            main.join(pool)
            self.pools.remove(pool)
            for rid in pool.ids:
                self.requests[rid].pool = main

    def _layer_step(self, layer_idx: int, held: HeldLayer, run: PoolRun) -> None:
        batch, kv_cache, query = self.batch, held.kv_cache, held.queries
        layer, pool = held.layer, run.pool
        layout = self.layout(query.dtype, layer.isa, layer.kv_cache_dtype, kv_cache.dtype)
        scales = (layer._k_scale_float, layer._v_scale_float)  # fp8: what the kernel multiplies by
        first = pool.ids[0]
        step = pool.layer(layer_idx, self.head_dim, query.dtype, query.device, self.requests[first].shared)
        storage = pool.storages[layer_idx]

        def read(ids: list, length: int, values: bool):
            table = self._block_table(ids)
            if values:
                return None, layout.read_values(kv_cache, table, length, scales[1])
            return layout.read(kv_cache, table, length, False, scales)

        def move(
            ids: list, slots: torch.Tensor, kept: list[int], read: tuple[torch.Tensor, torch.Tensor]
        ) -> None:
            layout.compact(kv_cache, self._block_table(ids), slots, kept, read)

        q, rows = run.tokens, len(run.rows)
        # [R, Hq, q, D]: one row a request (a prompt chunk: its pool's one request)
        queries = query[run.queries.to(query.device)].view(rows, q, *query.shape[1:]).transpose(1, 2)
        storage.bind(read, move)
        storage.compacted.clear()
        storage.extend(q)
        step.advance(q, run.first_index.to(query.device))
        step.after_attention(queries, run.positions, held.scale)
        storage.unbind()
        for rid in storage.compacted:
            self.compressed[rid] = storage.length(rid)
            if self.trace:
                row = storage.ids.index(rid)
                kept = [[i for i in head if i != EMPTY] for head in storage.token_index[row].tolist()]
                state = self.requests[rid]
                logical = batch.first_index[run.rows[pool.ids.index(rid)]] + q
                write_trace(
                    "kept", request=rid, prompt_len=state.prompt_len, layer=layer_idx, seen=logical, kept=kept
                )

    def _block_table(self, ids: list) -> torch.Tensor:
        """[R, blocks] the requests' block ids, a shorter row padded with its own last block."""
        key = tuple(ids)
        table = self.tables.get(key)
        if table is None:
            rows = [self.blocks[rid] for rid in ids]
            width = max(r.numel() for r in rows)
            table = torch.stack([torch.cat([r, r[-1:].expand(width - r.numel())]) for r in rows])
            self.tables[key] = table
        return table

    def end_step(self) -> dict[str, int]:
        """After the forward: the requests that compressed, with their new physical lengths
        (every layer must agree), and their dropped counts updated."""
        out = {}
        for rid in self.compressed:
            state = self.requests[rid]
            length = state.pool.length(rid)
            i = self.batch.req_ids.index(rid)
            logical = self.batch.first_index[i] + self.batch.n_tokens[i]
            state.dropped = logical - length
            out[rid] = length
        self.compressed = {}
        return out
