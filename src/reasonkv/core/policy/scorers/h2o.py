"""H2O (Zhang et al., 2023, arXiv 2306.14048): heavy hitters by cumulative attention + recent tokens.

F_j = Σ_steps Σ_queries Σ_{g in group} softmax(q_g·K^T/√d)_j, accumulated at every forward
for every stored token and carried along through evictions; keep the newest
⌊recent_ratio·B⌋ tokens and the top of F among the rest (the paper's 50/50 split).

With `fold_every` = n > 1, decode queries wait in the layer's query window and their attention
is added n at a time, or when scoring needs the sums. Nothing is evicted while they wait, so
each one's causal attention over the keys held at the fold is its attention at its own step:
the sums equal step-by-step ones (up to float summation order), for one pass over the keys
per n steps instead of every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from reasonkv.core.policy.base import Observation, window_attention
from reasonkv.core.policy.contract import LayerView, PolicyState, QueryWindowView, Scorer
from reasonkv.core.policy.knob import tokens, unit

QUERY_CHUNK = 256
"""Prompt queries per block at prefill, so the fp32 probabilities stay O(chunk × cache)."""


@dataclass
class H2OState(PolicyState):
    """One layer's queries whose attention is not summed yet: the newest `pending` of its window."""

    window: QueryWindowView
    pending: int = 0


@dataclass
class H2OScorer(Scorer):
    """Cumulative attention per (row, KV head, token), summed over the GQA group's query heads,
    kept in the per-token state "h2o_acc" (so it moves with the keys at every eviction). The
    newest ⌊recent_ratio · target⌋ real tokens of each head score +inf: H2O's recent half.
    `score` reads only that state, so the query window is the minimum (1)."""

    recent_ratio: float = unit(0.5)
    fold_every: int = tokens(1)
    """Decode queries summed at once (1: every step). They wait in the query window, so a layer
    holds fold_every - 1 queries more beside its K/V."""
    window: int = field(default=1, init=False, repr=False)
    state_names: ClassVar[tuple[str, ...]] = ("h2o_acc",)

    @property
    def query_backlog(self) -> int:
        """The waiting queries, kept by the layer's window until they are summed."""
        return self.fold_every - 1

    def new_state(self, view: LayerView) -> H2OState | None:
        return None if self.fold_every == 1 else H2OState(view.window)

    def step_needs_keys(self, state: H2OState | None, q: int) -> bool:
        return self._folds(state, q)

    def _folds(self, state: H2OState | None, q: int) -> bool:
        return state is None or q > 1 or state.pending + q >= self.fold_every

    def joins_rows(self) -> bool:
        """The waiting queries' sums need the keys: rows with other counts cannot share a state."""
        return self.fold_every == 1

    def keeps_old_prompt_queries(self) -> bool:
        """A prompt query's attention adds only to prompt keys' sums (causal), and a prefix is
        shared only where the prompt is never evicted: those sums never decide anything."""
        return False

    def on_step(self, step: Observation, keys: torch.Tensor | None) -> None:
        """Add the attention of this forward's queries (all of `step`'s), and of the waiting
        ones before them, to "h2o_acc"; or let a decode query wait (fold_every > 1)."""
        st: H2OState | None = step.scorer_state
        q = step.queries.shape[2]
        if not self._folds(st, q):
            st.pending += q
            return
        if st is not None and st.pending:
            queries, index, _ = st.window.span(st.window.size - st.pending, st.window.size)
            step = replace(
                step,
                queries=torch.cat([queries, step.queries], dim=2),
                query_index=torch.cat([index, step.query_index], dim=1),
            )
            st.pending = 0
        self._add(step, keys)

    def _add(self, step: Observation, keys: torch.Tensor) -> None:
        q = step.queries.shape[2]
        acc = step.state["h2o_acc"]  # a view of the cache's per-token state: updated in place
        for start in range(0, q, QUERY_CHUNK):
            sl = slice(start, min(start + QUERY_CHUNK, q))
            block = replace(step, queries=step.queries[:, :, sl], query_index=step.query_index[:, sl])
            acc += window_attention(block, keys, gqa="sum").sum(dim=2)  # [B, H, T]

    def score(self, obs: Observation, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        st: H2OState | None = obs.scorer_state
        if st is not None and st.pending:  # the waiting queries, summed before anything is evicted
            queries, index, _ = st.window.span(st.window.size - st.pending, st.window.size)
            st.pending = 0
            self._add(replace(obs, queries=queries, query_index=index), keys)
        acc = obs.state["h2o_acc"].float()
        if obs.targets is None:
            return acc.clone()
        recent = (obs.targets.double() * self.recent_ratio).floor().long()  # [H]
        valid = obs.key_valid
        rank_from_end = valid.flip(-1).cumsum(-1).flip(-1)  # 1 for the newest real token
        is_recent = valid & (rank_from_end <= recent.to(acc.device)[None, :, None])
        return acc.masked_fill(is_recent, float("inf"))
