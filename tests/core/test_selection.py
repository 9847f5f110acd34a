"""The shared selection against slow, obviously-correct loop references on random inputs.

Every method goes through protected_mask + select_tokens, so these pin down the rules all
methods share: which tokens are protected, which survive, in what order, and how ties and
empty slots are handled.
"""

from __future__ import annotations

import pytest
import torch

from reasonkv.core.policy.base import EMPTY
from reasonkv.core.policy.selection import evict_one, protected_mask, select_tokens


def random_token_index(gen: torch.Generator, b: int, h: int, t: int, empty_p: float) -> torch.Tensor:
    """[B, H, T] increasing sequence indices per head with EMPTY slots anywhere (padding,
    evicted holes, unused capacity), as the cache lays them out."""
    gaps = torch.randint(1, 4, (b, h, t), generator=gen)
    index = gaps.cumsum(-1) - 1
    empty = torch.rand(b, h, t, generator=gen) < empty_p
    return index.masked_fill(empty, EMPTY)


def reference_protected(
    token_index: torch.Tensor, n_sink: int, n_recent: int, protect_before: torch.Tensor | None
) -> torch.Tensor:
    b, h, t = token_index.shape
    out = torch.zeros(b, h, t, dtype=torch.bool)
    for i in range(b):
        for j in range(h):
            real = [s for s in range(t) if int(token_index[i, j, s]) != EMPTY]
            chosen = set(real[:n_sink])
            if n_recent > 0:
                chosen |= set(real[-n_recent:])
            if protect_before is not None:
                chosen |= {s for s in real if int(token_index[i, j, s]) < int(protect_before[i])}
            for s in chosen:
                out[i, j, s] = True
    return out


def reference_select(
    scores: torch.Tensor, token_index: torch.Tensor, keep: torch.Tensor, protected: torch.Tensor
) -> list[list[list[int]]]:
    """Kept slots per (row, head), ascending: every protected slot, then the best-scoring
    unprotected real slots (a tie goes to the later slot, i.e. the newer token)."""
    b, h, t = scores.shape
    kept: list[list[list[int]]] = []
    for i in range(b):
        rows = []
        for j in range(h):
            real = [s for s in range(t) if int(token_index[i, j, s]) != EMPTY]
            n_keep = min(int(keep[i, j]), len(real))
            must = [s for s in real if bool(protected[i, j, s])]
            rest = [s for s in real if not bool(protected[i, j, s])]
            rest.sort(key=lambda s: (float(scores[i, j, s]), s), reverse=True)
            rows.append(sorted(must + rest[: n_keep - len(must)]))
        kept.append(rows)
    return kept


def as_lists(slots: torch.Tensor, new_len: torch.Tensor) -> list[list[list[int]]]:
    return [
        [slots[i, j, : int(new_len[i, j])].tolist() for j in range(slots.shape[1])]
        for i in range(slots.shape[0])
    ]


@pytest.mark.parametrize("seed", range(20))
def test_protected_mask_matches_loop_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, h, t = 3, 2, int(torch.randint(1, 40, (1,), generator=gen))
    index = random_token_index(gen, b, h, t, empty_p=float(torch.rand(1, generator=gen)) * 0.6)
    n_sink, n_recent = (int(x) for x in torch.randint(0, 6, (2,), generator=gen))
    prompt_end = torch.randint(0, 3 * t + 1, (b,), generator=gen) if seed % 2 else None
    got = protected_mask(index, n_sink, n_recent, prompt_end)
    assert torch.equal(got, reference_protected(index, n_sink, n_recent, prompt_end))


def test_sinks_are_the_first_real_tokens_not_the_padding() -> None:
    index = torch.tensor([[[EMPTY, EMPTY, EMPTY, 3, 4, 5, 6, 7, 8, 9]]])
    got = protected_mask(index, n_sink=2, n_recent=1)
    assert got[0, 0].nonzero().flatten().tolist() == [3, 4, 9]


