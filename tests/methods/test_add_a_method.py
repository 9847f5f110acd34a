"""docs/architecture.md shows how to add a method in one file; this runs that very code, so
the page cannot drift from the contract: the method registers, builds a cache, and keeps
exactly the keys with the smallest norms (plus its protected sinks and recent tokens)."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from conftest import greedy_loop, random_prompt, tiny_model
from reasonkv import available_methods, make_cache
from reasonkv.core.policy.base import EMPTY
from reasonkv.methods.registry import METHODS

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


@pytest.fixture
def knorm_module():
    blocks = re.findall(r"```python\n(# my_knorm\.py\n.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/architecture.md should hold one my_knorm.py example"
    module = types.ModuleType("my_knorm")
    exec(compile(blocks[0], str(DOC), "exec"), module.__dict__)
    yield module
    METHODS.pop("knorm", None)


def test_the_documented_method_registers_and_keeps_the_smallest_keys(knorm_module) -> None:
    assert "knorm" in available_methods()
    model = tiny_model("llama", "sdpa", 2)
    cache = make_cache(model, "knorm", budget=20, interval=4)  # 12 protected, 8 chosen
    layer = cache.layers[1]
    checked = []
    select = layer.step.select  # the step's selection, applied by the layer's storage

    def compress_and_check(keep: torch.Tensor, scores: torch.Tensor) -> None:
        index, norms = layer.token_index[0].clone(), layer.keys[0, :, : layer.used].norm(dim=-1)
        select(keep, scores)
        for h in range(index.shape[0]):
            real = (index[h] != EMPTY).nonzero().flatten().tolist()
            protected = real[:4] + real[-8:]  # n_sink = 4, n_recent = 8
            rest = sorted((s for s in real if s not in protected), key=lambda s: (float(norms[h, s]), -s))
            expected = sorted(int(index[h, s]) for s in protected + rest[: int(keep[0, h]) - len(protected)])
            kept = sorted(int(i) for i in layer.token_index[0, h] if i != EMPTY)
            assert kept == expected
            checked.append(h)

    layer.step.select = compress_and_check
    greedy_loop(model, random_prompt(10, seed=5), cache, 40)
    assert len(checked) >= 4, "budget 20 + interval 4 over 50 tokens must compress more than once"


def test_the_documented_scorer_ranks_by_negative_key_norm(knorm_module) -> None:
    keys = torch.tensor([[[[3.0, 4.0], [0.0, 1.0], [6.0, 8.0]]]])  # norms 5, 1, 10
    scores = knorm_module.KNormScorer().score(None, keys, keys)
    assert scores.argsort(dim=-1, descending=True).tolist() == [[[1, 0, 2]]]
