"""`reasonkv sweep` / `reasonkv report`: grid expansion and stable keys, the append-only
results file (resume after a crash mid-unit or kill -9: nothing lost, nothing repeated,
same numbers), failing units, sharding over workers (in-process and Ray), the report."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import typer

from cli_helpers import CharTokenizer, errors_of, runner, tiny_llama
from reasonkv.cli import sweep as sweep_cli
from reasonkv.harness import replay as replay_mod
from reasonkv.harness import sweep as sw
from reasonkv.harness.report import (
    load_records,
    markdown_table,
    rich_table,
    summarize_results,
    unit_peak_16bit,
)
from reasonkv.methods.knobs import BudgetError

HERE = Path(__file__).resolve().parent  # this module: the sweep loader below
TESTS = HERE.parent  # the tests folder: conftest and the helper modules
TEST_PATH = os.pathsep.join([str(HERE), str(TESTS)])
LOADER = "test_sweep:tiny_loader"
LOADS: list[str] = []
"""Models tiny_loader loaded in this process."""
DTYPES: list[torch.dtype] = []
"""The dtype of each model tiny_loader loaded in this process."""


def tiny_loader(name: str, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32, **kwargs):
    """The sweep's model loader in these tests: a tiny random Llama (in `dtype`, on the device
    the sweep asks for: the CPU unless its grid names another)
    and a char tokenizer, importable by Ray workers and subprocesses. 'broken' fails to load.
    A forward hook slows every forward when REASONKV_TEST_DELAY is set (so a kill lands
    mid-sweep)."""
    LOADS.append(name)
    DTYPES.append(dtype)
    if name == "broken":
        raise FileNotFoundError("no model called 'broken'")
    model = tiny_llama(attn_implementation).to(device=kwargs.get("device", "cpu"), dtype=dtype)
    delay = float(os.environ.get("REASONKV_TEST_DELAY", "0"))
    if delay:
        model.register_forward_pre_hook(lambda *args: time.sleep(delay))
    return model, CharTokenizer()


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """The sweep sets torch threads per worker: keep this process at conftest's one."""
    monkeypatch.setenv("REASONKV_THREADS", "1")
    LOADS.clear()
    DTYPES.clear()
    yield
    torch.set_num_threads(1)


TRACES = [
    ("t1", "What is 2+3?", "Add them: 2+3=5. So five. " * 3),
    ("t2", "Is 7 prime?", "Check 2 and 3: no divisor, prime. " * 3),
    ("t3", "Half of 18?", "18/2 = 9, nine it is. " * 3),
]


def write_traces(path: Path, rows=TRACES) -> Path:
    lines = [json.dumps({"id": i, "variant": "well_posed", "problem": p, "trace": t}) for i, p, t in rows]
    lines.append(json.dumps({"id": "mp", "variant": "missing_premise", "problem": "x?", "trace": "?" * 40}))
    path.write_text("\n".join(lines) + "\n")
    return path


def replay_grid(tmp_path: Path, **over) -> dict:
    write_traces(tmp_path / "traces.jsonl")
    grid = {
        "kind": "replay",
        "models": ["tiny"],
        "methods": ["full", "snapkv", "streaming"],
        "budgets": [16, 24],
        "settings": {"max_tokens": 80, "bin": 32, "loader": LOADER},
        "knobs": {"interval": 8},
        "datasets": [{"traces": "traces.jsonl"}],
    }
    grid.update(over)
    return grid


