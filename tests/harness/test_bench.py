"""The speed/memory benchmark (reasonkv.harness.bench, `reasonkv bench`): every run is fed exactly the
reference tokens, memory marks are what cache.memory() says, the timing wrappers count what
the cache does (and change nothing), the JSON and the command. No timing assertions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli_helpers import bench_app
from conftest import N_LAYERS, greedy_loop, random_prompt, tiny_model
from reasonkv.core.hf_compat import cache_arg
from reasonkv.harness import bench
from reasonkv.harness.replay import compare_logits
from reasonkv.methods.api import make_cache

runner = CliRunner()
WIDE = {"COLUMNS": "250"}
PROMPT = 10
KNOBS = {"interval": 8}
ROOT = Path(__file__).resolve().parents[2]
TEXT = "What is 2+3? Think."  # 19 characters: the CharTokenizer's prompt tokens


def small_runs(methods=("streaming", "snapkv", "rkv", "beaconkv")) -> list[bench.BenchRun]:
    """Budget 24 (beaconkv protects 4 + 16) with an interval of 8: many compressions in 40 steps."""
    return bench.plan_runs(methods, [24], KNOBS)


class FeedLog:
    """Records every forward's input_ids, by the cache it went to."""

    def __init__(self, model):
        self.calls: dict[int, list[torch.Tensor]] = {}
        self.order: list[int] = []
        self.caches: list[object] = []  # alive, so that no later cache can reuse a freed one's id
        self.handle = model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        key = id(kwargs["cache"])
        if key not in self.calls:
            self.order.append(key)
            self.caches.append(kwargs["cache"])
        self.calls.setdefault(key, []).append(kwargs["input_ids"].clone())

    def fed(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt [1, P], the decode steps' tokens [n]) of one cache; every step is one token."""
        calls = self.calls[key]
        assert all(c.shape == (1, 1) for c in calls[1:])
        return calls[0], torch.cat([c[0] for c in calls[1:]])


# ----------------------------------------------------------------- decoding
@pytest.mark.parametrize("interleave", [False, True])
def test_every_run_is_fed_exactly_the_reference_tokens(interleave: bool) -> None:
    model = tiny_model("llama")
    prompt = random_prompt(PROMPT, 3)
    log = FeedLog(model)
    try:
        record = bench.run_benchmark(model, prompt, small_runs(), [16, 40], window=16, interleave=interleave)
    finally:
        log.handle.remove()
    reference = torch.tensor(record["reference"]["tokens"])
    assert reference.numel() == 40
    # The reference is the full cache's plain greedy continuation (this model has no EOS).
    expected, _ = greedy_loop(model, prompt, make_cache(model, "full", None), 40)
    assert torch.equal(reference, expected[0].cpu())

    assert len(log.order) == 1 + len(record["runs"])  # the reference pass, then one cache per run
    for key in log.order:
        fed_prompt, fed = log.fed(key)
        assert torch.equal(fed_prompt, prompt)
        assert torch.equal(fed.cpu(), reference)  # n forwards of exactly the reference tokens, in order
    labels = [r["label"] for r in record["runs"]]
    assert labels == ["full", "streaming@24", "snapkv@24", "rkv@24", "beaconkv@24"]
    full = record["runs"][0]
    assert full["top1_agreement"] == 1.0  # forcing the full cache reproduces its own greedy choices
    assert all(r["top1_agreement"] < 1.0 for r in record["runs"][1:])  # 24 of 50 tokens: they drift


def test_greedy_reference_suppresses_eos() -> None:
    model = tiny_model("llama")
    prompt = random_prompt(PROMPT, 4)
    free, _ = greedy_loop(model, prompt, make_cache(model, "full", None), 30)
    banned = int(free[0, 5])  # a token the model does choose
    model.generation_config.eos_token_id = banned
    try:
        trace = bench.reference_tokens(model, prompt, 30)
    finally:
        model.generation_config.eos_token_id = None
    assert banned not in trace.tokens.tolist()
    assert torch.equal(trace.tokens[:5], free[0, :5].cpu())  # identical until the banned token


# ------------------------------------------------------------------- memory
def test_marks_report_exactly_what_cache_memory_reports() -> None:
    model = tiny_model("llama")
    prompt = random_prompt(PROMPT, 5)
    tokens = bench.reference_tokens(model, prompt, 45).tokens
    runs = small_runs(("snapkv", "beaconkv"))
    caches = [make_cache(model, r.method, r.budget, **r.knobs) for r in runs]
    lengths = [7, 20, 33, 45]
    results = bench.measure_runs(model, runs, prompt, tokens, lengths, 16, caches=caches, sample_every=5)
    for run, result, cache in zip(runs, results, caches, strict=True):
        assert [m["tokens"] for m in result["marks"]] == lengths
        # A second cache stepped by hand to each mark holds exactly the reported bytes.
        twin = make_cache(model, run.method, run.budget, **run.knobs)
        with torch.no_grad():
            model(input_ids=prompt, **cache_arg(twin))
            for i in range(45):
                model(input_ids=tokens[i : i + 1].view(1, 1).to(prompt.device), **cache_arg(twin))
                if i + 1 in lengths:
                    mem = twin.memory()
                    mark = result["marks"][lengths.index(i + 1)]
                    assert mark["kv_bytes"] == mem["kv_bytes"]
                    assert mark["physical_bytes"] == mem["physical_bytes"]
                    assert mark["seen"] == PROMPT + i + 1
        final = cache.memory()
        assert result["marks"][-1]["kv_bytes"] == final["kv_bytes"]
        # Samples every 5 steps plus the marks, and the cheap byte count agrees with memory().
        assert result["samples"]["tokens"] == sorted({*range(5, 46, 5), *lengths})
        assert result["samples"]["kv_bytes"][-1] == final["kv_bytes"]
        assert result["samples"]["physical_bytes"][-1] == final["physical_bytes"]
        assert result["sampled_peak_kv_bytes"] == max(result["samples"]["kv_bytes"])
        # The meter sees every moment, samples only some: it is never below them, and it is
        # what the cache itself reports.
        assert result["peak_kv_bytes"] == final["peak_kv_bytes"] >= result["sampled_peak_kv_bytes"]


def test_compressing_runs_hold_less_than_full_and_ratios_are_consistent() -> None:
    model = tiny_model("llama")
    record = bench.run_benchmark(model, random_prompt(PROMPT, 6), small_runs(), [24, 48], window=20)
    full = record["runs"][0]
    assert full["ratios"]["kv_bytes"] == [1.0, 1.0] and full["ratios"]["windows"] == [1.0, 1.0, 1.0]
    for r in record["runs"][1:]:
        for mark, ratio, ref in zip(r["marks"], r["ratios"]["kv_bytes"], full["marks"], strict=True):
            assert mark["kv_bytes"] < ref["kv_bytes"]
            assert ratio == pytest.approx(mark["kv_bytes"] / ref["kv_bytes"])
        windows = [(w["start"], w["end"]) for w in r["windows"]]
        assert windows == [(0, 20), (20, 40), (40, 48)]
        assert sum(w["seconds"] for w in r["windows"]) == pytest.approx(r["decode_seconds"])
        assert len(r["step_seconds"]) == 48
    streaming = record["runs"][1]
    assert "overhead_vs_streaming" not in streaming["ratios"]
    snap = record["runs"][2]
    expected = 1 - streaming["decode_seconds"] / snap["decode_seconds"]
    assert snap["ratios"]["overhead_vs_streaming"] == pytest.approx(expected)


# ------------------------------------------------------------------- timers
def test_scoring_wrappers_count_one_call_per_compression_and_change_nothing() -> None:
    model = tiny_model("llama")
    prompt = random_prompt(PROMPT, 7)
    n = 40
    tokens = bench.reference_tokens(model, prompt, n).tokens
    runs = bench.plan_runs(["snapkv", "rkv", "beaconkv", "adakv-snapkv", "streaming"], [24], KNOBS)[1:]
    caches = [make_cache(model, r.method, r.budget, **r.knobs) for r in runs]
    results = bench.measure_runs(model, runs, prompt, tokens, [n], 16, caches=caches)
    for run, result, cache in zip(runs, results, caches, strict=True):
        sections = result["sections"]
        events = len(cache.events)
        assert events > N_LAYERS, run.label  # compressed more than once per layer
        assert result["compressions"] == events
        assert sections["score"]["calls"] == events
        assert sections["compress"]["calls"] == events
        # Each compression either compacts or (every-step schedules, between compactions)
        # leaves holes; streaming at budget 24 compacts every 24 // 8 = 3 steps.
        holes = sections.get("holes", {"calls": 0})["calls"]
        assert sections["compact"]["calls"] + holes == events
        if run.method == "streaming":
            assert holes > 0 and sections["compact"]["calls"] <= events // 3 + N_LAYERS
        else:
            assert holes == 0
        # update / attention / mask: once per layer per forward (the prompt and n steps).
        for name in ("update", "after_attention", "mask"):
            assert sections[name]["calls"] == N_LAYERS * (n + 1), (run.label, name)
        if run.method == "beaconkv":
            assert sections["on_step"]["calls"] == N_LAYERS * (n + 1)
        if run.method == "adakv-snapkv":
            assert sections["split"]["calls"] == events
        scoring = sum(sections[k]["seconds"] for k in bench.SCORING if k in sections)
        assert result["score_seconds"] == pytest.approx(scoring)
        assert result["score_select_seconds"] == pytest.approx(scoring + sections["compress"]["seconds"])
        assert 0 < result["score_select_fraction"] < 1

        # The wrapped cache decodes exactly as an untouched one.
        plain = make_cache(model, run.method, run.budget, **run.knobs)
        trace = bench.decode(model, plain, prompt, n, forced=tokens)
        wrapped_cache = make_cache(model, run.method, run.budget, **run.knobs)
        bench.instrument(wrapped_cache, bench.SectionTimer())
        wrapped = bench.decode(model, wrapped_cache, prompt, n, forced=tokens)
        assert torch.equal(trace.predicted, wrapped.predicted)
        assert [e.lengths.tolist() for e in plain.events] == [
            e.lengths.tolist() for e in wrapped_cache.events
        ]


def test_full_cache_never_scores() -> None:
    model = tiny_model("llama")
    prompt = random_prompt(PROMPT, 8)
    tokens = bench.reference_tokens(model, prompt, 12).tokens
    (result,) = bench.measure_runs(model, [bench.BenchRun("full")], prompt, tokens, [12], 4)
    assert result["compressions"] == 0 and "score" not in result["sections"]
    assert result["score_select_seconds"] == 0.0
    assert result["rss_before"] is not None and result["rss_peak"] >= result["rss_before"]


def test_plan_runs_and_windows() -> None:
    runs = bench.plan_runs(["snapkv", "full", "streaming"], [64, 32, 64], {"interval": 16, "n_recent": 4})
    assert [r.label for r in runs] == ["full", "snapkv@64", "snapkv@32", "streaming@64", "streaming@32"]
    assert runs[1].knobs == {"interval": 16, "n_recent": 4} and runs[3].knobs == {"n_recent": 4}
    assert runs[0].knobs == {"n_recent": 4}  # full takes protection knobs too (it ignores them)
    assert bench.windows_of(10, 4) == [(0, 4), (4, 8), (8, 10)]
    with pytest.raises(ValueError, match="window must be positive"):
        bench.windows_of(10, 0)


# ---------------------------------------------------------------------- CLI
@pytest.fixture
def loader(bench_loader):
    return bench_loader


def test_bench_command_writes_json_tables_and_plots(loader, tmp_path) -> None:
    out, plots = tmp_path / "res" / "bench.json", tmp_path / "plots"
    args = ["bench", "--model", "tiny", "--methods", "snapkv,streaming", "--budgets", "24"]
    args += ["--lengths", "24,12", "--window", "8", "--set", "interval=8", "--out", str(out)]
    args += ["--plot", str(plots), "--profile-at", "8", "--profile-steps", "4", "--prompt", TEXT]
    result = runner.invoke(bench_app(), args, env=WIDE)
    assert result.exit_code == 0, result.output
    auto = {"device": torch.device("cpu"), "dtype": torch.float32}  # --device/--dtype auto, no CUDA
    if torch.cuda.is_available():
        auto = {"device": torch.device("cuda"), "dtype": torch.bfloat16}
    assert loader == [{"name": "tiny", "attn_implementation": "sdpa", **auto}]

    record = json.loads(out.read_text())
    assert record["kind"] == "bench" and record["model"] == "tiny"
    assert record["lengths"] == [12, 24] and record["window"] == 8 and record["interleave"] is False
    assert [r["label"] for r in record["runs"]] == ["full", "snapkv@24", "streaming@24"]
    assert record["runs"][1]["knobs"] == {"interval": 8} and record["runs"][2]["knobs"] == {}
    assert record["prompt_tokens"] == len(TEXT) and len(record["reference"]["tokens"]) == 24
    assert record["command"].startswith("REASONKV_THREADS=1 reasonkv bench --model tiny")
    assert "--set interval=8" in record["command"] and f"--prompt '{TEXT}'" in record["command"]
    machine = record["machine"]
    for key in (
        "cpu",
        "cores",
        "load_average",
        "load_average_after",
        "torch",
        "transformers",
        "torch_threads",
    ):
        assert key in machine
    assert record["threads"] == 1 and machine["torch_threads"] == 1
    for r in record["runs"]:
        assert [m["tokens"] for m in r["marks"]] == [12, 24]
        assert [(w["start"], w["end"]) for w in r["windows"]] == [(0, 8), (8, 16), (16, 24)]
    # Profiles: one per run, 8 tokens in, 4 unprofiled then 4 profiled steps.
    assert [p["label"] for p in record["profiles"]] == ["full", "snapkv@24", "streaming@24"]
    for p in record["profiles"]:
        assert p["seen_tokens"] == len(TEXT) + 8 + 2 * 4
        assert set(bench.PROFILE_GROUPS) <= set(p["groups_seconds_per_step"])
    assert record["profiles"][2]["compressions"] == 4 * N_LAYERS  # streaming compacts every step

    assert (plots / "tokens_per_second.png").stat().st_size > 1000
    assert (plots / "kv_bytes.png").stat().st_size > 1000
    assert "decode speed and memory" in result.stdout and "snapkv" in result.stdout
    assert "one decode step" in result.stdout


def test_bench_command_interleaved(loader, tmp_path) -> None:
    out = tmp_path / "b.json"
    args = ["bench", "--methods", "full,rkv", "--budgets", "24", "--lengths", "16", "--window", "8"]
    args += ["--set", "interval=8", "--interleave", "--out", str(out)]
    result = runner.invoke(bench_app(), args, env=WIDE)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["interleave"] is True and "--interleave" in record["command"]
    assert all(r["rss_peak_delta"] is None for r in record["runs"])  # the process's RSS is shared
    assert record["runs"][0]["top1_agreement"] == 1.0


def test_bench_tables_at_80_columns_keep_names_and_whole_numbers(loader, tmp_path) -> None:
    args = ["bench", "--methods", "full,reasonalloc-head-rkv", "--budgets", "24", "--lengths", "12,24"]
    args += ["--window", "8", "--set", "interval=8", "--out", str(tmp_path / "b.json")]
    result = runner.invoke(bench_app(), args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    out = result.stdout[: result.stdout.rindex(" s wall")]  # the tables; the closing line names a path
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    assert "reasonalloc-" in out and "head-rkv" in out and "tok/s last" in out
    assert "left out at 80 columns" in " ".join(out.split())  # and the caption says which


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "full,nope"], "unknown method 'nope'"),
        (["--budgets", "64,x"], "--budgets takes positive integers"),
        (["--lengths", "0,16"], "--lengths takes positive integers"),
        (["--window", "0"], "--window must be positive"),
        (["--set", "nope=1"], "unknown parameter(s) nope"),
        (["--set", "interval=2.5"], "'interval' of 'snapkv' expects an integer"),
        (["--attn", "flash"], "--attn must be sdpa or eager"),
        (["--profile-at", "10", "--lengths", "64"], "--profile-at 10 needs 266 generated tokens"),
    ],
)
def test_bad_input_is_one_line_before_loading(loader, tmp_path, extra, message) -> None:
    args = ["bench", "--methods", "full,snapkv", "--out", str(tmp_path / "b.json")]
    result = runner.invoke(bench_app(), args + extra, env=WIDE)
    assert result.exit_code == 2, result.output
    err = result.stderr or result.output
    assert message in err and len(err.strip().splitlines()) == 1
    assert loader == [], "the model was loaded although the arguments were invalid"


