"""The engines' kept tokens are compared exactly but for a flipped near-tie: the per-head margins
the HF reference records, and the comparison that excuses a difference only there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter's tests run in .venv-vllm: make test-vllm")

import torch  # noqa: E402
from hf_reference import selection_margins  # noqa: E402
from vllm_helpers import NEAR_TIE, assert_same_kept  # noqa: E402

TIE, WIDE = NEAR_TIE / 2, 0.5


def test_each_heads_margin_is_the_relative_gap_at_its_keep_boundary() -> None:
    # Head 0 keeps token 1 over 2 by 0.5 - 0.49 (relative to 0.5); head 1 decides by 1 - 0
    # (relative to 1); token 0 is a protected sink in both and does not count, whatever its score.
    step = SimpleNamespace(policy=SimpleNamespace(n_sink=1, n_recent=0, protect_prompt=False), window=None)
    index = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    scores = torch.tensor([[[0.9, 0.5, 0.49, 0.1], [-5.0, 0.0, 2.0, 1.0]]])
    assert selection_margins(step, index, scores, [[0, 1], [0, 2, 3]]) == pytest.approx([0.01 / 0.5, 1.0])
    assert selection_margins(step, index, scores, [[0, 1, 2, 3], [0, 1, 2, 3]]) == [float("inf")] * 2
    one_head = torch.tensor([[[0, 1, 2, 3]]])
    # A plateau split by the boundary (3 kept, 3 evicted) is decided against the next distinct
    # value (2); a score the scorer forces (inf: kept whatever the kernels say) decides nothing.
    plateau = torch.tensor([[[0.0, 3.0, 3.0, 2.0]]])
    assert selection_margins(step, one_head, plateau, [[0, 1]]) == pytest.approx([1 / 3])
    forced = torch.tensor([[[0.0, float("inf"), 0.5, 0.4]]])
    assert selection_margins(step, one_head, forced, [[0, 1, 2]]) == pytest.approx([0.1 / 0.5])
    # A boundary near zero is measured against a thousandth of the head's largest score.
    near_zero = torch.tensor([[[0.0, 100.0, 1e-6, -1e-6]]])
    assert selection_margins(step, one_head, near_zero, [[0, 1, 2]]) == pytest.approx([2e-6 / 0.1])


def trace(events: list[tuple]) -> dict:
    """An engine run's trace: (seen, layer, kept) events of the request with a 10-token prompt."""
    keys = ("seen", "layer", "kept")
    return {"trace": [{"kind": "kept", "prompt_len": 10, **dict(zip(keys, e, strict=True))} for e in events]}


def reference(events: list[tuple]) -> dict:
    """An HF run's record: (seen, layer, kept, margins) events of its first prompt (two heads)."""
    keys = ("seen", "layer", "kept", "margins")
    return {"kept": [{"prompt": 0, **dict(zip(keys, e, strict=True))} for e in events]}


REF = reference(
    [
        (20, 0, [[1], [1]], [WIDE, WIDE]),
        (20, 1, [[2], [2]], [WIDE, WIDE]),
        (30, 0, [[3], [3]], [TIE, WIDE]),  # head 0 was a near-tie
        (40, 0, [[4], [4]], [WIDE, WIDE]),
    ]
)


def test_a_flipped_near_tie_passes_and_ends_the_comparison() -> None:
    same = [(20, 0, [[1], [1]]), (20, 1, [[2], [2]]), (30, 0, [[3], [3]]), (40, 0, [[4], [4]])]
    assert_same_kept(trace(same), REF, [10])
    flipped = [(20, 0, [[1], [1]]), (20, 1, [[2], [2]]), (30, 0, [[9], [3]]), (40, 0, [[8], [8]])]
    assert_same_kept(trace(flipped), REF, [10])


@pytest.mark.parametrize(
    "wrong",
    [
        [(20, 0, [[1], [1]]), (20, 1, [[7], [2]]), (30, 0, [[3], [3]]), (40, 0, [[4], [4]])],  # wide margin
        [
            (20, 0, [[1], [1]]),
            (20, 1, [[2], [2]]),
            (30, 0, [[3], [3]]),
            (40, 0, [[5], [4]]),
        ],  # after a tie kept
        [
            (20, 0, [[1], [1]]),
            (20, 1, [[2], [2]]),
            (30, 0, [[3], [9]]),
            (40, 0, [[4], [4]]),
        ],  # the other head
        [(20, 0, [[1], [1]]), (20, 1, [[2], [2]]), (40, 0, [[4], [4]])],  # one the engine never made
    ],
    ids=["above-the-margin", "past-a-tie-decided-alike", "a-head-without-a-tie", "missing-at-a-tie"],
)
def test_any_other_difference_fails(wrong) -> None:
    with pytest.raises(AssertionError, match=r"request of 10 prompt tokens, \(seen, layer\)"):
        assert_same_kept(trace(wrong), REF, [10])


def test_a_near_tie_too_early_leaves_too_little_to_compare_and_fails() -> None:
    ref = reference([(20, 0, [[1], [1]], [TIE, TIE]), (30, 0, [[3], [3]], [WIDE, WIDE])])
    with pytest.raises(AssertionError, match="0 compressions compared equal"):
        assert_same_kept(trace([(20, 0, [[2], [2]]), (30, 0, [[4], [4]])]), ref, [10])


def test_a_request_that_never_compressed_fails() -> None:
    with pytest.raises(AssertionError):
        assert_same_kept(trace([]), reference([]), [10])