def grid_of(tmp_path: Path, **over) -> sw.Grid:
    return sw.parse_grid(replay_grid(tmp_path, **over), tmp_path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The default grid run once, uninterrupted (keys do not depend on where the traces lie)."""
    folder = tmp_path_factory.mktemp("reference")
    sw.run_sweep(grid_of(folder), folder / "ref.jsonl", threads=1)
    return folder / "ref.jsonl"


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def metrics_by_key(path: Path) -> dict[str, dict]:
    return {r["key"]: r["metrics"] for r in lines_of(path) if r["status"] == "ok"}


# ------------------------------------------------------------------------ grid
def test_grid_expands_models_traces_methods_budgets_once_each(tmp_path) -> None:
    grid = grid_of(tmp_path, models=["tiny", "tiny-b"], budgets=[16, 24, 16])
    units = sw.expand(grid)
    # 2 models × 3 well-posed traces × (full once + 2 methods × 2 budgets); budget 16 listed twice.
    assert len(units) == 2 * 3 * 5 == len({u.key for u in units})
    first = [(u.config["item"], u.config["method"], u.config["budget"]) for u in units[:5]]
    assert first == [("t1", "full", None), ("t1", "snapkv", 16), ("t1", "snapkv", 24)] + [
        ("t1", "streaming", 16),
        ("t1", "streaming", 24),
    ]
    by_method = {u.config["method"]: u.config["knobs"] for u in units}
    # interval goes to snapkv only; `full` keeps no knobs (nothing to compress).
    assert by_method == {"full": {}, "snapkv": {"interval": 8}, "streaming": {}}
    assert all(u.config["max_tokens"] == 80 and u.config["bin"] == 32 for u in units)
    # One replay pass per (model, trace): 6 tasks of 5 units, grouped by model.
    tasks = sw.make_tasks(units)
    assert [len(t.units) for t in tasks] == [5] * 6
    assert [t.model for t in tasks] == ["tiny"] * 3 + ["tiny-b"] * 3
    # share_reference = false: every unit is its own task.
    own = sw.expand(grid_of(tmp_path, settings={"max_tokens": 80, "share_reference": False}))
    assert len(sw.make_tasks(own)) == len(own) == 15


def test_unit_keys_are_stable_and_track_what_changes_the_numbers(tmp_path) -> None:
    config = {"kind": "replay", "model": "m", "method": "snapkv", "budget": 64, "knobs": {"interval": 32}}
    # Pinned: a change to the key scheme would silently rerun every existing sweep.
    assert sw.unit_key(config) == sw.unit_key(dict(reversed(config.items())))
    assert sw.unit_key(config) == "633127f734cb72f0b641"

    keys = lambda **over: {u.key for u in sw.expand(grid_of(tmp_path, **over))}  # noqa: E731
    base = keys()
    assert keys(methods=["streaming", "snapkv", "full"], budgets=[24, 16]) == base  # order is no matter
    smaller = keys(datasets=[{"traces": "traces.jsonl", "limit": 2}])
    assert smaller < base and len(smaller) == 10  # selecting fewer items keeps their keys
    assert keys(knobs={"interval": 4}) & base == {  # only snapkv's units change
        u.key for u in sw.expand(grid_of(tmp_path)) if u.config["method"] != "snapkv"
    }
    assert not keys(settings={"max_tokens": 70, "bin": 32, "loader": LOADER}) & base
    # An edited trace is a new unit, though its id is the same.
    edited = [(i, p, t + ("!" if i == "t2" else "")) for i, p, t in TRACES]
    write_traces(tmp_path / "edited.jsonl", edited)
    changed = {
        u.key
        for u in sw.expand(
            sw.parse_grid(
                {**replay_grid(tmp_path), "datasets": [{"traces": "edited.jsonl", "name": "traces"}]},
                tmp_path,
            )
        )
    }
    assert len(base - changed) == 5


def test_a_two_tier_unit_records_its_tier_width_so_a_changed_default_changes_its_key(tmp_path) -> None:
    """low_bits defaulted to 2 once and to 4 now: a unit run under either must have its own key."""

    def snapkv_units(**knobs):
        return [u for u in sw.expand(grid_of(tmp_path, knobs=knobs)) if u.config["method"] == "snapkv"]

    implicit, explicit = snapkv_units(low_budget=8), snapkv_units(low_budget=8, low_bits=4)
    assert implicit and all(u.config["knobs"]["low_bits"] == 4 for u in implicit)
    assert [u.key for u in implicit] == [u.key for u in explicit]
    assert not {u.key for u in implicit} & {u.key for u in snapkv_units(low_budget=8, low_bits=2)}
    assert all("low_bits" not in u.config["knobs"] for u in snapkv_units())  # no tier: keys as before


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"kind": "bench"}, "`kind` must be one of"),
        ({"budget": [1]}, "unknown grid key"),
        ({"methods": ["snapkv", "nosuch"]}, "unknown method 'nosuch'"),
        ({"knobs": {"intervall": 8}}, "unknown parameter(s) intervall"),
        ({"knobs": {"interval": "8"}}, "expects an integer"),
        ({"knobs": {"h2o": {"window": 2}}}, "not one of the grid's methods"),
        ({"seeds": [0, 1]}, "replay is deterministic"),
        ({"budgets": [16, -1]}, "positive"),
        ({"budgets": [2, 4]}, "'snapkv' runs at none of the grid's budgets: budget 2 is below the protected"),
        ({"knobs": {"snapkv": {"beacon_max": 8}}}, "unknown parameter(s) beacon_max for method 'snapkv'"),
        ({"knobs": {"snapkv": {"window": 0}}}, "parameter 'window' of 'snapkv' must be"),
        ({"datasets": [{"trace": "x"}]}, "needs `traces`"),
        ({"settings": {"max_tokens": 1}}, "at least 2"),
        ({"settings": {"samples": 2}}, "unknown key(s) samples"),
        ({"settings": {"dtype": "bf17"}}, "[settings]: dtype must be auto, float32, bfloat16 or float16"),
        ({"datasets": [{"traces": "x", "device": "gpu"}]}, "datasets[0]: device must be auto, cpu"),
    ],
)
def test_bad_grids_are_one_clear_error(tmp_path, over, message) -> None:
    with pytest.raises(sw.GridError, match=re.escape(message)):
        grid_of(tmp_path, **over)


def test_a_grid_needs_budgets_only_where_a_method_compresses(tmp_path) -> None:
    data = replay_grid(tmp_path, methods=["full"], knobs={})
    del data["budgets"]
    grid = sw.parse_grid(data, tmp_path)
    assert list(grid.runs) == [("full", None)] and grid.knobs == {"full": {}}
    data["methods"] = ["full", "snapkv"]
    with pytest.raises(sw.GridError, match=re.escape("the grid needs `budgets`: 'snapkv' compresses")):
        sw.parse_grid(data, tmp_path)


def test_a_grid_resolves_each_run_once_and_keeps_a_budget_its_method_refuses(tmp_path) -> None:
    grid = grid_of(tmp_path, budgets=[4, 16])
    assert list(grid.runs) == [
        ("full", None),
        ("snapkv", 4),
        ("snapkv", 16),
        ("streaming", 4),
        ("streaming", 16),
    ]
    refused = grid.runs[("snapkv", 4)]
    assert isinstance(refused, BudgetError) and "below the protected window" in str(refused)
    ran = grid.runs[("snapkv", 16)]
    assert ran.budget == 16 and dict(ran.knobs) == grid.knobs["snapkv"] == {"interval": 8}
    units = sw.expand(grid)
    assert all(u.resolved is grid.runs[(u.config["method"], u.config["budget"])] for u in units)


def test_toml_and_yaml_grids_read_alike(tmp_path) -> None:
    write_traces(tmp_path / "traces.jsonl")
    (tmp_path / "g.toml").write_text(
        'kind = "replay"\nmodels = ["tiny"]\nmethods = ["full", "snapkv"]\nbudgets = [16]\n'
        "[settings]\nmax_tokens = 80\n[knobs]\ninterval = 8\n[knobs.snapkv]\nwindow = 4\n"
        '[[datasets]]\ntraces = "traces.jsonl"\n'
    )
    yaml = pytest.importorskip("yaml")
    data = {
        "kind": "replay",
        "models": ["tiny"],
        "methods": ["full", "snapkv"],
        "budgets": [16],
        "settings": {"max_tokens": 80},
        "knobs": {"interval": 8, "snapkv": {"window": 4}},
        "datasets": [{"traces": "traces.jsonl"}],
    }
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(data))
    toml, yml = sw.load_grid(tmp_path / "g.toml"), sw.load_grid(tmp_path / "g.yaml")
    assert toml.knobs["snapkv"] == {"interval": 8, "window": 4}
    assert [u.key for u in sw.expand(toml)] == [u.key for u in sw.expand(yml)]


def test_example_grid_is_valid() -> None:
    grid = sw.load_grid(TESTS.parent / "examples" / "sweep-replay.toml")
    assert grid.kind == "replay" and grid.knobs["rkv"]["interval"] == 32
    assert grid.datasets[0].settings["max_tokens"] == 256


# ---------------------------------------------------------------- run + resume
def test_sweep_writes_one_line_per_unit_and_a_rerun_does_nothing(tmp_path) -> None:
    grid, out = grid_of(tmp_path), tmp_path / "res.jsonl"
    stats = sw.run_sweep(grid, out)
    assert (stats.total, stats.skipped, stats.ok, stats.failed) == (15, 0, 15, 0)
    lines = lines_of(out)
    assert sorted(r["key"] for r in lines) == sorted(u.key for u in sw.expand(grid))
    r = next(x for x in lines if x["config"]["method"] == "full")
    assert r["metrics"]["mean_kl"] == 0.0 and r["metrics"]["top1"] == 1.0  # full against itself
    assert set(r["versions"]) == {"reasonkv", "torch", "transformers", "python"}
    assert r["versions"]["torch"] == torch.__version__
    assert "commit" in (r["git"] or {"commit": None})
    assert {"seconds", "task_seconds", "load_seconds"} <= set(r["timings"])
    snap = next(x for x in lines if x["config"]["method"] == "snapkv")
    assert snap["metrics"]["compressions"] > 0 and snap["metrics"]["mean_kl"] > 0
    # fp32 and unquantized: every K/V value counts 2 bytes at 16 bits instead of 4.
    for key in ("peak_kv_bytes", "decode_peak_kv_bytes", "mean_kv_bytes"):
        assert snap["metrics"][f"{key}_16bit"] == snap["metrics"][key] / 2 > 0
    # ...and everything it holds beside (indices, query window) is recorded too, more than its K/V.
    for key in ("peak", "decode_peak"):
        assert snap["metrics"][f"{key}_state_bytes"] > snap["metrics"][f"{key}_kv_bytes"]
        assert snap["metrics"][f"{key}_state_bytes_16bit"] > snap["metrics"][f"{key}_kv_bytes_16bit"]
    assert LOADS == ["tiny"]  # one model load for the whole sweep

    before = out.read_bytes()
    again = sw.run_sweep(grid, out)
    assert (again.skipped, again.ok) == (15, 0) and out.read_bytes() == before


def test_resume_after_a_crash_mid_unit_loses_and_repeats_nothing(tmp_path, monkeypatch, reference) -> None:
    grid = grid_of(tmp_path)

    # Crash: the second trace's replay pass dies (Ctrl-C) halfway through, and the process
    # dies mid-write of a line (kill -9 during os.write leaves a partial tail).
    out = tmp_path / "res.jsonl"
    real = replay_mod.replay_batch
    calls = []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(replay_mod, "replay_batch", crashing)
    with pytest.raises(KeyboardInterrupt):
        sw.run_sweep(grid, out)
    monkeypatch.setattr(replay_mod, "replay_batch", real)
    done_before = out.read_bytes()
    assert len(lines_of(out)) == 5  # the first trace's units only
    with out.open("ab") as f:
        f.write(b'{"key": "half-written line, no newli')

    stats = sw.run_sweep(grid, out)
    assert (stats.skipped, stats.ok) == (5, 10)
    assert out.read_bytes().startswith(done_before)  # finished lines untouched, the tail cut
    keys = [r["key"] for r in lines_of(out)]
    assert len(keys) == len(set(keys)) == 15
    assert metrics_by_key(out) == metrics_by_key(reference)


def test_resume_of_a_half_written_trace_runs_only_its_missing_methods(tmp_path, reference) -> None:
    grid = grid_of(tmp_path)
    out = tmp_path / "res.jsonl"
    lines = reference.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:7]))  # trace 1 whole, 2 of trace 2's 5 lines
    stats = sw.run_sweep(grid, out)
    assert (stats.skipped, stats.ok) == (7, 8)
    assert metrics_by_key(out) == metrics_by_key(reference)  # a method's numbers: same without the others


def test_kill_9_mid_sweep_then_resume(tmp_path) -> None:
    """A real kill -9 of a sweep process, then a resume here: every unit exactly once."""
    grid_path = tmp_path / "g.toml"
    write_traces(tmp_path / "traces.jsonl")
    grid_path.write_text(
        f'kind = "replay"\nmodels = ["tiny"]\nmethods = ["full", "snapkv", "streaming"]\nbudgets = [16, 24]\n'
        f'[settings]\nmax_tokens = 80\nbin = 32\nloader = "{LOADER}"\n[knobs]\ninterval = 8\n'
        '[[datasets]]\ntraces = "traces.jsonl"\n'
    )
    out = tmp_path / "res.jsonl"
    code = (
        "import sys\nfrom reasonkv.harness import sweep as s\n"
        "s.run_sweep(s.load_grid(sys.argv[1]), sys.argv[2])"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([TEST_PATH, os.environ.get("PYTHONPATH", "")]),
        "REASONKV_TEST_DELAY": "0.01",
    }
    proc = subprocess.Popen([sys.executable, "-c", code, str(grid_path), str(out)], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 5:  # the first trace is in
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the sweep ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    before = out.read_bytes()
    written = before.count(b"\n")
    assert 5 <= written < 15
    stats = sw.run_sweep(sw.load_grid(grid_path), out)
    assert stats.skipped == written and stats.ok == 15 - written
    assert out.read_bytes().startswith(before[: before.rfind(b"\n") + 1])
    keys = [r["key"] for r in lines_of(out)]
    assert len(keys) == len(set(keys)) == 15
    assert {r["status"] for r in lines_of(out)} == {"ok"}


def test_a_second_sweep_on_the_same_file_is_refused(tmp_path) -> None:
    with sw.ResultsLog(tmp_path / "r.jsonl"):
        with pytest.raises(sw.GridError, match="in use by another sweep"):
            sw.ResultsLog(tmp_path / "r.jsonl")
    sw.ResultsLog(tmp_path / "r.jsonl").close()  # released on close


# -------------------------------------------------------------------- failures
def test_failing_units_are_recorded_and_the_rest_finish(tmp_path) -> None:
    # budget 4 is below snapkv's protected window (8 recent tokens); 'broken' cannot load.
    grid = grid_of(tmp_path, models=["broken", "tiny"], budgets=[4, 16], methods=["full", "snapkv"])
    out = tmp_path / "res.jsonl"
    stats = sw.run_sweep(grid, out)
    lines = lines_of(out)
    assert stats.total == len(lines) == 2 * 3 * 3
    failed = [r for r in lines if r["status"] == "error"]
    assert stats.failed == len(failed) == 9 + 3  # all of broken's, and snapkv@8 of tiny
    assert {r["phase"] for r in failed if r["config"]["model"] == "broken"} == {"load"}
    small = [r for r in failed if r["config"]["model"] == "tiny"]
    assert {(r["config"]["method"], r["config"]["budget"]) for r in small} == {("snapkv", 4)}
    assert "below the protected window" in small[0]["error"] and "Traceback" in small[0]["traceback"]
    assert "in check_protected_window" in small[0]["traceback"]  # where the grid's load refused it
    ok = [r for r in lines if r["status"] == "ok"]
    assert {(r["config"]["method"], r["config"]["budget"]) for r in ok} == {("full", None), ("snapkv", 16)}

    # Errors count as done; --retry-errors runs them again (they fail again: new lines).
    assert sw.run_sweep(grid, out).ok + sw.run_sweep(grid, out).failed == 0
    again = sw.run_sweep(grid, out, retry_errors=True)
    assert (again.skipped, again.failed) == (6, 12)


def test_a_method_that_breaks_the_shared_pass_fails_alone(tmp_path, monkeypatch, reference) -> None:
    real = replay_mod.replay_batch

    def streaming_breaks(model, inputs, runs, **kwargs):
        if any(r.method == "streaming" for r in runs):
            raise RuntimeError("streaming broke mid-trace")
        return real(model, inputs, runs, **kwargs)

    monkeypatch.setattr(replay_mod, "replay_batch", streaming_breaks)
    out = tmp_path / "res.jsonl"
    stats = sw.run_sweep(grid_of(tmp_path), out)
    assert (stats.ok, stats.failed) == (9, 6)
    failed = {r["config"]["method"] for r in lines_of(out) if r["status"] == "error"}
    assert failed == {"streaming"}
    ok = metrics_by_key(out)
    assert ok == {k: v for k, v in metrics_by_key(reference).items() if k in ok}


class FlakyPool(sw.SerialPool):
    """A pool whose worker dies on the second task (as a Ray actor killed for memory)."""

    def __init__(self) -> None:
        super().__init__(2)
        self.replaced = []

    def result(self, handle):
        records = super().result(handle)
        if handle == 2:
            raise RuntimeError("worker died")
        return records

    def replace(self, worker: int) -> None:
        self.replaced.append(worker)
        super().replace(worker)


def test_a_dead_worker_fails_its_task_only_and_is_replaced(tmp_path) -> None:
    grid, out = grid_of(tmp_path), tmp_path / "res.jsonl"
    pool = FlakyPool()
    stats = sw.run_sweep(grid, out, pool=pool)
    assert (stats.ok, stats.failed) == (10, 5) and pool.replaced == [1]
    failed = [r for r in lines_of(out) if r["status"] == "error"]
    assert {r["phase"] for r in failed} == {"worker"} and "worker died" in failed[0]["error"]
    assert len({r["config"]["item"] for r in failed}) == 1


# -------------------------------------------------------------------- sharding
def test_two_workers_in_process_give_the_results_of_one(tmp_path) -> None:
    grid = grid_of(tmp_path, models=["tiny", "tiny-b"], datasets=[{"traces": "traces.jsonl", "limit": 2}])
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    sw.run_sweep(grid, one)
    LOADS.clear()
    pool = sw.SerialPool(2)
    sw.run_sweep(grid, two, pool=pool)
    assert metrics_by_key(two) == metrics_by_key(one) and len(metrics_by_key(one)) == 20
    assert sorted(LOADS) == ["tiny", "tiny-b"]  # one model per worker, each loaded once
    workers = {(r["config"]["model"], r["worker"]["pid"]) for r in lines_of(two)}
    assert len(workers) == 2


def test_dispatch_keeps_workers_on_their_model() -> None:
    """Tasks of 2 models over 2 workers: each worker takes one model and keeps it."""

    def task(model: str) -> sw.Task:
        return sw.Task("replay", model, "sdpa", None, [])

    class Recorder:
        size = 2

        def __init__(self) -> None:
            self.log, self.n, self.queue = [], 0, {}

        def submit(self, worker, t):
            self.n += 1
            self.queue[self.n] = (worker, t)
            return self.n

        def wait(self, handles):
            h = min(handles)
            self.log.append((self.queue[h][0], self.queue[h][1].model))
            return [h]

        def result(self, handle):
            return []

        def replace(self, worker):
            pass

    pool = Recorder()
    sw.dispatch([task("a"), task("a"), task("a"), task("b"), task("b"), task("b")], pool, lambda t, r: None)
    assert sorted(pool.log) == [(0, "a")] * 3 + [(1, "b")] * 3


def test_ray_two_workers_give_the_results_of_one(tmp_path) -> None:
    """Two Ray workers (a local ray.init) give the results of one, each unit in a worker
    process. In a child process with a deadline, so that a Ray that cannot start fails
    this test instead of hanging the suite."""
    pytest.importorskip("ray")
    code = (
        "import sys\nfrom pathlib import Path\nimport test_sweep as t\n"
        "from reasonkv.harness import sweep as sw\n"
        "tmp = Path(sys.argv[1])\ngrid = t.grid_of(tmp, models=['tiny', 'tiny-b'])\n"
        "sw.run_sweep(grid, tmp / 'one.jsonl', threads=1)\n"
        "stats = sw.run_sweep(grid, tmp / 'two.jsonl', workers=2, threads=1)\n"
        "print('STATS', stats.ok, stats.failed)\n"
    )
    # Ray's local workers inherit the driver's environment: they can import this module.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TEST_PATH, os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the Ray sweep did not finish in 600 s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STATS 30 0" in proc.stdout
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert metrics_by_key(two) == metrics_by_key(one)
    pids = {r["worker"]["pid"] for r in lines_of(two)}
    assert len(pids) == 2 and {r["worker"]["pid"] for r in lines_of(one)}.isdisjoint(pids)


# ------------------------------------------------------------------------ eval
def test_eval_sweep_units_per_problem_and_seed_repeat_exactly(tmp_path) -> None:
    rows = [{"id": f"p{i}", "problem": f"what is {i}+{i}?", "answer": str(2 * i)} for i in range(2)]
    (tmp_path / "probs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {
        "kind": "eval",
        "models": ["tiny"],
        "methods": ["full", "streaming"],
        "budgets": [16],
        "seeds": [0, 1],
        "settings": {"greedy": False, "samples": 2, "max_new_tokens": 6, "loader": LOADER},
        "datasets": [{"dataset": "probs.jsonl", "name": "probs"}],
    }
    grid = sw.parse_grid(data, tmp_path)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    stats = sw.run_sweep(grid, a)
    assert (stats.total, stats.ok) == (2 * 2 * 2, 8)
    lines = lines_of(a)
    assert all(r["metrics"]["lengths"] == [6, 6] and r["metrics"]["truncated"] == [True, True] for r in lines)
    assert all(r["metrics"]["samples"] == 2 and len(r["metrics"]["outputs"]) == 2 for r in lines)
    streaming = [r["metrics"]["compressions"] for r in lines if r["config"]["method"] == "streaming"]
    full = [r["metrics"]["compressions"] for r in lines if r["config"]["method"] == "full"]
    assert all(c == [0, 0] for c in full) and all(min(c) > 0 for c in streaming)  # budget 16 < prompt
    sw.run_sweep(grid, b)
    outputs = lambda p: {r["key"]: r["metrics"]["outputs"] for r in lines_of(p)}  # noqa: E731
    assert outputs(a) == outputs(b)  # sampled, yet each unit repeats exactly
    seeds = {(r["config"]["item"], r["config"]["seed"]): r["metrics"]["sampling_seed"] for r in lines}
    assert len(set(seeds.values())) == 4  # one sampling seed per (problem, seed)

    sections = summarize_results(load_records([a])[0])
    assert [(r["label"], r["problems"], r["samples"], r["seeds"]) for r in sections[0].rows] == [
        ("full", 2, 8, 2),
        ("streaming@16", 2, 8, 2),
    ]
    assert sections[0].rows[0]["mean_length"] == 6.0 and sections[0].rows[0]["truncation_rate"] == 1.0


def test_eval_grids_decode_greedily_unless_told_to_sample(tmp_path) -> None:
    (tmp_path / "probs.jsonl").write_text(json.dumps({"id": "p0", "problem": "1+1?", "answer": "2"}) + "\n")
    base = {"kind": "eval", "models": ["tiny"], "methods": ["full"], "datasets": [{"dataset": "probs.jsonl"}]}
    assert sw.parse_grid(base, tmp_path).datasets[0].settings["greedy"] is True  # as `reasonkv eval`
    for over in ({"settings": {"samples": 2}}, {"seeds": [0, 1]}):
        with pytest.raises(sw.GridError, match="greedy = false"):
            sw.parse_grid({**base, **over}, tmp_path)
    sampled = sw.parse_grid({**base, "seeds": [0, 1], "settings": {"greedy": False, "samples": 2}}, tmp_path)
    assert sampled.datasets[0].settings["samples"] == 2


# ----------------------------------------------------------------------- report
def replay_line(key, method, budget, item, sums, status="ok", live=10.0, peak=None, **config) -> dict:
    """A sweep record; `peak` = (peak K/V bytes, peak live tokens while decoding), absent in older records."""
    cfg = {
        "kind": "replay",
        "model": "m",
        "dataset": "d",
        "item": item,
        "method": method,
        "budget": budget,
        "knobs": {},
        **config,
    }
    if status != "ok":
        return {"key": key, "status": "error", "config": cfg, "error": "ValueError: boom"}
    n, kl, top1, nll_full, nll = sums
    sums_d = {"n": n, "kl": kl, "top1": top1, "nll_full": nll_full, "nll": nll}
    return {
        "key": key,
        "status": "ok",
        "config": cfg,
        "metrics": {
            "sums": sums_d,
            "live_tokens": live,
            **({} if peak is None else {"decode_peak_kv_bytes": peak[0], "decode_peak_live_tokens": peak[1]}),
        },
        "timings": {"seconds": 1.0},
    }


def test_report_pools_positions_over_traces(tmp_path) -> None:
    lines = [
        replay_line("a", "full", None, "t1", (100, 0.0, 100, 150.0, 150.0), live=60.0),
        replay_line("b", "full", None, "t2", (300, 0.0, 300, 420.0, 420.0), live=80.0),
        replay_line("c", "snapkv", 64, "t1", (100, 10.0, 90, 150.0, 160.0), live=20.0, peak=(2 * 2**20, 70)),
        replay_line("d", "snapkv", 64, "t2", (300, 50.0, 240, 420.0, 440.0), live=40.0, peak=(4 * 2**20, 90)),
        replay_line("e", "snapkv", 128, "t1", (100, 2.0, 98, 150.0, 151.0)),
        replay_line("f", "snapkv", 128, "t2", None, status="error"),
        replay_line("g", "rkv", 64, "t1", None, status="error"),
        replay_line("g", "rkv", 64, "t1", (100, 4.0, 95, 150.0, 152.0)),  # a retry that worked
        replay_line("g", "rkv", 64, "t1", (100, 9.0, 0, 150.0, 152.0)),  # a duplicate ok: the first counts
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"key": "cut')
    records, bad = load_records([path])
    assert bad == 1 and len(records) == 7
    (section,) = summarize_results(records)
    rows = {r["label"]: r for r in section.rows}
    assert list(rows) == ["full", "snapkv@64", "snapkv@128", "rkv@64"]
    snap = rows["snapkv@64"]
    assert (snap["traces"], snap["positions"], snap["errors"]) == (2, 400, 0)
    assert snap["mean_kl"] == pytest.approx(60 / 400) and snap["top1"] == pytest.approx(330 / 400)
    assert snap["ppl_ratio"] == pytest.approx(math.exp(30 / 400))
    assert snap["live_tokens"] == pytest.approx((20 * 100 + 40 * 300) / 400)
    # Peaks are per sequence: the mean over the traces, and unknown for records without them.
    assert (snap["peak_kv_bytes"], snap["peak_live_tokens"]) == (3 * 2**20, 80)
    assert rows["snapkv@128"]["peak_kv_bytes"] is None
    assert rows["full"]["ppl_ratio"] == 1.0 and rows["full"]["top1"] == 1.0
    assert (rows["snapkv@128"]["units"], rows["snapkv@128"]["errors"], rows["snapkv@128"]["traces"]) == (
        2,
        1,
        1,
    )
    assert rows["rkv@64"]["mean_kl"] == pytest.approx(0.04) and rows["rkv@64"]["errors"] == 0

    md = markdown_table(section).splitlines()
    assert md[0] == (
        "| method | budget | traces | tokens | mean KL | top-1 | ppl ratio | peak K/V | peak @16-bit "
        "| peak live | live/head "
        "| errors |"
    )
    # fp32 records from before the 16-bit count: unquantized, so exactly half at 16 bits.
    assert md[3] == "| snapkv | 64 | 2 | 400 | 0.1500 | 0.825 | 1.078 | 3.0 MiB | 1.5 MiB | 80 | 35 |  |"
    assert md[4] == "| snapkv | 128 | 1 | 100 | 0.0200 | 0.980 | 1.010 | - | - | - | 10 | 1 |"

    result = runner.invoke(
        app(), ["report", str(path), "--out", str(tmp_path / "rep")], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, errors_of(result)
    assert "0.1500" in result.output and "0.825" in result.output and "1.078" in result.output
    assert "1 unreadable line" in result.output
    assert (tmp_path / "rep" / "fidelity.png").stat().st_size > 1000
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "| snapkv | 64 | 2 | 400 | 0.1500 | 0.825 | 1.078 | 3.0 MiB | 1.5 MiB | 80 | 35 |  |" in text
    assert "(fidelity.png)" in text


def test_peak_at_16_bits_is_recorded_or_derived_only_where_exact() -> None:
    def unit(method, knobs=None, **extra):
        line = replay_line("k", method, 64, "t1", (10, 1.0, 9, 1.0, 2.0), peak=(8 * 2**20, 70))
        line["config"]["knobs"] = knobs or {}
        line["config"].update(extra.pop("config", {}))
        line["metrics"].update(extra)
        return line

    assert unit_peak_16bit(unit("snapkv")) == 4 * 2**20  # fp32 on the CPU, unquantized: half
    assert unit_peak_16bit(unit("snapkv", decode_peak_kv_bytes_16bit=123.0)) == 123.0  # as recorded
    # Quantized storage or another dtype: half would be wrong, so nothing is derived.
    assert unit_peak_16bit(unit("snapkv", {"kv_bits": 4})) is None
    assert unit_peak_16bit(unit("snapkv", {"low_budget": 32})) is None
    assert unit_peak_16bit(unit("quant-int4")) is None
    assert unit_peak_16bit(unit("snapkv", config={"dtype": "bfloat16"})) is None
    assert unit_peak_16bit(unit("no-such-method")) is None


def test_report_labels_a_method_run_with_two_knob_settings(tmp_path) -> None:
    lines = [
        replay_line("a", "snapkv", 64, "t1", (10, 1.0, 9, 1.0, 2.0), knobs={"interval": 8}),
        replay_line("b", "snapkv", 64, "t1", (10, 2.0, 8, 1.0, 3.0), knobs={"interval": 32}),
    ]
    for line, knobs in zip(lines, ({"interval": 8}, {"interval": 32}), strict=True):
        line["config"]["knobs"] = knobs
    (section,) = summarize_results(lines)
    assert [r["label"] for r in section.rows] == ["snapkv[interval=8]@64", "snapkv[interval=32]@64"]


def test_report_table_never_cuts_a_number_in_a_narrow_terminal() -> None:
    """At 80 columns a long method name folds; the numbers stay whole and no column of
    empty error cells takes room."""
    from rich.console import Console

    lines = [
        replay_line(f"k{b}", "reasonalloc-layer-rkv", b, "t1", (1000, 123.456, 800, 600.0, 700.0))
        for b in (64, 128, 256, 512)
    ]
    (section,) = summarize_results(lines)
    console = Console(width=80, record=True)
    console.print(rich_table(section, width=80))
    text = console.export_text()
    assert "…" not in text and "errors" not in text
    assert text.count("0.1235") == 4  # mean KL 123.456 / 1000, in full on every row
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "left out at 80 columns" in text  # the least needed columns go, and it says which
    wide = Console(width=200, record=True)
    wide.print(rich_table(section, width=200))
    wide_text = wide.export_text()
    assert "left out" not in wide_text and "ppl ratio" in wide_text


# -------------------------------------------------------------------------- CLI
def app() -> typer.Typer:
    app = typer.Typer()
    app.command("sweep")(sweep_cli.sweep_command)
    app.command("report")(sweep_cli.report_command)
    return app


def test_sweep_and_report_commands_end_to_end(tmp_path, monkeypatch) -> None:
    # The default loader (reasonkv's load_model) replaced, as the other CLI tests do.
    monkeypatch.setattr(sw.pool, "load_model", tiny_loader)  # the worker looks it up there
    write_traces(tmp_path / "traces.jsonl")
    grid_path = tmp_path / "grid.toml"
    grid_path.write_text(
        'kind = "replay"\nmodels = ["tiny"]\nmethods = ["full", "snapkv", "streaming"]\nbudgets = [4, 16]\n'
        "[settings]\nmax_tokens = 80\nbin = 32\n[knobs]\ninterval = 8\n"
        '[[datasets]]\ntraces = "traces.jsonl"\nlimit = 2\n'
    )
    out = tmp_path / "res" / "sweep.jsonl"
    env = {"COLUMNS": "200"}
    dry = runner.invoke(app(), ["sweep", str(grid_path), "--out", str(out), "--dry-run"], env=env)
    assert dry.exit_code == 0 and "10 units, 0 done" in dry.output and "10 to run in 2 tasks" in dry.output
    assert not out.exists()

    result = runner.invoke(app(), ["sweep", str(grid_path), "--out", str(out)], env=env)
    # snapkv@4 and streaming@4 are below the protected window: recorded, exit 1, the rest done.
    assert result.exit_code == sweep_cli.FAILED_UNITS, errors_of(result)
    assert "10 units: 0 already done, 6 run now, 4 failed" in result.output
    assert "below the protected window" in result.output
    assert len(lines_of(out)) == 10 and LOADS == ["tiny"]
    # Not on a terminal: a plain line per finished unit, failures included.
    logged = errors_of(result)
    assert logged.count(": KL ") == 6 and logged.count(": failed: ") == 4
    assert "started" in logged and "(100%)" in logged

    with out.open("ab") as f:  # a write cut short by kill -9
        f.write(b'{"key": "abc", "sta')
    again = runner.invoke(app(), ["sweep", str(grid_path), "--out", str(out)], env=env)
    assert again.exit_code == 0 and "10 already done, 0 run now" in again.output
    assert "a partial last line (19 bytes) removed" in errors_of(again) + again.output
    assert out.read_bytes().endswith(b"}\n") and len(lines_of(out)) == 10

    report = runner.invoke(app(), ["report", str(out)], env=env)
    assert report.exit_code == 0, errors_of(report)
    assert "snapkv" in report.output and (tmp_path / "res" / "sweep-report" / "fidelity.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sweep", "nope.toml"], "no grid file"),
        (["sweep", "GRID", "--workers", "0"], "--workers must be at least 1"),
        (["report", "nope.jsonl"], "no results file"),
    ],
)
def test_command_errors_are_one_line(tmp_path, args, message) -> None:
    grid_path = tmp_path / "g.toml"
    grid_path.write_text('kind = "replay"\n')
    args = [str(grid_path) if a == "GRID" else a for a in args]
    result = runner.invoke(app(), args, env={"COLUMNS": "200"})
    assert result.exit_code == 2 and message in errors_of(result)
    assert "Traceback" not in errors_of(result)


def test_batch_traces_runs_one_task_per_method_with_the_same_units_and_numbers(tmp_path, reference) -> None:
    """batch_traces = true: one task per method replays every trace as one batch. The units
    (keys) are those of the default grouping, and each unit's numbers equal its replay alone
    up to float rounding; an interrupted batched sweep resumes without loss or repeats."""
    settings = {"max_tokens": 80, "bin": 32, "loader": LOADER, "batch_traces": True}
    grid = grid_of(tmp_path, settings=settings)
    units = sw.expand(grid)
    assert {u.key for u in units} == {u.key for u in sw.expand(grid_of(tmp_path))}
    tasks = sw.make_tasks(units)
    assert [(t.units[0].config["method"], len(t.units)) for t in tasks] == [
        ("full", 3),
        ("snapkv", 6),
        ("streaming", 6),
    ]
    out = tmp_path / "batched.jsonl"
    done = []

    def stop_after_two_tasks(records: list[dict]) -> None:
        done.append(len(records))
        if len(done) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sw.run_sweep(grid, out, threads=1, on_records=stop_after_two_tasks)
    assert len(lines_of(out)) == 9
    stats = sw.run_sweep(grid, out, threads=1)
    assert (stats.skipped, stats.ok) == (9, 6)
    got, want = metrics_by_key(out), metrics_by_key(reference)
    assert got.keys() == want.keys()
    for key, m in got.items():
        assert m["positions"] == want[key]["positions"]
        assert m["compressions"] == want[key]["compressions"]
        for name in ("mean_kl", "top1", "ppl_ratio"):
            assert m[name] == pytest.approx(want[key][name], rel=1e-4, abs=1e-5), name
    assert all(r["timings"]["task_traces"] == 3 for r in lines_of(out))
    # "every-step": streaming (every step) batched across traces, the others one task per trace.
    mixed = sw.make_tasks(sw.expand(grid_of(tmp_path, settings={**settings, "batch_traces": "every-step"})))
    shapes = sorted((sorted({u.config["method"] for u in t.units}), len(t.units)) for t in mixed)
    assert shapes == [(["full", "snapkv"], 3)] * 3 + [(["streaming"], 6)]
    with pytest.raises(sw.GridError, match="batch_traces"):
        grid_of(tmp_path, settings={**settings, "batch_traces": "sometimes"})


def test_batch_traces_never_batches_quantized_storage(tmp_path) -> None:
    """A batch quantizes only where every row has left the full-precision residual, so its
    rows would not be the traces alone: quantized methods and knobs get one task per trace."""
    settings = {"max_tokens": 80, "bin": 32, "loader": LOADER, "batch_traces": True}
    methods = ["quant-int4", "snapkv", "streaming"]
    grid = grid_of(
        tmp_path, methods=methods, settings=settings, knobs={"snapkv": {"kv_bits": 4, "group_size": 8}}
    )
    tasks = sw.make_tasks(sw.expand(grid))
    # The quantized units go trace by trace (beside each other, sharing that trace's reference);
    # streaming, unquantized, still takes every trace in one batch.
    shapes = sorted(
        (sorted({u.config["method"] for u in t.units}), len({u.item["id"] for u in t.units})) for t in tasks
    )
    assert shapes == [(["quant-int4", "snapkv"], 1)] * 3 + [(["streaming"], 3)]


def test_every_loader_gets_the_grid_s_device_and_dtype_default_cpu_float32(monkeypatch) -> None:
    """Never the loader's own "auto": a sweep resumed on a GPU host must not load bf16 under fp32 keys."""
    calls = []

    def load(name, **kwargs):
        calls.append((name, kwargs))
        return tiny_llama().to(kwargs["dtype"]), CharTokenizer()

    monkeypatch.setattr(sw.pool, "load_model", load)
    sw.pool.SweepWorker()._load(sw.Task("replay", "m", "sdpa", None, []))
    assert calls == [("m", {"attn_implementation": "sdpa", "device": "cpu", "dtype": torch.float32})]
    sw.pool.SweepWorker()._load(sw.Task("replay", "m", "sdpa", None, [], dtype="bfloat16"))
    assert calls[1][1]["dtype"] == torch.bfloat16


def test_default_device_and_dtype_leave_unit_keys_as_they_were(tmp_path) -> None:
    """A unit of a grid without device or dtype keeps the key it had before these settings
    existed (written out by hand here); spelled-out defaults are the same units, others new."""
    one = {"datasets": [{"traces": "traces.jsonl", "limit": 1}], "methods": ["snapkv"], "budgets": [16]}
    (unit,) = sw.expand(grid_of(tmp_path, **one))
    _, problem, trace = TRACES[0]
    old = {
        "kind": "replay",
        "model": "tiny",
        "dataset": "traces",
        "item": "t1",
        "input_sha": hashlib.sha256(json.dumps([problem, trace]).encode()).hexdigest()[:16],
        "seed": 0,
        "attn": "sdpa",
        "max_tokens": 80,
        "bin": 32,
        "loader": LOADER,
        "method": "snapkv",
        "budget": 16,
        "knobs": {"interval": 8},
    }
    assert unit.config == old and unit.key == sw.unit_key(old)
    settings = {"max_tokens": 80, "bin": 32, "loader": LOADER}
    (spelled,) = sw.expand(grid_of(tmp_path, **one, settings={**settings, "device": "CPU", "dtype": "fp32"}))
    assert spelled.key == unit.key
    (bf16,) = sw.expand(grid_of(tmp_path, **one, settings={**settings, "dtype": "bf16"}))
    assert bf16.config == {**old, "dtype": "bfloat16"} and bf16.key == sw.unit_key(bf16.config) != unit.key
    assert sw.make_tasks([bf16])[0].model_id != sw.make_tasks([unit])[0].model_id  # never one model for both


def test_a_bfloat16_grid_runs_on_the_cpu_and_every_record_states_device_and_dtype(tmp_path) -> None:
    settings = {"max_tokens": 48, "bin": 32, "loader": LOADER}
    one = {
        "datasets": [{"traces": "traces.jsonl", "limit": 1}],
        "methods": ["full", "snapkv"],
        "budgets": [16],
    }
    for dtype, want in ((None, torch.float32), ("bfloat16", torch.bfloat16)):
        DTYPES.clear()
        grid = grid_of(tmp_path, **one, settings={**settings, **({"dtype": dtype} if dtype else {})})
        out = tmp_path / f"{dtype}.jsonl"
        stats = sw.run_sweep(grid, out, threads=1)
        assert (stats.ok, stats.failed) == (2, 0) and DTYPES == [want]
        records = lines_of(out)
        assert {(r["device"], r["dtype"]) for r in records} == {("cpu", str(want).removeprefix("torch."))}
        assert all(r["config"].get("dtype") == dtype and "device" not in r["config"] for r in records)
        assert all(r["metrics"]["positions"] > 0 for r in records)


def fp32_loader(name: str, attn_implementation: str = "sdpa", **kwargs):
    """A loader that ignores the grid's dtype."""
    return tiny_llama(attn_implementation), CharTokenizer()


def test_a_loader_that_ignores_the_grid_s_dtype_fails_its_units_at_load(tmp_path) -> None:
    settings = {"max_tokens": 48, "loader": "test_sweep:fp32_loader", "dtype": "bfloat16"}
    grid = grid_of(tmp_path, datasets=[{"traces": "traces.jsonl", "limit": 1}], settings=settings)
    out = tmp_path / "out.jsonl"
    stats = sw.run_sweep(grid, out, threads=1)
    assert stats.ok == 0 and stats.failed == 5
    for r in lines_of(out):
        assert r["phase"] == "load" and r["dtype"] == "bfloat16"
        assert (
            "the loader returned a model in float32 on cpu; the grid asks for bfloat16 on cpu" in r["error"]
        )


def test_a_bad_dtype_in_a_grid_file_is_one_line_before_anything_loads(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sw.pool, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    write_traces(tmp_path / "traces.jsonl")
    grid_path = tmp_path / "grid.toml"
    grid_path.write_text(
        'kind = "replay"\nmodels = ["tiny"]\nmethods = ["full"]\n[settings]\ndtype = "float64"\n'
        '[[datasets]]\ntraces = "traces.jsonl"\n'
    )
    result = runner.invoke(app(), ["sweep", str(grid_path), "--out", str(tmp_path / "o.jsonl")])
    message = errors_of(result).strip()
    assert result.exit_code == 2 and "Traceback" not in message
    assert "[settings]: dtype must be auto, float32, bfloat16 or float16, got 'float64'" in message
    assert len(message.splitlines()) == 1 and not (tmp_path / "o.jsonl").exists()


def test_a_workers_thread_count_outlives_load_model_applying_reasonkv_threads(monkeypatch) -> None:
    """load_model applies REASONKV_THREADS; a sweep worker's own count (--threads) must stay."""
    from types import SimpleNamespace

    from reasonkv.harness.sweep.pool import SweepWorker

    monkeypatch.setenv("REASONKV_THREADS", "1")
    before = torch.get_num_threads()
    try:
        worker = SweepWorker(threads=2)
        tiny = (
            "random:qwen3-0.6b:layers=1,hidden=64,intermediate=64,heads=2,kv_heads=1,head_dim=32,vocab=49152"
        )
        task = SimpleNamespace(
            model_id=(tiny,), loader=None, model=tiny, attn="sdpa", device="cpu", dtype="float32"
        )
        worker._load(task)
        assert worker.model is not None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
