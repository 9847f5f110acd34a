"""`reasonkv report` on what `reasonkv eval --out` and `reasonkv replay --out` write, beside a
sweep's JSONL: each file's kind is read from its content and turned into the sweep records the
report summarises, end to end through the real commands on a tiny model."""

from __future__ import annotations

import json

import pytest

from cli_helpers import CharTokenizer, errors_of, runner, tiny_llama
from reasonkv.cli import evaluate as accuracy_cli
from reasonkv.cli import replay as replay_cli
from reasonkv.cli.main import app
from reasonkv.harness.report import load_records, summarize_results
from reasonkv.harness.report_inputs import EVAL, REPLAY, SWEEP, file_kind
from reasonkv.util.records import RecordError

WIDE = {"COLUMNS": "250"}


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setenv("REASONKV_THREADS", "1")
    load = lambda name, **kwargs: (tiny_llama(), CharTokenizer())  # noqa: E731
    monkeypatch.setattr(accuracy_cli, "load_model", load)
    monkeypatch.setattr(replay_cli, "load_model", load)
    monkeypatch.setattr(
        replay_cli, "load_tokenizer_and_config", lambda name: (CharTokenizer(), tiny_llama().config)
    )


def run(args: list[str]):
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 0, errors_of(result)
    return result


def eval_json(tmp_path, name: str, *args: str) -> dict:
    data = tmp_path / "probs.jsonl"
    rows = [{"id": f"p{i}", "problem": f"what is {i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / name
    run(["eval", "--dataset", str(data), "-n", "8", "--out", str(out), *args])
    return json.loads(out.read_text())


def test_report_reads_eval_outputs(tiny, tmp_path) -> None:
    full = eval_json(tmp_path, "full.json", "--method", "full")
    snap = eval_json(
        tmp_path, "snap.json", "--method", "snapkv", "--budget", "16", "--set", "interval=4", "--sample",
        "--samples", "2",
    )  # fmt: skip
    files = [tmp_path / "full.json", tmp_path / "snap.json"]
    assert [file_kind(f)[0] for f in files] == [EVAL, EVAL]

    (section,) = summarize_results(load_records(files)[0])
    assert (section.kind, section.model, section.dataset) == ("eval", "smollm2-135m", "probs")
    rows = {r["label"]: r for r in section.rows}
    assert list(rows) == ["full", "snapkv@16"]  # full has no budget, whatever eval recorded
    for row, result in ((rows["full"], full), (rows["snapkv@16"], snap)):
        assert (row["problems"], row["samples"], row["errors"]) == (3, 3 * result["n_samples"], 0)
        assert row["pass@1"] == pytest.approx(result["pass@1"])
        assert row["mean_length"] == pytest.approx(result["mean_length"])
        assert row["truncation_rate"] == pytest.approx(result["truncation_rate"])
        assert row["tokens_per_second"] == pytest.approx(result["tokens_per_second"])

    report = run(["report", *map(str, files), "--out", str(tmp_path / "rep")])
    assert "no results" not in report.output and "snapkv" in report.output
    assert "| snapkv | 16 | 3 | 6 |" in (tmp_path / "rep" / "report.md").read_text()
    assert (tmp_path / "rep" / "accuracy.png").is_file()

    # A summary written before eval recorded its kind still reads as one.
    old = {k: v for k, v in full.items() if k not in ("kind", "config", "versions", "git")}
    (tmp_path / "old.json").write_text(json.dumps(old, indent=1))
    assert file_kind(tmp_path / "old.json")[0] == EVAL
    assert len(load_records([tmp_path / "old.json", tmp_path / "full.json"])[0]) == 3  # the same units


def test_report_reads_replay_outputs_and_mixes_kinds(tiny, tmp_path) -> None:
    traces = tmp_path / "traces.jsonl"
    rows = [
        {"id": "a", "variant": "well_posed", "problem": "What is 2+3?", "trace": "Add them: 2+3=5. " * 6},
        {"id": "b", "variant": "well_posed", "problem": "Is 7 prime?", "trace": "Check 2, 3: none. " * 5},
    ]
    traces.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "replay.json"
    run(["replay", "--traces", str(traces), "--model", "tiny", "--methods", "full,snapkv", "--budgets", "16"]
        + ["--set", "interval=8", "--max-tokens", "90", "--out", str(out)])  # fmt: skip
    saved = json.loads(out.read_text())
    assert file_kind(out)[0] == REPLAY

    (section,) = summarize_results(load_records([out])[0])
    assert (section.kind, section.model, section.dataset) == ("replay", "tiny", "traces")
    got = {r["label"]: r for r in section.rows}
    for want in saved["summary"]:
        row = got[want["label"]]
        assert (row["traces"], row["positions"]) == (want["traces"], want["positions"])
        assert row["mean_kl"] == pytest.approx(want["mean_kl"], abs=1e-9)
        assert row["top1"] == pytest.approx(want["top1"])
        assert row["ppl_ratio"] == pytest.approx(want["ppl_ratio"])
        assert row["live_tokens"] == pytest.approx(want["live_tokens"])
    assert got["snapkv@16"]["peak_kv_bytes"] is not None

    eval_json(tmp_path, "eval.json", "--method", "full")
    report = run(["report", str(out), str(tmp_path / "eval.json"), "--out", str(tmp_path / "rep")])
    assert "replay fidelity" in report.output and "accuracy" in report.output
    assert {p.name for p in (tmp_path / "rep").iterdir()} == {"report.md", "fidelity.png", "accuracy.png"}


def test_report_refuses_a_json_that_is_no_results_file(tmp_path) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": "world"}, indent=1))
    with pytest.raises(RecordError, match="not a results file"):
        file_kind(other)
    result = runner.invoke(app, ["report", str(other)])
    assert result.exit_code == 2 and "not a results file" in errors_of(result)
    assert len(errors_of(result).strip().splitlines()) == 1
    sweep = tmp_path / "s.jsonl"
    sweep.write_text(json.dumps({"key": "k", "status": "error", "config": {}}) + "\n")
    assert file_kind(sweep) == (SWEEP, None)