def test_protected_mask_never_marks_empty_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    index = random_token_index(gen, 4, 3, 30, empty_p=0.5)
    got = protected_mask(index, n_sink=50, n_recent=50, protect_before=torch.full((4,), 10**6))
    assert not (got & (index == EMPTY)).any()
    assert torch.equal(got, index != EMPTY)  # protecting "everything" means every real token


@pytest.mark.parametrize("seed", range(30))
def test_select_tokens_keeps_exactly_the_reference_slots(seed: int) -> None:
    gen = torch.Generator().manual_seed(1000 + seed)
    b, h, t = 2, 3, int(torch.randint(1, 48, (1,), generator=gen))
    index = random_token_index(gen, b, h, t, empty_p=float(torch.rand(1, generator=gen)) * 0.5)
    # Few distinct values, so ties are common (max-pooling makes plateaus in real scores).
    scores = torch.randint(0, 4, (b, h, t), generator=gen).float()
    # Empty slots get the best scores: selection must still never keep them.
    scores = scores.masked_fill(index == EMPTY, 100.0)
    n_sink, n_recent = (int(x) for x in torch.randint(0, 4, (2,), generator=gen))
    protected = protected_mask(index, n_sink, n_recent)
    n_protected = protected.sum(-1)
    keep = n_protected + torch.randint(0, t + 2, (b, h), generator=gen)  # caller keeps >= protected

    slots, new_len = select_tokens(scores, index, keep, protected)

    assert as_lists(slots, new_len) == reference_select(scores, index, keep, protected)


@pytest.mark.parametrize("seed", range(10))
def test_select_tokens_output_contract(seed: int) -> None:
    """Kept slots ascending, padded with T, never EMPTY, exactly min(keep, real) per head."""
    gen = torch.Generator().manual_seed(2000 + seed)
    b, h, t = 3, 4, 33
    index = random_token_index(gen, b, h, t, empty_p=0.3)
    scores = torch.randn(b, h, t, generator=gen)
    protected = protected_mask(index, 2, 3)
    keep = torch.randint(5, 40, (b, h), generator=gen)
    n_valid = (index != EMPTY).sum(-1)

    slots, new_len = select_tokens(scores, index, keep, protected)

    assert torch.equal(new_len, torch.minimum(keep, n_valid))
    assert slots.shape == (b, h, int(new_len.max()))
    for i in range(b):
        for j in range(h):
            n = int(new_len[i, j])
            kept, pad = slots[i, j, :n], slots[i, j, n:]
            assert torch.all(kept[1:] > kept[:-1]), "kept slots must stay in positional order"
            assert torch.all(pad == t), "a head keeping fewer than K is padded with T"
            assert torch.all(index[i, j, kept] != EMPTY)
            assert torch.all(protected[i, j, kept].sum() == protected[i, j].sum())


def test_ties_go_to_the_newer_token() -> None:
    index = torch.arange(8).view(1, 1, 8)
    scores = torch.ones(1, 1, 8)
    no_protection = torch.zeros(1, 1, 8, dtype=torch.bool)
    slots, new_len = select_tokens(scores, index, torch.tensor([[3]]), no_protection)
    assert slots[0, 0].tolist() == [5, 6, 7]
    assert new_len.tolist() == [[3]]


def test_protected_tokens_win_over_higher_scores() -> None:
    index = torch.arange(6).view(1, 1, 6)
    scores = torch.tensor([[[0.0, 9.0, 9.0, 9.0, 9.0, 0.0]]])
    protected = protected_mask(index, n_sink=1, n_recent=1)
    slots, _ = select_tokens(scores, index, torch.tensor([[3]]), protected)
    assert slots[0, 0].tolist() == [0, 4, 5]


