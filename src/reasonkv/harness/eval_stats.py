"""Aggregates of an evaluation with n samples per problem: pass@k, maj@k and their bootstrap
standard errors.

- pass@k is the unbiased estimator of Chen et al. (2021, the Codex paper): per problem with n
  samples of which c are correct, 1 - C(n-c, k) / C(n, k); the mean over problems.
- maj@k: the majority vote over the extracted answers of the first k samples (answers compared
  after `normalise`; a sample without an answer does not vote; a tie goes to the answer seen
  first); a problem scores 1 when the voted answer was judged correct.
- The standard error of each aggregate resamples the problems with replacement (a fixed seed,
  RESAMPLES times) and takes the standard deviation of the resampled means.

k runs over 1 and the powers of 2 up to n; maj@k starts at k = 2 (maj@1 is the first sample).
"""

from __future__ import annotations

import math

import torch

from reasonkv.harness.answers import normalise

RESAMPLES = 1000
BOOTSTRAP_SEED = 0


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... up to n (n itself only when it is a power of 2)."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, of
    which c are correct, is correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_index(predictions: list[str | None]) -> int | None:
    """The index of the first sample that gave the most common answer (None votes for nothing;
    ties go to the answer that appeared first); None when no sample has an answer."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, pred in enumerate(predictions):
        if pred is None or not str(pred).strip():
            continue
        key = normalise(str(pred))
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None
    best = max(counts.values())
    return min(first[key] for key, count in counts.items() if count == best)


def maj_at_k(predictions: list[str | None], correct: list[bool], k: int) -> float:
    """1.0 when the majority answer of the first k samples was judged correct, else 0.0."""
    winner = majority_index(predictions[:k])
    return float(winner is not None and correct[winner])


def per_problem_scores(problems: list[dict], n: int) -> dict[str, list[float]]:
    """{metric: [score of each problem]} for pass@k (k in ks_for(n)) and maj@k (k >= 2), from
    rows with the `predictions` and `correct` of n samples each."""
    scores: dict[str, list[float]] = {}
    for k in ks_for(n):
        scores[f"pass@{k}"] = [pass_at_k(n, sum(map(bool, p["correct"])), k) for p in problems]
    for k in ks_for(n)[1:]:
        scores[f"maj@{k}"] = [maj_at_k(p["predictions"], p["correct"], k) for p in problems]
    return scores


def bootstrap_stderr(values: list[float], resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> float:
    """The standard deviation of the mean of `values` over `resamples` resamplings with
    replacement (0.0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    data = torch.tensor(values, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(values), (resamples, len(values)), generator=gen)
    return float(data[picks].mean(dim=1).std())


def aggregate(problems: list[dict], n: int, resamples: int = RESAMPLES) -> dict[str, dict[str, float]]:
    """{"scores": {metric: mean over problems}, "stderr": {metric: bootstrap standard error}}."""
    scores = per_problem_scores(problems, n)
    means = {m: sum(v) / len(v) if v else 0.0 for m, v in scores.items()}
    stderr = {m: bootstrap_stderr(v, resamples) for m, v in scores.items()}
    return {"scores": means, "stderr": stderr}
