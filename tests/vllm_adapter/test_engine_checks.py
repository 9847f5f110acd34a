"""The start-up checks on a config alone (no engine, no model load): each refusal docs/serving.md
lists, in one line, and what the adapter turns off."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter's tests run in .venv-vllm: make test-vllm")

from transformers import LlamaConfig  # noqa: E402

from reasonkv.methods.knobs import KnobError  # noqa: E402
from reasonkv.serving.vllm import runtime  # noqa: E402

SNAPKV = {"method": "snapkv", "budget": 64}


class Model(SimpleNamespace):
    def get_sliding_window(self):
        return self.sliding_window


def config(
    settings=SNAPKV,
    *,
    tp=1,
    pp=1,
    cache_dtype="auto",
    speculative=None,
    kv_transfer=None,
    offloading=None,
    max_len=1024,
    eager=True,
    async_scheduling=False,
    **model,
):
    """A VllmConfig's attributes the checks read: a tiny Llama of 4 query heads over 2 KV heads."""
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    kinds = {"runner_type": "generate", "use_mla": False, "is_hybrid": False, "is_attention_free": False,
             "sliding_window": None, "uses_mrope": False, "is_multimodal_model": False, **model}  # fmt: skip
    return SimpleNamespace(
        additional_config={"reasonkv": settings},
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        cache_config=SimpleNamespace(
            cache_dtype=cache_dtype, enable_prefix_caching=True, kv_offloading_size=offloading
        ),
        speculative_config=speculative,
        kv_transfer_config=kv_transfer,
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        model_config=Model(hf_config=hf, max_model_len=max_len, enforce_eager=eager, **kinds),
    )


@pytest.fixture(autouse=True)
def keep_excepthook(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # a refusal installs its own


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"tp": 2}, "runs one worker: set tensor_parallel_size=1"),
        ({"pp": 2}, "runs one worker"),
        ({"cache_dtype": "fp8_inc"}, "not 'fp8_inc'"),
        ({"speculative": object()}, "does not run with speculative decoding"),
        ({"kv_transfer": object()}, "does not run with a KV connector"),
        ({"offloading": 4.0}, "does not run with KV offloading (kv_offloading_size)"),
        ({"eager": False}, "runs the model eagerly: set enforce_eager=True"),
        ({"async_scheduling": True}, "does not run with async scheduling"),
        ({"sliding_window": 512}, "sliding-window layers"),
        ({"use_mla": True}, "multi-head latent attention"),
        ({"is_hybrid": True}, "layers of other kinds"),
        ({"uses_mrope": True}, "multimodal"),
        ({"runner_type": "pooling"}, "runner 'pooling'"),
        ({"settings": {"method": "snapkv", "budget": 1024}}, "budget 1024 never evicts"),
        ({"settings": {"method": "beaconkv", "budget": 64, "beacon_max": 1025}}, "counts tokens"),
        ({"settings": {"method": "pyramidkv", "budget": 64}}, "gives each layer its own budget"),
    ],
)
def test_each_refusal_is_one_line_before_the_model_loads(changes, words) -> None:
    with pytest.raises(KnobError) as refused:
        runtime.check_engine(config(**changes))
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_an_uncaught_refusal_prints_one_line(capsys) -> None:
    """Where nothing catches it, the process ends printing the reason only; other errors keep
    their traceback."""
    with pytest.raises(KnobError) as refused:
        runtime.check_engine(config(tp=2))
    wrapped = ValueError(f"1 validation error for VllmConfig\n  Value error, {refused.value}")
    sys.excepthook(ValueError, wrapped, None)
    assert capsys.readouterr().err == f"reasonkv: {refused.value}\n"
    sys.excepthook(RuntimeError, RuntimeError("something else"), None)
    assert "something else" in capsys.readouterr().err


def test_prefix_caching_stays_on_and_a_good_config_passes() -> None:
    """check_engine leaves prefix caching on (it once turned it off for the whole engine): the
    scheduler shares only the blocks a compressed request never rewrites (test_prefix_caching.py
    runs it)."""
    good = config()
    runtime.check_engine(good)
    assert good.cache_config.enable_prefix_caching is True
