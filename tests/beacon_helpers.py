"""Feeding a BeaconKV-family scorer query by query, as a layer does, without a model: shared by
the tests of the scorers that pick their observation set differently (initial-recent, the
all-queries ablation)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import torch

from reasonkv.core.policy import BeaconKVScorer, Observation, protected_mask, select_tokens
from reasonkv.core.policy.rope import apply_rope
from reasonkv.core.policy.scorers.beacon import BeaconState
from reasonkv.core.query_window import QueryWindow


def stream(
    scorer: BeaconKVScorer,
    pre: torch.Tensor,
    sizes: tuple[int, ...],
    *,
    pads: tuple[int, ...],
    prompt_len: int,
    kv_heads: int,
    inv_freq: torch.Tensor,
) -> Iterator[tuple[int, BeaconState, QueryWindow]]:
    """Feed the pre-RoPE queries pre [B, Hq, N, D] to `scorer` in forwards of `sizes` queries, as
    a layer does (on_step with this forward's post-RoPE queries, then the window keeps the newest
    `recent` + backlog). Row r has `pads[r]` padding slots in front (index -1, positions shifted);
    the first `prompt_len` slots are the prompt. Yields (queries seen, state, window) after each
    forward, with the queue fed, so the buffers are what scoring would read."""
    b, hq, n, d = pre.shape
    window, group = QueryWindow(), [None]
    view = SimpleNamespace(
        shape=(b, kv_heads, d, pre.device),
        dtype=pre.dtype,
        window=window,
        scorer_states=group,
        n_query_heads=hq,
        n_sink=3,
    )
    state = group[0] = scorer.new_state(view)
    window.prompt_end = torch.full((b,), prompt_len)
    index = torch.arange(n).expand(b, n).clone()
    positions = index - torch.tensor(pads)[:, None]
    index[positions < 0] = -1
    seen = 0
    for q in sizes:
        part = slice(seen, seen + q)
        post = apply_rope(pre[:, :, part], positions[:, None, part], inv_freq)
        step = Observation(
            post,
            index[:, part],
            torch.zeros(b, kv_heads, 1, dtype=torch.long),
            d**-0.5,
            query_positions=positions[:, part],
            rope_inv_freq=inv_freq,
            scorer_state=state,
        )
        scorer.on_step(step, torch.zeros(b, kv_heads, 1, d))
        window.keep(post, index[:, part], positions[:, part], scorer.window + scorer.query_backlog)
        seen += q
        scorer.flush(state, inv_freq)
        yield seen, state, window


def default_inv_freq(d: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))


def kept_by(
    scorer: BeaconKVScorer, state: BeaconState, window: QueryWindow, keys: torch.Tensor, recent: int
) -> tuple[torch.Tensor, list[int]]:
    """The hand-made one-head cases' choice: `scorer`'s scores over `keys` [1, 1, T, D] with the
    `recent` newest queries of `window` and its buffers, RoPE with zero frequencies, and the
    tokens kept at a budget of 4 with the sink and the 2 newest protected."""
    t, d = keys.shape[2], keys.shape[3]
    token_index = torch.arange(t).expand(1, 1, t)
    obs = Observation(
        window.queries[:, :, -recent:],
        window.query_index[:, -recent:],
        token_index,
        d**-0.5,
        query_positions=window.query_positions[:, -recent:],
        rope_inv_freq=torch.zeros(d // 2),
        scorer_state=state,
    )
    scores = scorer.score(obs, keys, keys)
    slots, _ = select_tokens(scores, token_index, torch.tensor([[4]]), protected_mask(token_index, 1, 2))
    return scores, sorted(s for s in slots[0, 0].tolist() if s < t)
