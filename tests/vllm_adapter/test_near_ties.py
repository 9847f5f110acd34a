"""The engines' kept tokens are compared exactly up to a request's first near-tie: the margin
the HF reference records, and the comparison that stops there and nowhere else."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter's tests run in .venv-vllm: make test-vllm")

import torch  # noqa: E402
from hf_reference import selection_margin  # noqa: E402
from vllm_helpers import NEAR_TIE, assert_same_kept  # noqa: E402


def test_the_margin_is_the_relative_gap_at_the_keep_boundary() -> None:
    # Head 0 keeps tokens 0 and 1 (0.5 beats 0.49 by 0.01 of 0.9); head 1 keeps 2 and 3 with a
    # wide gap; the sink (token 0 of head 1, score -5) is protected and does not count.
    step = SimpleNamespace(policy=SimpleNamespace(n_sink=1, n_recent=0, protect_prompt=False), window=None)
    index = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    scores = torch.tensor([[[0.9, 0.5, 0.49, 0.1], [-5.0, 0.0, 2.0, 1.0]]])
    margin = selection_margin(step, index, scores, [[0, 1], [0, 2, 3]])
    assert margin == pytest.approx((0.5 - 0.49) / 0.5)  # head 0's sink aside: scale 0.5
    assert selection_margin(step, index, scores, [[0, 1, 2, 3], [0, 1, 2, 3]]) == float("inf")


def trace(events: list[tuple]) -> dict:
    """An engine run's trace: (seen, layer, kept) events of the request with a 10-token prompt."""
    keys = ("seen", "layer", "kept")
    return {"trace": [{"kind": "kept", "prompt_len": 10, **dict(zip(keys, e, strict=True))} for e in events]}


def reference(events: list[tuple]) -> dict:
    """An HF run's record: (seen, layer, kept, margin) events of its first prompt."""
    keys = ("seen", "layer", "kept", "margin")
    return {"kept": [{"prompt": 0, **dict(zip(keys, e, strict=True))} for e in events]}


def test_a_different_selection_above_the_margin_fails_and_one_past_a_near_tie_does_not() -> None:
    ref = reference(
        [(20, 0, [[1]], 0.5), (20, 1, [[2]], 0.5), (30, 0, [[3]], NEAR_TIE / 2), (40, 0, [[4]], 0.5)]
    )
    same = trace([(20, 0, [[1]]), (20, 1, [[2]]), (30, 0, [[3]]), (40, 0, [[4]])])
    assert_same_kept(same, ref, [10])
    flipped_at_tie = trace([(20, 0, [[1]]), (20, 1, [[2]]), (30, 0, [[9]]), (40, 0, [[8]])])
    assert_same_kept(flipped_at_tie, ref, [10])  # the near-tie and everything after it may differ
    wrong = trace([(20, 0, [[1]]), (20, 1, [[7]]), (30, 0, [[3]]), (40, 0, [[4]])])
    with pytest.raises(AssertionError, match="request of 10 prompt tokens"):
        assert_same_kept(wrong, ref, [10])
    missing = trace([(20, 0, [[1]])])
    with pytest.raises(AssertionError):
        assert_same_kept(missing, ref, [10])


def test_a_near_tie_too_early_leaves_too_little_to_compare_and_fails() -> None:
    ref = reference([(20, 0, [[1]], NEAR_TIE / 10), (30, 0, [[3]], 0.5)])
    with pytest.raises(AssertionError, match="0 comparable compressions"):
        assert_same_kept(trace([(20, 0, [[1]]), (30, 0, [[3]])]), ref, [10])