def test_budget_below_the_protected_window_is_a_clean_error(loader, tmp_path) -> None:
    args = [
        "bench",
        "--methods",
        "beaconkv",
        "--budgets",
        "8",
        "--lengths",
        "8",
        "--out",
        str(tmp_path / "b"),
    ]
    result = runner.invoke(bench_app(), args, env=WIDE)
    assert result.exit_code == 2 and "below the protected window" in (result.stderr or result.output)
    assert not (tmp_path / "b").exists()


# ------------------------------------------------------- kvpress side by side
def kvpress_compare():
    """benchmarks/kvpress_compare.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location(
        "kvpress_compare", ROOT / "benchmarks" / "kvpress_compare.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kvpress_compare_fidelity_matches_the_replay_arithmetic() -> None:
    """The script's own KL/top-1 (both venvs use it) agree with reasonkv.harness.replay's."""
    module = kvpress_compare()
    gen = torch.Generator().manual_seed(0)
    ref, other = torch.randn(6, 50, generator=gen), torch.randn(6, 50, generator=gen)
    ref_logp = torch.log_softmax(ref, -1)
    kl, top1 = module.fidelity(ref_logp, ref.argmax(-1), other)
    expected = compare_logits(ref, other, torch.zeros(6, dtype=torch.long))
    assert torch.allclose(kl, expected["kl"], atol=1e-6)
    assert torch.equal(top1, expected["top1"])


def test_kvpress_compare_dry_run_plans_both_sides(tmp_path, capsys) -> None:
    module = kvpress_compare()
    out = tmp_path / "cmp.json"
    code = module.main(
        ["--dry-run", "--out", str(out), "--venv", str(tmp_path / "venv"), "--ours", "snapkv,rkv"]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "--role reasonkv" in text and "--role kvpress" in text
    assert "kvpress==0.5.5" in text  # the venv it would create, from requirements-kvpress.txt
    assert not out.exists()


def test_ratios_divide_by_the_plain_full_cache_and_baseline_not_their_variants() -> None:
    def result(label: str, budget, tok_s: float, seconds: float) -> dict:
        method = label.split(":")[0].split("@")[0]
        mark = {"tokens": 8, "kv_bytes": 100.0, "physical_bytes": 100.0}
        window = {"tokens_per_second": tok_s, "seconds": seconds}
        return {
            "label": label,
            "method": method,
            "budget": budget,
            "tokens_per_second": tok_s,
            "decode_seconds": seconds,
            "windows": [window],
            "marks": [mark],
            "peak_kv_bytes": 100.0,
            "rss_peak_delta": 1.0,
            "score_select_seconds": 0.0,
        }

    results = [
        result("full:kv_bits=4", None, 5.0, 2.0),
        result("full", None, 10.0, 1.0),
        result("streaming:kv_bits=4@16", 16, 4.0, 2.5),
        result("streaming@16", 16, 20.0, 0.5),
        result("snapkv@16", 16, 16.0, 1.0),
    ]
    bench.add_ratios(results)
    by = {r["label"]: r["ratios"] for r in results}
    assert by["snapkv@16"]["tokens_per_second"] == 1.6  # to the plain full cache's 10 tok/s
    assert by["snapkv@16"]["overhead_vs_streaming"] == pytest.approx(0.5)  # to plain streaming's 0.5 s
