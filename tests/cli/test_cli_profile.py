"""`reasonkv profile`, `reasonkv generate --record` and `reasonkv plot` on a tiny model."""

from __future__ import annotations

import json

from cli_helpers import WIDE, runner
from reasonkv.cli import main as cli
from reasonkv.methods.profiles import config_hash, load_profile


def _traces(path, n: int = 3) -> None:
    rows = [
        {
            "id": f"t{i}",
            "problem": f"What is {i}+{i}?",
            "trace": "Let me think step by step. " * 4,
            "variant": "x",
        }
        for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_profile_writes_a_profile_and_a_wave_plot(tmp_path, fake_loader) -> None:
    traces, out, png = tmp_path / "traces.jsonl", tmp_path / "p.json", tmp_path / "wave.png"
    _traces(traces)
    args = ["profile", "--traces", str(traces), "--out", str(out), "--plot", str(png), "--variant", "all"]
    result = runner.invoke(cli.app, [*args, "--limit", "2", "--stride", "4", "--chunk", "8"], env=WIDE)
    assert result.exit_code == 0, result.output
    profile = json.loads(out.read_text())
    assert profile["traces"] == ["t0", "t1"] and len(profile["per_trace_demand"]) == 2
    assert len(profile["demand"]) == 2 and len(profile["head_entropy"]) == 2  # 2 layers
    assert profile["command"].startswith("reasonkv profile --traces")
    assert png.stat().st_size > 5000
    model, _ = fake_loader_model()
    assert profile["config_hash"] == config_hash(model.config)
    load_profile(out, model.config)  # accepted for the model it was made for


def fake_loader_model():
    from cli_helpers import CharTokenizer, tiny_llama

    return tiny_llama(), CharTokenizer()


def test_profile_errors_are_one_line(tmp_path, fake_loader) -> None:
    traces = tmp_path / "traces.jsonl"
    _traces(traces)
    result = runner.invoke(cli.app, ["profile", "--traces", str(traces), "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "no traces of variant 'well_posed'" in result.output
    missing = runner.invoke(cli.app, ["profile", "--traces", str(tmp_path / "nope.jsonl"), "--out", "x.json"])
    assert missing.exit_code == 2 and "no trace file" in missing.output
    assert fake_loader == []  # nothing was loaded for bad input


def test_generate_record_then_plot_budgets(tmp_path, fake_loader) -> None:
    run, png = tmp_path / "run.json", tmp_path / "budgets.png"
    args = [
        "generate",
        "-m",
        "adakv-snapkv",
        "-b",
        "24",
        "--set",
        "interval=8",
        "-n",
        "40",
        "--record",
        str(run),
    ]
    result = runner.invoke(cli.app, [*args, "hello there"], env=WIDE)
    assert result.exit_code == 0, result.output
    record = json.loads(run.read_text())
    assert record["method"] == "adakv-snapkv" and record["events"]
    assert all(sum(e["lengths"]) == 2 * 24 for e in record["events"])  # layer total kept exactly
    plotted = runner.invoke(cli.app, ["plot", "budgets", str(run), "--out", str(png), "--layers", "0,1"])
    assert plotted.exit_code == 0, plotted.output
    assert png.stat().st_size > 5000
    bad = runner.invoke(cli.app, ["plot", "budgets", str(run), "--out", str(png), "--layers", "7"])
    assert bad.exit_code == 2 and "no compression events for layer(s) [7]" in bad.output


def test_generate_takes_a_profile_file_for_reasonalloc(tmp_path, fake_loader) -> None:
    from cli_helpers import tiny_llama
    from reasonkv.methods.profiles import save_profile

    model = tiny_llama()
    profile = tmp_path / "wave.json"
    save_profile({"model": "tiny", "config_hash": config_hash(model.config), "demand": [3.0, 1.0]}, profile)
    run = tmp_path / "run.json"
    args = ["generate", "-m", "reasonalloc-layer-rkv", "-b", "16", "--set", "interval=8", "-n", "30"]
    result = runner.invoke(cli.app, [*args, "--profile", str(profile), "--record", str(run), "hi"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert json.loads(run.read_text())["budgets"] == [[24, 24], [8, 8]]  # 3:1 of 2 x 16, per head
    wrong = runner.invoke(cli.app, ["generate", "-m", "snapkv", "--profile", str(profile), "hi"])
    assert wrong.exit_code == 2 and "--profile is for profile-driven methods" in wrong.output
    missing = runner.invoke(cli.app, ["generate", "-m", "reasonalloc-rkv", "--profile", "nope.json", "hi"])
    assert missing.exit_code == 2 and "no profile at nope.json" in missing.output
