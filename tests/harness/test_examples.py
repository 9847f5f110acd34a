"""Every example grid runs from a fresh clone: its traces are inside the repository and hold
the ids it asks for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reasonkv.harness.sweep.grid import load_grid

ROOT = Path(__file__).resolve().parents[2]
GRIDS = sorted((ROOT / "examples").rglob("*.toml"))


def test_there_are_example_grids():
    assert len(GRIDS) >= 2


@pytest.mark.parametrize("path", GRIDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_grid_reads_traces_shipped_in_the_repository(path):
    grid = load_grid(path)
    for dataset in grid.datasets:
        source = Path(dataset.source).resolve()
        assert source.is_relative_to(ROOT), f"{path.name} reads {source}, outside the repository"
        assert source.is_file(), f"{path.name}: no file {source}"
        rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
        ids = {r["id"] for r in rows}
        wanted = dataset.settings.get("ids") or []
        assert set(wanted) <= ids, f"{path.name} asks for ids not in {source.name}: {set(wanted) - ids}"
        variant = dataset.settings.get("variant")
        chosen = [r for r in rows if variant is None or r.get("variant") == variant]
        assert len(chosen) >= (dataset.settings.get("limit") or 1)


def test_shipped_traces_keep_their_source_and_licence():
    data = ROOT / "examples" / "data"
    readme = (data / "README.md").read_text()
    assert "MIT License" in readme and "Copyright (c) 2025 Fcr09" in readme
    for name in ("mip-math500-12.jsonl", "mip-math500-report-12.jsonl"):
        for line in (data / name).read_text().splitlines():
            row = json.loads(line)
            assert row["source_repo"] == "MingLiiii/MiP-Overthinking" and row["source_commit"]
            assert row["trace"] and row["problem"]


def test_the_report_set_shares_nothing_with_what_knobs_were_chosen_on():
    """No knob is reported on the traces it was chosen on: the report traces are other traces,
    of other problems, than the tuning set, and none of the Wave profile's; the same mix of
    models, long enough for 2,048 tokens."""
    data = ROOT / "examples" / "data"

    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (data / name).read_text().splitlines() if line.strip()]

    tuning, report = rows("mip-math500-12.jsonl"), rows("mip-math500-report-12.jsonl")
    profile = json.loads((ROOT / "src/reasonkv/profiles/smollm2-135m.json").read_text())["traces"]
    assert len(report) == 12 and len({r["id"] for r in report}) == 12
    assert not {r["id"] for r in report} & ({r["id"] for r in tuning} | set(profile))
    problems = [r["math500_unique_id"] for r in report]
    assert len(set(problems)) == 12 and not set(problems) & {r["math500_unique_id"] for r in tuning}
    assert sorted(r["model"] for r in report) == sorted(r["model"] for r in tuning)
    assert all(r["variant"] == "well_posed" and r["n_chars"] > 9000 for r in report)


@pytest.mark.model
def test_the_smoke_example_grid_runs_from_the_clone(tmp_path):
    """examples/sweep-replay.toml, as the README runs it, on the bundled model: every unit ok."""
    from typer.testing import CliRunner

    from reasonkv.cli.main import app

    out, grid_file = tmp_path / "sweep-replay.jsonl", ROOT / "examples" / "sweep-replay.toml"
    result = CliRunner().invoke(app, ["sweep", str(grid_file), "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    grid = load_grid(grid_file)
    assert len(records) == 2 * (1 + (len(grid.methods) - 1) * len(grid.budgets))
    assert all(r["status"] == "ok" for r in records)
    assert {r["config"]["item"] for r in records} <= {
        json.loads(line)["id"] for line in (ROOT / "examples" / "data" / "mip-math500-12.jsonl").open()
    }
