"""The default model (SmolLM2-135M, dequantised from its GGUF, fp32) in vLLM with the adapter
on: its kept tokens and greedy outputs equal the HF path's, as for the tiny random model."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="no vLLM here: the adapter's tests run in .venv-vllm (make test-vllm)")

from vllm_helpers import assert_same_kept, run_engine, run_hf  # noqa: E402

TEXT = [
    "Why is the sum of two odd numbers always even? Think step by step.",
    "A train leaves at 3 pm and travels 120 km at 80 km/h. When does it arrive? Explain your reasoning.",
]


@pytest.fixture(scope="module")
def default_model_dir(tmp_path_factory) -> str:
    """The bundled model as `reasonkv serve` exports it on first use, in this (vLLM's) venv, into
    a cache folder of the test's own (--dry-run: the export, then the command, no server)."""
    cache = tmp_path_factory.mktemp("reasonkv-cache")
    reasonkv = Path(sys.executable).parent / "reasonkv"
    env = {**os.environ, "REASONKV_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [str(reasonkv), "serve", "--dry-run"], capture_output=True, text=True, timeout=600, env=env
    )
    if proc.returncode != 0:
        raise AssertionError(f"reasonkv serve --dry-run failed:\n{proc.stderr[-3000:]}")
    folder = cache / "vllm-models" / "smollm2-135m-float32"
    command = shlex.split(proc.stdout.strip().splitlines()[-1])
    assert command[command.index("--model") + 1] == str(folder)
    assert sorted(p.name for p in folder.iterdir() if p.name.endswith((".json", ".safetensors"))) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]  # fmt: skip
    return str(folder)


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
