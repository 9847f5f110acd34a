"""Devices and dtypes: what load_model accepts, and where a cache puts its tensors.

A cache for a bfloat16 model stores K/V in bfloat16 and makes every other tensor on the
model's device; what it accumulates (scores, entropies, distances) stays float32. The device
half is trivially true on a CPU-only machine and binds on CUDA (parametrized when present).
"""

from __future__ import annotations

import pytest
import torch

import reasonkv
from conftest import build_tiny_model, random_prompt
from method_helpers import profile_knobs, tiny_group
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.models import resolve_device, resolve_dtype

METHODS = sorted(reasonkv.available_methods())
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_auto_device_and_dtype_follow_the_machine() -> None:
    cuda = torch.cuda.is_available()
    assert resolve_device("auto").type == ("cuda" if cuda else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype(None, torch.device("mps")) == torch.float32


@pytest.mark.parametrize(
    "name,dtype",
    [("float32", torch.float32), ("bf16", torch.bfloat16), ("Float16", torch.float16), (torch.bfloat16,) * 2],
)
def test_explicit_dtypes(name, dtype) -> None:
    assert resolve_dtype(name, "cpu") is dtype


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu", "cpu:0", ""])
def test_a_bad_device_is_one_line(device) -> None:
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda, cuda:N or mps") as err:
        resolve_device(device)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_says_so(device) -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device(device)


@pytest.mark.parametrize("dtype", ["int8", "float64", "half-ish", torch.float64])
def test_a_bad_dtype_is_one_line(dtype) -> None:
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype(dtype, "cpu")


def test_load_model_checks_device_and_dtype_before_loading() -> None:
    # A missing model would be a FileNotFoundError: the ValueError shows the check came first.
    with pytest.raises(ValueError, match="dtype must be"):
        reasonkv.load_model("/nonexistent/model.gguf", dtype="int8")
    with pytest.raises(ValueError, match="device must be"):
        reasonkv.load_model("/nonexistent/model.gguf", device="tpu")


def _bf16_model(device: str):
    return build_tiny_model("llama", "sdpa", kv_heads=2).to(device=device, dtype=torch.bfloat16)


def _cache_tensors(cache) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the cache holds, named: storage, window, counters, policy states, budgets."""
    out = []
    for i, layer in enumerate(cache.layers):
        out += [(f"layer {i} tensor {j}", t) for j, t in enumerate(layer.tensors())]
        out += [(f"layer {i} {name}", getattr(layer, name)) for name in ("budgets", "targets")]
        out += [(f"layer {i} storage.{n}", getattr(layer.storage, n)) for n in ("lengths", "n_valid")]
        out += [(f"layer {i} prompt_end", layer.window.prompt_end)]
        for kind in ("scorer", "schedule", "head_allocator"):
            state = getattr(layer.states, kind)
            if state is not None:
                out += [
                    (f"layer {i} {kind}.{k}", v)
                    for k, v in vars(state).items()
                    if isinstance(v, torch.Tensor)
                ]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_a_bf16_cache_keeps_every_tensor_on_the_model_device(method: str, device: str) -> None:
    model = _bf16_model(device)
    spec = reasonkv.get_method(method)
    knobs = {"interval": 16} if "interval" in spec.knobs() else {}
    budget = 24 if spec.compresses else None
    cache = reasonkv.make_cache(
        model, method, budget, **knobs, **profile_knobs(model, method), **tiny_group(model, method)
    )
    prompt = random_prompt(12, seed=5).to(device)
    with torch.no_grad():
        model.generate(
            input_ids=prompt,
            **cache_arg(cache),
            max_new_tokens=64,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    if spec.compresses:
        assert cache.n_compressions > 0, "the run should compress"
    where = torch.device(device)
    for name, tensor in _cache_tensors(cache):
        assert tensor.device.type == where.type, f"{method}: {name} is on {tensor.device}"
        if tensor.is_floating_point() and tensor.dtype not in (torch.bfloat16, torch.float32):
            pytest.fail(f"{method}: {name} is {tensor.dtype}")
    for layer in cache.layers:
        storage = layer.storage
        kv = [getattr(storage, n) for n in ("keys", "values", "k_res", "v_res") if hasattr(storage, n)]
        for t in kv:
            if t is not None and t.is_floating_point():
                assert t.dtype == torch.bfloat16, f"{method}: K/V stored as {t.dtype}"
        for name, t in storage.token_state.items():  # accumulated scores stay float32
            assert t.dtype == torch.float32, f"{method}: {name} is {t.dtype}"
    assert cache.layers[0].window.queries.dtype == torch.bfloat16
