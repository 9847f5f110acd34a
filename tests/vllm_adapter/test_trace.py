"""`REASONKV_VLLM_TRACE_KINDS`: which events the trace records (a benchmark records steps only)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter's tests run in .venv-vllm: make test-vllm")

from reasonkv.serving.vllm.worker_state import TRACE_KINDS, trace_path, write_trace  # noqa: E402


def test_every_kind_goes_to_the_trace_unless_kinds_are_named(monkeypatch, tmp_path) -> None:
    path = str(tmp_path / "run.trace")
    monkeypatch.delenv("REASONKV_VLLM_TRACE_KINDS", raising=False)
    monkeypatch.delenv("REASONKV_VLLM_TRACE", raising=False)
    assert [trace_path(k) for k in TRACE_KINDS] == [None] * len(TRACE_KINDS)
    monkeypatch.setenv("REASONKV_VLLM_TRACE", path)
    assert [trace_path(k) for k in TRACE_KINDS] == [path] * len(TRACE_KINDS)
    monkeypatch.setenv("REASONKV_VLLM_TRACE_KINDS", "step, preempt")
    assert {k: trace_path(k) for k in TRACE_KINDS} == {
        "kept": None,
        "release": None,
        "step": path,
        "preempt": path,
    }


def test_an_unknown_kind_is_refused_by_name(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("REASONKV_VLLM_TRACE", str(tmp_path / "run.trace"))
    monkeypatch.setenv("REASONKV_VLLM_TRACE_KINDS", "step,steps")
    with pytest.raises(ValueError, match=r"unknown \['steps'\]"):
        trace_path("step")


def test_an_empty_kinds_list_and_an_unknown_event_kind_are_refused(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("REASONKV_VLLM_TRACE", str(tmp_path / "run.trace"))
    monkeypatch.setenv("REASONKV_VLLM_TRACE_KINDS", " , ")
    with pytest.raises(ValueError, match="names no kind"):
        trace_path("step")
    monkeypatch.delenv("REASONKV_VLLM_TRACE_KINDS")
    with pytest.raises(ValueError, match="no trace event of kind 'relase'"):
        trace_path("relase")


def test_write_trace_writes_only_the_named_kinds(monkeypatch, tmp_path) -> None:
    path = tmp_path / "run.trace"
    monkeypatch.setenv("REASONKV_VLLM_TRACE", str(path))
    monkeypatch.setenv("REASONKV_VLLM_TRACE_KINDS", "step,release")
    for kind in TRACE_KINDS:
        write_trace(kind, n=1)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert events == [{"kind": "release", "n": 1}, {"kind": "step", "n": 1}]
