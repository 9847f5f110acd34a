"""pass@k, maj@k and the bootstrap standard error of an evaluation with n samples per problem."""

from __future__ import annotations

import itertools
import math

import pytest

from reasonkv.harness.eval_stats import (
    aggregate,
    bootstrap_stderr,
    ks_for,
    maj_at_k,
    majority_index,
    pass_at_k,
)


def test_ks_are_one_and_powers_of_two_up_to_n() -> None:
    assert ks_for(1) == [1]
    assert ks_for(2) == [1, 2]
    assert ks_for(6) == [1, 2, 4]
    assert ks_for(16) == [1, 2, 4, 8, 16]


@pytest.mark.parametrize(("n", "c"), [(1, 0), (1, 1), (4, 1), (5, 2), (8, 3), (8, 8), (6, 0)])
def test_pass_at_k_is_the_chance_that_k_draws_without_replacement_hit_a_correct_one(n, c) -> None:
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        draws = list(itertools.combinations(outcomes, k))
        exact = sum(any(d) for d in draws) / len(draws)
        assert pass_at_k(n, c, k) == pytest.approx(exact)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_vote_counts_equal_answers_and_breaks_ties_by_first_seen() -> None:
    assert majority_index(["3", "5", "5"]) == 1
    assert majority_index(["3", "5", "5", "3"]) == 0  # a tie: 3 came first
    assert majority_index(["5", "3", "3", "5"]) == 0
    assert majority_index([None, None, "7"]) == 2  # no answer is no vote
    assert majority_index([None, None]) is None
    assert majority_index(["\\frac{1}{2}", "x", "\\dfrac{1}{2} "]) == 0  # compared after normalise
    # maj@k looks at the first k samples only, and scores the voted answer's judgement.
    preds, correct = ["1", "2", "2", "2"], [True, False, False, False]
    assert maj_at_k(preds, correct, 2) == 1.0  # "1" and "2" tie: "1" came first
    assert maj_at_k(preds, correct, 4) == 0.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0


def test_bootstrap_stderr_is_seeded_and_near_the_analytic_value() -> None:
    values = [float(i % 3 == 0) for i in range(300)]
    se = bootstrap_stderr(values)
    assert se == bootstrap_stderr(values)  # the same seed, the same number
    assert se != bootstrap_stderr(values, seed=1)
    p = sum(values) / len(values)
    assert se == pytest.approx(math.sqrt(p * (1 - p) / len(values)), rel=0.1)
    assert bootstrap_stderr([1.0]) == 0.0
    assert bootstrap_stderr([1.0, 1.0, 1.0]) == 0.0


def test_aggregate_scores_every_metric_that_exists_for_n() -> None:
    problems = [
        {"predictions": ["2", "3", "2", "2"], "correct": [True, False, True, True]},
        {"predictions": ["1", "4", "4", None], "correct": [False, True, True, False]},
        {"predictions": [None, None, None, None], "correct": [False] * 4},
    ]
    got = aggregate(problems, 4, resamples=200)
    assert list(got["scores"]) == ["pass@1", "pass@2", "pass@4", "maj@2", "maj@4"]
    assert got["scores"]["pass@1"] == pytest.approx((3 / 4 + 2 / 4 + 0) / 3)
    assert got["scores"]["pass@2"] == pytest.approx((pass_at_k(4, 3, 2) + pass_at_k(4, 2, 2)) / 3)
    assert got["scores"]["pass@4"] == pytest.approx(2 / 3)
    assert got["scores"]["maj@2"] == pytest.approx(1 / 3)  # "2" vs "3" -> "2" ok; "1" vs "4" -> "1" wrong
    assert got["scores"]["maj@4"] == pytest.approx(2 / 3)  # "2" x3 ok; "4" x2 ok
    assert set(got["stderr"]) == set(got["scores"])
    assert all(se > 0 for se in got["stderr"].values())
    one = aggregate([{"predictions": ["1"], "correct": [True]}], 1)
    assert one == {"scores": {"pass@1": 1.0}, "stderr": {"pass@1": 0.0}}
