"""The worker's side of the adapter: every running request's policy state, and each step's batch.

vLLM's model runner prepares a step (which requests, how many tokens each, their positions);
the attention backend runs each layer and only copies its queries here (`hold_queries`); after
the model's forward this module runs, layer by layer, each running request's `LayerStep` (the
step transformers runs too) over its `PagedRequestStorage` and, when the policy compresses,
writes the kept slots back into the paged cache (`after_forward`). Positions stay logical
(RoPE sees the true index); the physical length is the logical one less what was dropped, and
the runner's `seq_lens` and slot mapping are shifted by that (`dropped`). The scheduler learns
each new physical length from the step's output and frees the blocks past it (`hooks`).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from reasonkv.core.models import ModelShape
from reasonkv.core.step import LayerPolicy, LayerStep
from reasonkv.methods.api import build_policy
from reasonkv.serving.paged_request import PENDING_QUERIES, PagedRequestStorage
from reasonkv.serving.prefix_sharing import prompt_sharing
from reasonkv.serving.vllm.paged_kv import TileLayout
from reasonkv.serving.vllm.settings import ServingSettings, request_settings

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


@dataclass
class RequestState:
    """One request's policy (None: this request is not compressed), its layers, and how many of
    its tokens no slot holds any more."""

    prompt_len: int
    shared: int = 0
    """Tokens already in its blocks at its first forward (a prefix-cache hit): stored, never
    shown to the step as queries (serving/prefix_sharing.py says when that changes nothing)."""
    budgets: torch.Tensor | None = None
    policy: LayerPolicy | None = None
    layers: dict[int, LayerStep] = field(default_factory=dict)
    storages: dict[int, PagedRequestStorage] = field(default_factory=dict)  # the steps hold them weakly
    scorer_states: list = field(default_factory=list)
    dropped: int = 0

    def layer(
        self, layer_idx: int, head_dim: int, dtype: torch.dtype, device
    ) -> tuple[LayerStep, PagedRequestStorage]:
        """The step of this request's layer and its storage, made at the layer's first forward."""
        step = self.layers.get(layer_idx)
        if step is None:
            budgets = self.budgets[layer_idx].to(device)
            names = tuple(self.policy.scorer.state_names)
            storage = self.storages[layer_idx] = PagedRequestStorage(
                budgets.numel(), head_dim, names, dtype, device
            )
            step = self.layers[layer_idx] = LayerStep(
                layer_idx, budgets, self.policy, self.scorer_states, storage,
                prompt_end=self.prompt_len, query_wait=PENDING_QUERIES,
            )  # fmt: skip
            storage.extend(self.shared)
            step.advance(self.shared)
        return step, self.storages[layer_idx]

    def physical_length(self) -> int:
        lengths = {storage.length for storage in self.storages.values()}
        if len(lengths) != 1:
            raise RuntimeError(f"reasonkv: a request's layers hold different lengths {sorted(lengths)}")
        return lengths.pop()


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

    def __call__(self, settings: ServingSettings) -> tuple[torch.Tensor, LayerPolicy]:
        key = json.dumps([settings.method, settings.budget, settings.knobs], sort_keys=True, default=str)
        if key in self._built:
            self._built.move_to_end(key)
            return self._built[key]
        inv_freq, scaling = self.rope
        knobs = settings.knobs
        built = build_policy(settings.method, settings.budget, self.shape, inv_freq, scaling, **knobs)
        self._built[key] = built
        if len(self._built) > POLICIES_HELD:
            self._built.popitem(last=False)
        return built


class WorkerState:
    """Everything the adapter holds in one worker process."""

    def __init__(
        self, settings: ServingSettings, shape: ModelShape, rope: tuple[torch.Tensor, float], block_size: int
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
        self.trace = trace_path("kept")

    def _new_request(self, i: int) -> RequestState:
        batch = self.batch
        state = RequestState(batch.prompt_len[i], shared=batch.first_index[i])
        settings = request_settings(self.settings, batch.extra_args[i])
        if settings is not None:
            state.budgets, state.policy = self.policy_for(settings)
            allowed = prompt_sharing(state.policy, state.prompt_len, self.block_size).hit
            if state.shared > allowed:  # the scheduler's rule (hooks._share_kept_prompts) broken
                raise RuntimeError(
                    f"reasonkv: request {batch.req_ids[i]} starts after {state.shared} cached tokens; "
                    f"its method may share at most {allowed}"
                )
        state.scorer_states = [None] * self.n_layers
        return state

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self.requests.pop(rid, None)

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
        """After the model's forward: each layer's step for every running request, over the
        queries the attention calls held; the requests that compress compact their slots."""
        batch = self.batch
        if batch is None:
            return
        starts = [0, *accumulate(batch.n_tokens)]
        layers = sorted(i for i, held in self.held.items() if held.tokens)
        if starts[-1] and len(layers) != self.n_layers:  # every decoder layer attends every step
            raise RuntimeError(f"reasonkv: {len(layers)} of {self.n_layers} layers held this step's queries")
        for layer_idx in layers:
            held = self.held[layer_idx]
            if held.tokens != starts[-1]:
                raise RuntimeError(
                    f"reasonkv: layer {layer_idx} held {held.tokens} queries, the step has {starts[-1]}"
                )
            self._layer_step(layer_idx, held, starts)

    def _layer_step(self, layer_idx: int, held: HeldLayer, starts: list[int]) -> None:
        batch, kv_cache, query = self.batch, held.kv_cache, held.queries
        layer = held.layer
        layout = self.layout(query.dtype, layer.isa, layer.kv_cache_dtype, kv_cache.dtype)
        scales = (layer._k_scale_float, layer._v_scale_float)  # fp8: what the kernel multiplies by
        for i, rid in enumerate(batch.req_ids):
            start, end = starts[i], starts[i + 1]
            if end <= start:
                continue
            state = self.requests.get(rid)
            if state is None:
                state = self.requests[rid] = self._new_request(i)
            if state.policy is None:  # "reasonkv": false for this request
                continue
            step, storage = state.layer(layer_idx, self.head_dim, query.dtype, query.device)
            blocks = batch.block_rows[i]

            # The defaults bind this iteration's request (the storage calls them inside the step).
            def read(length: int, values: bool, blocks=blocks):
                if values:
                    return None, layout.read_values(kv_cache, blocks, length, scales[1])
                return layout.read(kv_cache, blocks, length, False, scales)

            def move(slots: torch.Tensor, first: int, blocks=blocks) -> None:
                layout.move(kv_cache, blocks, slots, first)

            storage.bind(read, move)
            storage.extend(end - start)
            step.advance(end - start)
            q = query[start:end].transpose(0, 1)[None]  # [1, Hq, q, D]
            step.after_attention(q, batch.positions[start:end][None], held.scale)
            storage.unbind()
            if not storage.compacted:
                continue
            self.compressed[rid] = storage.length
            if self.trace:
                kept = storage.token_index[0].tolist()
                write_trace(
                    "kept",
                    request=rid,
                    prompt_len=state.prompt_len,
                    layer=layer_idx,
                    seen=step.seen,
                    kept=kept,
                )

    def end_step(self) -> dict[str, int]:
        """After the forward: the requests that compressed, with their new physical lengths
        (every layer must agree), and their dropped counts updated."""
        out = {}
        for rid in self.compressed:
            state = self.requests[rid]
            length = state.physical_length()
            i = self.batch.req_ids.index(rid)
            logical = self.batch.first_index[i] + self.batch.n_tokens[i]
            state.dropped = logical - length
            out[rid] = length
        self.compressed = {}
        return out
