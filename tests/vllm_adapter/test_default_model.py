"""The default model (SmolLM2-135M, dequantised from its GGUF, fp32) in vLLM with the adapter
on: its kept tokens and greedy outputs equal the HF path's, as for the tiny random model."""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("vllm", reason="no vLLM here: the adapter's tests run in .venv-vllm (make test-vllm)")

from vllm_helpers import ROOT, assert_same_kept, hf_python, run_engine, run_hf  # noqa: E402

TEXT = [
    "Why is the sum of two odd numbers always even? Think step by step.",
    "A train leaves at 3 pm and travels 120 km at 80 km/h. When does it arrive? Explain your reasoning.",
]


@pytest.fixture(scope="module")
def default_model_dir(tmp_path_factory) -> str:
    python = hf_python()
    if python is None:
        pytest.skip("exporting the default model needs the main venv (make venv; or set REASONKV_HF_PYTHON)")
    out = tmp_path_factory.mktemp("smollm2")
    script = ROOT / "scripts" / "export_for_vllm.py"
    proc = subprocess.run([str(python), str(script), str(out)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"export failed:\n{proc.stderr[-3000:]}")
    return str(out)


@pytest.mark.parametrize(
    ("method", "budget", "knobs"), [("snapkv", 64, {"interval": 32}), ("beaconkv", 64, {})]
)
def test_default_model_keeps_what_the_hf_path_keeps(
    default_model_dir, tmp_path, method, budget, knobs
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in TEXT]  # fmt: skip
    prompts = [
        list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts
    ]
    spec = {"model": default_model_dir, "prompts": prompts, "max_tokens": 96, "dtype": "float32"}
    engine = run_engine({**spec, "reasonkv": {"method": method, "budget": budget, **knobs}}, tmp_path, method)
    hf = run_hf({**spec, "method": method, "budget": budget, "knobs": knobs}, tmp_path, method)
    assert engine["tokens"] == hf["tokens"]
    # Each request compressed in all 30 layers before any near-tie.
    assert_same_kept(engine, hf, [len(p) for p in prompts], min_events=30)
