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
        self.token_index = torch.empty(1, h, 0, dtype=torch.long, device=device)
        self.token_state = {
            n: torch.zeros(1, h, 0, device=device) for n in policy.scorer.state_names
        }  # [1, H, T] each, as KVStorage keeps them
        self.window = QueryWindow(policy.scorer.window_bits)
        self.window.prompt_end = torch.tensor([prompt_end], device=device)
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
    def n_valid(self) -> torch.Tensor:
        return torch.full_like(self.budgets, self.length)[None]

    @property
    def live_upper(self) -> int:
        return self.length * self.budgets.numel()

    @property
    def length(self) -> int:
        """Slots the request holds in this layer (every head the same)."""
        return self.token_index.shape[-1]

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
        new = torch.arange(first, first + q, device=self.device).expand(1, self.budgets.numel(), q)
        self.token_index = torch.cat([self.token_index, new], dim=-1)
        for name, tensor in self.token_state.items():
            self.token_state[name] = torch.cat([tensor, tensor.new_zeros(1, tensor.shape[1], q)], dim=-1)
        self.seen += q
        index, positions = self.window.label(query, first, None, positions[None])
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
            step = layer_observation(self, query.detach(), index, positions, scaling)
            keys = read_kv(False)[0] if self.policy.scorer.step_reads_keys else None  # BeaconKV: none
            self.policy.scorer.on_step(step, keys)
        self.window.keep(query, index, positions, self._window_keep)
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
        self.token_index = self.token_index.gather(2, slots[None])
        self.token_state = {n: t.gather(2, slots[None]) for n, t in self.token_state.items()}
        return slots
