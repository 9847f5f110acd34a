"""One layer of one request whose K/V live in a serving engine's own memory.

A serving engine (vLLM) stores the keys and values in its paged cache and attends with its own
kernel; what reasonkv adds is the decision of which tokens to keep. `RequestLayer` is the
engine's side of the policy contract for one (request, layer): it keeps what a policy reads
(`LayerView`: which token each slot holds, the per-token scorer state, the query window and the
policies' own states) and runs the same hooks, in the same order, as `CompressedLayer` does in
transformers: `on_step` with every query of the forward, the window update, the schedule's
trigger, `score`, the schedule's `keep`, and the shared `select_tokens`. It never holds K/V: the
engine hands them over (`read_kv`) when a hook needs them, and compacts its own storage to the
slots this returns.

One block table is shared by all layers and heads of a request, so every head must keep the
same number of tokens: only methods with one budget for every layer and head run here (the
adapter refuses the others by name before the engine starts).

A decode step that does not compress touches no tensor of the layer: its token is counted (the
new slots' token indices and zero states are joined when a policy next reads them) and its query
waits in a short list that joins the window in one step (`PENDING_QUERIES`). A serving step runs
this once per (request, layer): a handful of small tensor ops each, hundreds a step, was most of
the adapter's cost on CPU. Scorers that observe every step (H2O, BeaconKV) read the window and
the held tokens at each step, so for them nothing waits.

It imports no engine, and no transformers itself: what it shares with the HF path (the policy
states, the observation a scorer reads, the query window) it takes from core.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reasonkv.core.cache import LayerPolicy
from reasonkv.core.layer import PolicyStates, layer_observation
from reasonkv.core.policy.contract import BudgetPlan, Scorer
from reasonkv.core.policy.selection import protected_mask, select_tokens
from reasonkv.core.query_window import QueryWindow

PENDING_QUERIES = 8
"""Decode queries a layer holds aside before they join its window: the window then changes
once per this many steps, and holds at most this many queries more than its size."""

ReadKV = Callable[[bool], tuple[torch.Tensor, torch.Tensor | None]]
"""`read_kv(values)`: the request's stored keys of this layer, [1, H, T, D] in slot order, and its
values the same way when `values` is true (else None: a step hook that reads keys only)."""


class RequestLayer:
    """The `LayerView` of one request's layer, and its decode step (batch of one row)."""

    def __init__(
        self,
        layer_idx: int,
        budgets: torch.Tensor,
        policy: LayerPolicy,
        scorer_states: list,
        prompt_end: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if policy.head_allocator is not None:
            raise ValueError("a request layer keeps one budget a head: no head allocator")
        self.layer_idx = layer_idx
        self.policy = policy
        self.budgets = budgets.to(device)
        self.plan: BudgetPlan = policy.schedule.plan([int(b) for b in budgets.tolist()])
        self.targets = torch.tensor(self.plan.targets, device=device)
        self.scorer_states = scorer_states
        self.dtype, self.device, self.head_dim = dtype, device, head_dim
        h = budgets.numel()
        self._token_index = torch.empty(1, h, 0, dtype=torch.long, device=device)
        self._token_state = {
            n: torch.zeros(1, h, 0, device=device) for n in policy.scorer.state_names
        }  # [1, H, T] each, as KVStorage keeps them
        self._joined = 0  # tokens [0, _joined) are in _token_index; [_joined, seen) are counted only
        self._window = QueryWindow(policy.scorer.window_bits)
        self._window.prompt_end = torch.tensor([prompt_end], device=device)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (query [1, Hq, q, D], positions [q])
        self._pending_from = 0  # sequence index of the first pending query
        self.seen = 0
        self.n_query_heads = 0
        self.states = PolicyStates()
        self._states_made = False
        scorer: Scorer = policy.scorer
        self._window_size = max(scorer.window, 1)
        self._window_keep = self._window_size + scorer.query_backlog
        self._observes_steps = type(scorer).on_step is not Scorer.on_step

    # ------------------------------------------------------------ LayerView
    @property
    def token_index(self) -> torch.Tensor:
        """[1, H, T] the sequence index each slot holds (the counted tokens joined first)."""
        self._join_tokens()
        return self._token_index

    @property
    def token_state(self) -> dict[str, torch.Tensor]:
        self._join_tokens()
        return self._token_state

    @property
    def window(self) -> QueryWindow:
        """The recent queries (the waiting ones joined first)."""
        self._join_queries()
        return self._window

    @property
    def n_valid(self) -> torch.Tensor:
        return torch.full_like(self.budgets, self.length)[None]

    @property
    def live_upper(self) -> int:
        return self.length * self.budgets.numel()

    @property
    def length(self) -> int:
        """Slots the request holds in this layer (every head the same)."""
        return self._token_index.shape[-1] + self.seen - self._joined

    @property
    def n_recent(self) -> int:
        return self.policy.n_recent

    @property
    def n_sink(self) -> int:
        return self.policy.n_sink

    @property
    def shape(self) -> tuple[int, int, int, torch.device]:
        return 1, self.budgets.numel(), self.head_dim, self.device

    # ------------------------------------------------------------ the step
    def step(
        self,
        query: torch.Tensor,
        positions: torch.Tensor,
        read_kv: ReadKV,
        scaling: float,
        may_compress: bool = True,
    ) -> torch.Tensor | None:
        """One forward of q new tokens, already written by the engine after the held slots and
        attended to: `query` [1, Hq, q, D] post-RoPE, `positions` [q] their RoPE positions.

        Returns the slots [H, K] each head keeps (ascending) when the layer compresses, else
        None. `may_compress=False` (a prompt chunk before the prompt's last) only observes."""
        q = query.shape[2]
        first = self.seen
        self.seen += q
        if not self._states_made:
            self.n_query_heads = query.shape[1]
            policy = self.policy
            self.states.scorer, self.states.schedule = (
                policy.scorer.new_state(self),
                policy.schedule.new_state(self),
            )
            self.scorer_states[self.layer_idx] = self.states.scorer
            self._states_made = True
        if self._observes_steps:
            index, positions = self._window.label(query, first, None, positions[None])
            step = layer_observation(self, query.detach(), index, positions, scaling)
            keys = read_kv(False)[0] if self.policy.scorer.step_reads_keys else None  # BeaconKV: none
            self.policy.scorer.on_step(step, keys)
            self._window.keep(query, index, positions, self._window_keep)
        else:
            if not self._pending:
                self._pending_from = first
            if len(self._pending) + 1 >= PENDING_QUERIES or q > 1:
                self._pending.append((query, positions))
                self._join_queries()
            else:  # it waits: a copy, for the engine may reuse its tensors, and a view of them
                # (one row of a step with a long prefill chunk) would keep the whole step alive
                self._pending.append((query.detach().clone(), positions.clone()))
        if not may_compress:
            return None
        schedule = self.policy.schedule
        rows = schedule.rows_to_compress(self, self.states.schedule)
        if rows is None or not bool(rows.all()):
            return None
        keys, values = read_kv(True)
        obs = layer_observation(self, *self.window.last(self._window_size), scaling)
        scores = self.policy.scorer.score(obs, keys, values)
        keep = schedule.keep(self, self.states.schedule)
        return self._select(keep, scores)

    def _join_tokens(self) -> None:
        """Give the counted tokens their slots: their sequence indices, and zero scorer states."""
        q = self.seen - self._joined
        if q == 0:
            return
        h = self.budgets.numel()
        new = torch.arange(self._joined, self.seen, device=self.device).expand(1, h, q)
        self._token_index = torch.cat([self._token_index, new], dim=-1)
        for name, tensor in self._token_state.items():
            self._token_state[name] = torch.cat([tensor, tensor.new_zeros(1, h, q)], dim=-1)
        self._joined = self.seen

    def _join_queries(self) -> None:
        """The waiting queries join the window as one forward would (keeping the last `size` of
        window and queries is the same done at once or one query at a time)."""
        if not self._pending:
            return
        if len(self._pending) == 1:
            query, positions = self._pending[0]
        else:
            query = torch.cat([p[0] for p in self._pending], dim=2)
            positions = torch.cat([p[1] for p in self._pending])
        self._pending = []
        index, positions = self._window.label(query, self._pending_from, None, positions[None])
        self._window.keep(query, index, positions, self._window_keep)

    def _select(self, keep: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        policy = self.policy
        prompt_end = self.window.prompt_end if policy.protect_prompt else None
        protected = protected_mask(self.token_index, policy.n_sink, policy.n_recent, prompt_end)
        slots, new_len = select_tokens(scores, self.token_index, keep, protected)
        kept = int(new_len.min())
        if kept != int(new_len.max()):
            raise RuntimeError(
                f"layer {self.layer_idx}: heads keep {new_len.tolist()} tokens; a shared block table "
                "needs one count for every head"
            )
        slots = slots[0, :, :kept]
        self._token_index = self._token_index.gather(2, slots[None])
        self._token_state = {n: t.gather(2, slots[None]) for n, t in self._token_state.items()}
        return slots
