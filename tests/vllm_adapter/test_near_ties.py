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
    # Head 0 keeps token 1 over 2 by 0.5 - 0.49 (relative to 0.5); head 1 decides by 1 - 0 (relative
    # to 1); token 0 is a protected sink in both and does not count, whatever its score.
    step = SimpleNamespace(policy=SimpleNamespace(n_sink=1, n_recent=0, protect_prompt=False), window=None)
    index = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    scores = torch.tensor([[[0.9, 0.5, 0.49, 0.1], [-5.0, 0.0, 2.0, 1.0]]])
    assert selection_margin(step, index, scores, [[0, 1], [0, 2, 3]]) == pytest.approx(0.01 / 0.5)
    assert selection_margin(step, index, scores, [[0, 1, 2, 3], [0, 1, 2, 3]]) == float("inf")
    # A plateau split by the boundary (3 kept, 3 evicted) is decided against the next distinct
    # value (2); a score the scorer forces (inf: kept whatever the kernels say) decides nothing.
    one_head = torch.tensor([[[0, 1, 2, 3]]])
    plateau = torch.tensor([[[0.0, 3.0, 3.0, 2.0]]])
    assert selection_margin(step, one_head, plateau, [[0, 1]]) == pytest.approx(1 / 3)
    forced = torch.tensor([[[0.0, float("inf"), 0.5, 0.4]]])
    assert selection_margin(step, one_head, forced, [[0, 1, 2]]) == pytest.approx(0.1 / 0.5)


def trace(events: list[tuple]) -> dict:
    """An engine run's trace: (seen, layer, kept) events of the request with a 10-token prompt."""
    keys = ("seen", "layer", "kept")
    return {"trace": [{"kind": "kept", "prompt_len": 10, **dict(zip(keys, e, strict=True))} for e in events]}


def reference(events: list[tuple]) -> dict:
    """An HF run's record: (seen, layer, kept, margin) events of its first prompt."""
    keys = ("seen", "layer", "kept", "margin")
    return {"kept": [{"prompt": 0, **dict(zip(keys, e, strict=True))} for e in events]}


def test_a_difference_fails_unless_it_is_a_near_tie_and_ends_the_comparison() -> None:
    ref = reference(
        [(20, 0, [[1]], 0.5), (20, 1, [[2]], 0.5), (30, 0, [[3]], NEAR_TIE / 2), (40, 0, [[4]], 0.5)]
    )
    assert_same_kept(trace([(20, 0, [[1]]), (20, 1, [[2]]), (30, 0, [[3]]), (40, 0, [[4]])]), ref, [10])
    # The near-tie flipped: it and everything after it may differ.
    assert_same_kept(trace([(20, 0, [[1]]), (20, 1, [[2]]), (30, 0, [[9]]), (40, 0, [[8]])]), ref, [10])
    # A difference above the margin fails, before a near-tie or after one both engines decided alike.
    for wrong in (
        [(20, 0, [[1]]), (20, 1, [[7]]), (30, 0, [[3]]), (40, 0, [[4]])],
        [(20, 0, [[1]]), (20, 1, [[2]]), (30, 0, [[3]]), (40, 0, [[5]])],
        [(20, 0, [[1]]), (30, 0, [[3]]), (40, 0, [[4]])],  # a compression the engine never made
    ):
        with pytest.raises(AssertionError, match="request of 10 prompt tokens, \\(seen, layer\\)"):
            assert_same_kept(trace(wrong), ref, [10])


def test_a_near_tie_too_early_leaves_too_little_to_compare_and_fails() -> None:
    ref = reference([(20, 0, [[1]], NEAR_TIE / 10), (30, 0, [[3]], 0.5)])
    with pytest.raises(AssertionError, match="0 compressions compared equal"):
        assert_same_kept(trace([(20, 0, [[2]]), (30, 0, [[4]])]), ref, [10])


def test_a_request_that_never_compressed_fails() -> None:
    with pytest.raises(AssertionError):
        assert_same_kept(trace([]), reference([]), [10])
