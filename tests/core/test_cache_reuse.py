"""A cache serves one sequence. A second generate() call may continue it (given the whole
sequence so far, it feeds only the tokens past the cache's length), and that equals one long
generate; a cache handed another sequence says so, instead of failing on an empty reshape or
running the new prompt's tail on the old context."""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import PAD, TEST_DEVICE, left_pad, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg

GREEDY = {"do_sample": False}


def _generate(model, ids, cache, n: int, mask=None):
    return model.generate(input_ids=ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=n, **GREEDY)


@pytest.mark.parametrize(
    "method,budget,knobs",
    [("full", None, {}), ("snapkv", 16, {"interval": 8}), ("h2o", 16, {}), ("beaconkv", 24, {})],
)
def test_a_second_generate_continues_the_sequence_exactly(
    method: str, budget: int | None, knobs: dict
) -> None:
    """20 tokens then 30 more in a second call = 50 in one call (evictions on the way included).
    generate() reads a generated pad id as padding when handed the sequence back (positions
    shift, with any cache), so the prompt is one whose first 20 tokens contain none."""
    model = tiny_model("llama", "sdpa", 2)
    prompt = random_prompt(12, seed=6)
    whole = _generate(model, prompt, reasonkv.make_cache(model, method, budget, **knobs), 50)

    cache = reasonkv.make_cache(model, method, budget, **knobs)
    first = _generate(model, prompt, cache, 20)
    assert bool((first != PAD).all())
    second = _generate(model, first, cache, 30)
    assert torch.equal(second, whole)
    if budget is not None:
        assert cache.n_compressions > 0  # it evicted between and across the calls


def test_a_padded_batch_continues_with_its_mask() -> None:
    model = tiny_model("llama", "sdpa", 2)
    ids, mask = left_pad([random_prompt(14, seed=1)[0], random_prompt(9, seed=2)[0]])
    whole = _generate(model, ids, reasonkv.make_cache(model, "snapkv", 16, interval=8), 40, mask)

    cache = reasonkv.make_cache(model, "snapkv", 16, interval=8)
    first = _generate(model, ids, cache, 15, mask)
    mask2 = torch.cat([mask, mask.new_ones(2, first.shape[1] - ids.shape[1])], dim=1)
    second = _generate(model, first, cache, 25, mask2)
    assert torch.equal(second, whole)


@pytest.mark.parametrize("length", [5, 15, 31, 32])
def test_a_new_prompt_on_a_used_cache_is_refused_clearly(length: int) -> None:
    """After 32 tokens (a 12-token prompt and 20 generated), a new prompt no longer than that:
    nothing to feed (5), its own tail at the wrong positions (15, 31), or all of it again (32)."""
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(model, "snapkv", 16)
    _generate(model, random_prompt(12, seed=5), cache, 21)  # the last token is never fed: 32 held
    assert cache.get_seq_length() == 32
    with pytest.raises(
        ValueError, match=r"holds 32 tokens of another sequence.*make_cache.*cache\.reset\(\)"
    ):
        _generate(model, random_prompt(length, seed=9), cache, 5)


@pytest.mark.parametrize("length", [33, 40, 64])
def test_a_longer_new_prompt_on_a_used_cache_is_refused_by_its_tokens(length: int) -> None:
    """Longer than the 32 held tokens, a new prompt's tail would sit at the right positions:
    only its token ids tell it apart from a continuation."""
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(model, "snapkv", 16)
    first = _generate(model, random_prompt(12, seed=5), cache, 21)
    with pytest.raises(
        ValueError, match="holds 32 tokens of another sequence.*does not begin with the tokens"
    ):
        _generate(model, random_prompt(length, seed=9), cache, 5)
    # The same cache, reset, serves it; and a true continuation of `first` still passes the check.
    cache.reset()
    _generate(model, random_prompt(length, seed=9), cache, 3)
    again = reasonkv.make_cache(model, "snapkv", 16)
    first = _generate(model, random_prompt(12, seed=5), again, 21)
    longer = torch.cat([first, random_prompt(length - first.shape[1] + 1, seed=3)], dim=1)
    assert _generate(model, longer, again, 2).shape[1] == longer.shape[1] + 2


@pytest.mark.parametrize("length", [3, 8, 16])
def test_a_new_padded_batch_on_a_used_cache_is_refused_by_its_mask(length: int) -> None:
    model = tiny_model("llama", "sdpa", 2)
    ids, mask = left_pad([random_prompt(14, seed=1)[0], random_prompt(9, seed=2)[0]])
    cache = reasonkv.make_cache(model, "h2o", 16)
    _generate(model, ids, cache, 3, mask)  # 16 held
    new_ids, new_mask = left_pad([random_prompt(length, seed=3)[0], random_prompt(length - 2, seed=4)[0]])
    with pytest.raises(ValueError, match="holds 16 tokens of another sequence"):
        _generate(model, new_ids, cache, 4, new_mask)


def test_another_batch_size_is_refused_as_another_sequence() -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(model, "snapkv", 16)
    _generate(model, random_prompt(10, seed=1), cache, 4)
    with pytest.raises(ValueError, match="holds 13 tokens of another sequence.*batch of 1, given 2"):
        _generate(model, random_prompt(20, seed=2, batch=2), cache, 4)


def test_after_reset_the_cache_serves_a_new_prompt_like_a_fresh_one() -> None:
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(model, "h2o", 16)
    _generate(model, random_prompt(30, seed=1), cache, 30)
    cache.reset()
    prompt = random_prompt(8, seed=2)
    fresh = reasonkv.make_cache(model, "h2o", 16)
    assert torch.equal(_generate(model, prompt, cache, 30), _generate(model, prompt, fresh, 30))
    assert cache.n_compressions == fresh.n_compressions
    assert [e.lengths.tolist() for e in cache.events] == [e.lengths.tolist() for e in fresh.events]


def test_a_multi_token_forward_at_wrong_positions_is_refused() -> None:
    """Outside generate(): a chunk whose explicit positions restart is another sequence too."""
    model = tiny_model("llama", "sdpa", 2)
    cache = reasonkv.make_cache(model, "snapkv", 16)
    with torch.no_grad():
        model(input_ids=random_prompt(10, seed=1), **cache_arg(cache))
        model(
            input_ids=random_prompt(4, seed=2),
            **cache_arg(cache),
            position_ids=torch.arange(10, 14, device=TEST_DEVICE)[None],
        )
        with pytest.raises(ValueError, match="holds 14 tokens of another sequence"):
            model(
                input_ids=random_prompt(4, seed=3),
                **cache_arg(cache),
                position_ids=torch.arange(4, device=TEST_DEVICE)[None],
            )


def test_generate_from_embeddings_still_works_after_make_cache() -> None:
    """The reuse guard wraps prepare_inputs_for_generation; transformers reads its signature to
    decide whether inputs_embeds are supported, so the wrapper must keep it."""
    model = tiny_model("llama", "sdpa", 2)
    embeds = model.get_input_embeddings()(random_prompt(8, seed=0))
    before = model.generate(inputs_embeds=embeds, max_new_tokens=4, **GREEDY)
    cache = reasonkv.make_cache(model, "full", None)
    assert torch.equal(model.generate(inputs_embeds=embeds, max_new_tokens=4, **GREEDY), before)
    assert torch.equal(
        model.generate(inputs_embeds=embeds, **cache_arg(cache), max_new_tokens=4, **GREEDY), before
    )