def test_keep_above_the_real_count_keeps_every_real_token() -> None:
    index = torch.tensor([[[EMPTY, 1, 2, EMPTY, 4], [0, 1, 2, 3, 4]]])
    scores = torch.zeros(1, 2, 5)
    slots, new_len = select_tokens(scores, index, torch.tensor([[10, 10]]), torch.zeros(1, 2, 5, dtype=bool))
    assert new_len.tolist() == [[3, 5]]
    assert slots[0, 0].tolist() == [1, 2, 4, 5, 5]
    assert slots[0, 1].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("seed", range(20))
def test_evict_one_drops_what_select_tokens_drops(seed: int) -> None:
    """The every-step fast path: a head that keeps all but one of its real tokens gives up the
    one slot select_tokens would not keep (ties among low scores are common here); a head
    that keeps everything, or has only protected tokens, gives up none (slot T)."""
    gen = torch.Generator().manual_seed(3000 + seed)
    b, h, t = 2, 4, int(torch.randint(2, 40, (1,), generator=gen))
    index = random_token_index(gen, b, h, t, empty_p=0.3)
    scores = torch.randint(0, 3, (b, h, t), generator=gen).float().masked_fill(index == EMPTY, -5.0)
    protected = protected_mask(index, int(torch.randint(0, 3, (1,), generator=gen)), 2)
    n_valid = (index != EMPTY).sum(-1)
    evict = (torch.rand(b, h, generator=gen) < 0.7) & (n_valid > protected.sum(-1))
    keep = n_valid - evict.long()

    victim = evict_one(scores, index, protected, evict)

    slots, new_len = select_tokens(scores, index, keep, protected)
    for i in range(b):
        for j in range(h):
            real = {s for s in range(t) if index[i, j, s] != EMPTY}
            dropped = real - set(slots[i, j, : int(new_len[i, j])].tolist())
            assert dropped == ({int(victim[i, j, 0])} if evict[i, j] else set())
            if not evict[i, j]:
                assert int(victim[i, j, 0]) == t
    only_protected = torch.arange(4).view(1, 1, 4)
    none = evict_one(
        torch.zeros(1, 1, 4),
        only_protected,
        torch.ones(1, 1, 4, dtype=torch.bool),
        torch.ones(1, 1, dtype=torch.bool),
    )
    assert none.tolist() == [[[4]]]


def test_protected_tokens_beyond_keep_all_survive_and_outrank_a_scorers_inf() -> None:
    """One head, 8 tokens, keep 3: tokens 0-4 are protected (a prompt of 5 under protect_prompt)
    and token 7 scores +inf (H2O's recent share). All 5 protected stay, nothing else: before,
    keep cut them to 3 and the scorer's inf tied with them, so the prompt lost its front."""
    index = torch.arange(8).view(1, 1, 8)
    scores = torch.tensor([[[0.1, 0.2, 0.3, 0.4, 0.5, 0.9, 0.8, float("inf")]]])
    protected = protected_mask(index, 0, 0, torch.tensor([5]))
    slots, new_len = select_tokens(scores, index, torch.tensor([[3]]), protected)
    assert slots.tolist() == [[[0, 1, 2, 3, 4]]] and new_len.tolist() == [[5]]
    # Room for one more: the scorer's inf takes it, ahead of the best finite score.
    slots, _ = select_tokens(scores, index, torch.tensor([[6]]), protected)
    assert slots.tolist() == [[[0, 1, 2, 3, 4, 7]]]
    # Two scorer infs (6 and 7), room for one: the newer (7) takes it and all 5 protected stay.
    # Had the infs tied with protection, the newest-first tie-break would rank 7, 6 above the
    # prompt and keep 6 would drop protected token 0: [1, 2, 3, 4, 6, 7].
    scores[0, 0, 6] = float("inf")
    slots, new_len = select_tokens(scores, index, torch.tensor([[6]]), protected)
    assert slots.tolist() == [[[0, 1, 2, 3, 4, 7]]] and new_len.tolist() == [[6]]
