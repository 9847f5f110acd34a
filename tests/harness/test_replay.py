"""Trace-replay fidelity (reasonkv.harness.replay): the chunk plan lands exactly on compression
points, so chunked teacher forcing equals token-by-token decoding; the full cache against
itself is exactly faithful; the KL / NLL / perplexity arithmetic; the `replay` command."""

from __future__ import annotations

import json
import math

import pytest
import torch
import typer
from typer.testing import CliRunner

import reasonkv
from cli_helpers import CharTokenizer, errors_of, tiny_llama
from conftest import N_LAYERS, build_tiny_model, random_prompt, tiny_model
from method_helpers import profile_knobs
from reasonkv.cli import replay as replay_cli
from reasonkv.core.hf_compat import cache_arg
from reasonkv.core.models import resolve_device, resolve_dtype
from reasonkv.harness.replay import (
    ReplayResult,
    ReplayRun,
    chunk_plan,
    compare_logits,
    curve_of,
    metrics,
    reference_logits,
    replay_batch,
    replay_methods,
    replay_trace,
    summarize,
)
from reasonkv.harness.traces import ReplayInput

PROMPT = 10
TRACE = 150  # tokens in all: a 10-token prompt and 139 scored trace positions
KV_HEADS = 2


def run_of(model, method: str) -> ReplayRun:
    """Small budgets and intervals, so every method compresses many times in 150 tokens."""
    settings = {
        "snapkv": (16, {"interval": 8}),
        "rkv": (16, {"interval": 8}),
        "beaconkv": (32, {}),  # threshold: at 32 evict 4, i.e. every 4 tokens
        "rpc": (4, {"interval": 16, "n_recent": 8, "window": 8}),  # keep 4 of every 16
        "reasonalloc-rkv": (16, {"interval": 8}),  # per-layer budgets and a per-head split
        "pyramid-rkv": (16, {"interval": 8}),
        "h2o": (16, {}),  # every step (after the cache first fills)
        "streaming": (16, {}),
        "full": (None, {}),
    }
    budget, knobs = settings[method]
    return ReplayRun(method, budget, {**knobs, **profile_knobs(model, method)})


def trace_ids(seed: int = 5, n: int = TRACE) -> torch.Tensor:
    return random_prompt(n, seed=seed)


# ------------------------------------------------------------- chunked = stepwise
CHUNKED = ["snapkv", "rkv", "beaconkv", "rpc", "reasonalloc-rkv", "pyramid-rkv"]


@pytest.mark.parametrize("method", [*CHUNKED, "h2o", "streaming"])
def test_chunked_replay_equals_token_by_token_replay(method: str) -> None:
    model = tiny_model("llama", "sdpa", KV_HEADS)
    ids, run = trace_ids(), run_of(model, method)
    chunked = replay_methods(model, ids, PROMPT, [run], block=64)[0]
    stepwise = replay_methods(model, ids, PROMPT, [run], block=64, stepwise=True)[0]

    assert chunked.positions == stepwise.positions == TRACE - 1 - PROMPT
    assert stepwise.forwards == chunked.positions  # really one token per forward
    # The same evictions at the same steps (a different eviction would move KL by far more than 1e-5).
    assert chunked.compressions == stepwise.compressions >= 3 * N_LAYERS
    assert torch.equal(chunked.top1, stepwise.top1)
    for name in ("kl", "nll", "nll_full"):
        torch.testing.assert_close(getattr(chunked, name), getattr(stepwise, name), atol=1e-5, rtol=1e-5)
    assert chunked.live_tokens == pytest.approx(stepwise.live_tokens)
    if method in CHUNKED:  # buffer / threshold / periodic schedules really take several tokens per forward
        assert chunked.forwards < chunked.positions // 2


QUANTIZED = {  # storage knobs that quantize within 150 tokens many times (head dim 16)
    "quant-int4": ReplayRun("quant-int4", None, {"group_size": 8, "residual": 8}),
    "snapkv-int4": ReplayRun("snapkv", 16, {"interval": 8, "kv_bits": 4, "group_size": 8, "residual": 8}),
    "beaconkv-int2": ReplayRun("beaconkv", 32, {"kv_bits": 2, "group_size": 8, "residual": 8}),
    "two-tier": ReplayRun("beaconkv", 32, {"kv_bits": 4, "group_size": 8, "residual": 8, "low_budget": 16}),
}


@pytest.mark.usefixtures("toy_storage")  # quantized caches the tiny model cannot pay for
@pytest.mark.parametrize("name", list(QUANTIZED))
def test_chunked_replay_of_quantized_storage_equals_token_by_token(name: str) -> None:
    """Token by token, a group leaves the full-precision residual as soon as it holds
    residual + group_size tokens, and later tokens read it quantized: a chunk must end there
    too, or its tokens would read the group in full precision (quant-int4 replayed in chunks
    that ignored this had half its token-by-token KL). In float64, so that a chunk's and a
    single token's matmuls round alike: in float32 a K value on a code boundary can round to
    the other code, and quantization turns that 1e-7 into a step."""
    model = build_tiny_model("llama", "sdpa", KV_HEADS).double()  # its own: the shared one stays fp32
    run = QUANTIZED[name]
    chunked = replay_methods(model, trace_ids(), PROMPT, [run], block=64)[0]
    stepwise = replay_methods(model, trace_ids(), PROMPT, [run], block=64, stepwise=True)[0]
    assert stepwise.forwards == chunked.positions and chunked.forwards < chunked.positions // 2
    assert chunked.compressions == stepwise.compressions
    assert torch.equal(chunked.top1, stepwise.top1)
    for key in ("kl", "nll"):
        torch.testing.assert_close(getattr(chunked, key), getattr(stepwise, key), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("method", [*CHUNKED, "h2o", "streaming", "full"])
def test_batched_replay_equals_each_trace_alone(method: str) -> None:
    """Traces of different prompt and trace lengths replayed as one left-padded batch give each
    trace the numbers of its replay alone: the same compressions, the same top-1 agreement,
    KL and NLL up to float rounding of the batched matmuls, the same live-token mean."""
    model = tiny_model("llama", "sdpa", KV_HEADS)
    run = run_of(model, method)
    inputs = [
        ReplayInput("a", trace_ids(seed=5), PROMPT),
        ReplayInput("b", trace_ids(seed=9, n=120), 14),
        ReplayInput("c", trace_ids(seed=11, n=140), 7),
    ]
    batched = replay_batch(model, inputs, [run], block=64)
    assert len(batched) == 3 and all(len(row) == 1 for row in batched)
    for inp, [got] in zip(inputs, batched, strict=True):
        alone = replay_methods(model, inp.input_ids, inp.prompt_len, [run], trace_id=inp.id, block=64)[0]
        assert got.trace_id == inp.id and got.prompt_len == inp.prompt_len
        assert got.positions == alone.positions == inp.input_ids.shape[1] - 1 - inp.prompt_len
        assert got.compressions == alone.compressions
        if method != "full":
            assert got.compressions >= 2 * N_LAYERS
        assert torch.equal(got.top1, alone.top1)
        for name in ("kl", "nll", "nll_full"):
            torch.testing.assert_close(getattr(got, name), getattr(alone, name), atol=1e-4, rtol=1e-4)
        assert got.live_tokens == pytest.approx(alone.live_tokens)


@pytest.mark.parametrize("method", [*CHUNKED, "h2o", "streaming"])
def test_chunk_plan_ends_exactly_where_decoding_compresses(method: str) -> None:
    """Feeding one token at a time, the first compression after a plan of k comes at the k-th token."""
    model = tiny_model("llama", "sdpa", KV_HEADS)
    run = run_of(model, method)
    cache = reasonkv.make_cache(model, run.method, run.budget, **run.knobs)
    ids = trace_ids(seed=6)
    checked = 0
    with torch.no_grad():
        model(input_ids=ids[:, :PROMPT], **cache_arg(cache))
        pos = PROMPT
        while pos < TRACE:
            plan = chunk_plan(cache)
            if pos + plan > TRACE:
                break
            for step in range(1, plan + 1):
                before = cache.n_compressions
                model(input_ids=ids[:, pos : pos + 1], **cache_arg(cache))
                pos += 1
                fired = cache.n_compressions > before
                assert fired == (step == plan), f"plan {plan}: compression after token {step}? {fired}"
            checked += 1
    assert checked >= 3


def test_chunk_plan_by_hand() -> None:
    model = tiny_model("llama", "sdpa", KV_HEADS)
    prompt = trace_ids(seed=7)[:, :PROMPT]

    def planned(method: str, budget: int | None, feed: int = 0, **knobs) -> tuple[int | None, object]:
        cache = reasonkv.make_cache(model, method, budget, **knobs)
        with torch.no_grad():
            model(input_ids=prompt, **cache_arg(cache))
            if feed:
                model(input_ids=trace_ids(seed=8, n=feed), **cache_arg(cache))
        return chunk_plan(cache), cache

    # FixedBuffer: compress at budget + interval real tokens per head: 24 - 10 prompt tokens to go.
    assert planned("snapkv", 16, interval=8)[0] == 14
    # After the first compression (14 more tokens: back to 16 per head) it is the interval.
    assert planned("snapkv", 16, feed=14, interval=8)[0] == 8
    # Threshold at B_max = 32: 22 tokens to go; afterwards it evicts 32 // 8 = 4 and has 4 to go.
    assert planned("beaconkv", 32)[0] == 22
    assert planned("beaconkv", 32, feed=22)[0] == 4
    # Every step: fills up to budget + 1 (7 tokens), then one token per forward.
    assert planned("streaming", 16)[0] == 7
    assert planned("streaming", 16, feed=7)[0] == 1
    # RPC (protect the prompt, R = 8, P = 16): first at P + R = 24 generated tokens, then every P.
    assert planned("rpc", 4, interval=16, n_recent=8, window=8)[0] == 24
    assert planned("rpc", 4, feed=24, interval=16, n_recent=8, window=8)[0] == 16
    # The full cache never compresses: no bound.
    assert planned("full", None)[0] is None
    # Per-layer budgets: the layer with the smallest budget decides.
    plan, cache = planned("pyramid-rkv", 16, interval=8)
    smallest = int(cache.budgets.min())
    assert len(set(cache.budgets[:, 0].tolist())) > 1, "the layers must really differ"
    assert plan == smallest + 8 - PROMPT


# ----------------------------------------------------------------- the reference
def test_full_reference_equals_one_plain_forward() -> None:
    """The replay's reference (prompt, then 64-token blocks through the `full` cache) gives the
    logits of one stock forward over the whole sequence."""
    model = tiny_model("llama", "sdpa", KV_HEADS)
    stock = build_tiny_model("llama", "sdpa", KV_HEADS)  # same seed, never touched by reasonkv
    ids = trace_ids()
    with torch.no_grad():
        plain = stock(input_ids=ids).logits[0, PROMPT:-1]
    blocks = reference_logits(model, ids, PROMPT, block=64)
    assert blocks.shape == plain.shape == (TRACE - 1 - PROMPT, model.config.vocab_size)
    torch.testing.assert_close(blocks, plain, atol=1e-5, rtol=1e-5)


def test_full_against_itself_is_exactly_faithful() -> None:
    model = tiny_model("qwen3", "eager", 4)
    result = replay_trace(model, trace_ids(), PROMPT, "full", block=32)
    assert result.positions == TRACE - 1 - PROMPT
    assert torch.all(result.kl == 0)
    assert bool(result.top1.all())
    assert torch.equal(result.nll, result.nll_full)
    m = metrics(result.sums())
    assert (m["mean_kl"], m["top1"], m["ppl_ratio"]) == (0.0, 1.0, 1.0)
    assert result.compressions == 0


def test_budget_beyond_the_trace_is_faithful_and_a_small_one_is_not() -> None:
    model = tiny_model("llama", "sdpa", KV_HEADS)
    runs = [ReplayRun("snapkv", 4096), ReplayRun("snapkv", 16, {"interval": 8})]
    roomy, small = replay_methods(model, trace_ids(), PROMPT, runs)
    assert roomy.compressions == 0
    assert float(roomy.kl.max()) < 1e-9 and bool(roomy.top1.all())
    assert small.compressions > 0
    assert float(small.kl.mean()) > 1e-3 and float(small.top1.double().mean()) < 1.0
    # Before anything is evicted (the first 24 - 10 = 14 positions) the two runs agree, up to
    # float32 rounding (a 14-token chunk vs the reference's 256-token block).
    assert float(small.kl[:14].max()) < 1e-6 and bool(small.top1[:14].all())
    assert small.live_tokens < roomy.live_tokens


@pytest.mark.usefixtures("toy_storage")  # a quantized snapkv@16 the tiny model cannot pay for
def test_peak_memory_of_a_replay_is_what_the_cache_held_at_most() -> None:
    """Peak live tokens per head: SnapKV at B + I (B = 16, I = 8) attends to B + I tokens
    before each compression; BeaconKV (threshold) to its B = 32; H2O (every step) to B + 1;
    the full cache to the whole trace.
    Peak K/V bytes per sequence: the cache's meter over its rows; SnapKV's is the
    (layers + 1) x (B + I) slots of one layer compacting while the others are full."""
    model = tiny_model("llama", "sdpa", KV_HEADS)
    runs = [
        ReplayRun("full", None),
        ReplayRun("snapkv", 16, {"interval": 8}),
        ReplayRun("beaconkv", 32),
        ReplayRun("h2o", 16),
    ]
    inputs = [ReplayInput("a", trace_ids(), PROMPT), ReplayInput("b", trace_ids(seed=1), PROMPT)]
    (full, snap, beacon, h2o), _ = replay_batch(model, inputs, runs)
    assert full.peak_live_tokens == full.decode_peak_live_tokens == TRACE - 1  # the last token saw all
    assert snap.decode_peak_live_tokens == 16 + 8 and beacon.decode_peak_live_tokens == 32
    assert h2o.decode_peak_live_tokens == 16 + 1  # the new token is attended before the eviction
    per_slot = 2 * KV_HEADS * 16 * 4  # K and V, KV heads, head dim 16, fp32: one row
    assert snap.decode_peak_kv_bytes == (N_LAYERS + 1) * (16 + 8) * per_slot
    assert snap.mean_kv_bytes <= snap.decode_peak_kv_bytes < full.decode_peak_kv_bytes
    # At 16 bits (as served in bf16) the fp32 storage costs half, at every peak and on average.
    for r in (full, snap, beacon, h2o):
        assert 2 * r.decode_peak_kv_bytes_16bit == r.decode_peak_kv_bytes
        assert 2 * r.peak_kv_bytes_16bit == r.peak_kv_bytes and 2 * r.mean_kv_bytes_16bit == r.mean_kv_bytes
    (quant,), _ = replay_batch(
        model,
        inputs,
        [ReplayRun("snapkv", 16, {"interval": 8, "kv_bits": 4, "group_size": 8, "residual": 8})],
    )
    assert quant.mean_kv_bytes_16bit > quant.mean_kv_bytes / 2  # its uint8 codes are not halved
    # Everything a sequence holds is more than its K/V: BeaconKV's beacon buffers alone (4 query
    # heads x 32 beacons x head dim 16, fp32, a layer) are beside it at its peak.
    for r in (full, snap, beacon, h2o, quant):
        assert r.decode_peak_state_bytes > r.decode_peak_kv_bytes
        assert r.decode_peak_state_bytes_16bit > r.decode_peak_kv_bytes_16bit
        assert r.peak_state_bytes >= r.decode_peak_state_bytes
    beacons = N_LAYERS * 4 * 32 * 16 * 4
    assert beacon.decode_peak_state_bytes - beacon.decode_peak_kv_bytes > beacons
    assert snap.live_tokens < snap.decode_peak_live_tokens
    # A prompt longer than the budget is held whole for its forward: the peak over the whole
    # run says so, the peak while decoding does not.
    long = ReplayInput("long", trace_ids(), 40)
    (snap_long,), _ = replay_batch(model, [long, inputs[1]], [ReplayRun("snapkv", 16, {"interval": 8})])
    assert snap_long.peak_live_tokens == 40 and snap_long.decode_peak_live_tokens == 16 + 8
    assert snap_long.peak_kv_bytes > snap_long.decode_peak_kv_bytes


# --------------------------------------------------------------------- arithmetic
def test_kl_top1_and_nll_on_known_distributions() -> None:
    p = torch.tensor([[0.5, 0.25, 0.25], [0.7, 0.2, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.5, 0.25], [0.7, 0.2, 0.1]], dtype=torch.float64)
    # Logits are defined up to a constant per row: shift them to check the normalisation.
    out = compare_logits(p.log() + 3.0, q.log() - 1.0, torch.tensor([1, 2]))
    expected_kl = [0.5 * math.log(2) + 0.25 * math.log(0.5), 0.0]  # = 0.25 ln 2, and 0
    torch.testing.assert_close(out["kl"], torch.tensor(expected_kl, dtype=torch.float64), atol=1e-12, rtol=0)
    assert out["top1"].tolist() == [False, True]
    torch.testing.assert_close(
        out["nll_full"], torch.tensor([math.log(4), math.log(10)], dtype=torch.float64)
    )
    torch.testing.assert_close(out["nll"], torch.tensor([math.log(2), math.log(10)], dtype=torch.float64))


def _result(trace: str, kl: list[float], top1: list[bool], nll_full: list[float], nll: list[float]):
    return ReplayResult(
        trace,
        ReplayRun("snapkv", 64),
        prompt_len=5,
        kl=torch.tensor(kl, dtype=torch.float64),
        top1=torch.tensor(top1),
        nll_full=torch.tensor(nll_full, dtype=torch.float64),
        nll=torch.tensor(nll, dtype=torch.float64),
        live_tokens=10.0 if trace == "a" else 20.0,
    )


def test_metrics_curves_and_pooling_over_traces() -> None:
    a = _result(
        "a", [0.0, 0.2, 0.4, 0.6], [True, True, False, True], [1.0, 1.0, 2.0, 2.0], [1.0, 1.5, 2.0, 3.0]
    )
    b = _result("b", [1.0, 1.0], [False, False], [1.0, 1.0], [2.0, 2.0])
    m = metrics(a.sums())
    assert m["positions"] == 4
    assert m["mean_kl"] == pytest.approx(0.3) and m["top1"] == pytest.approx(0.75)
    assert m["ppl_ratio"] == pytest.approx(math.exp((7.5 - 6.0) / 4))

    curve = a.curve(bin_size=3)  # bins [0, 3) and [3, 4)
    assert [(c["start"], c["end"], c["positions"]) for c in curve] == [(0, 3, 3), (3, 4, 1)]
    assert curve[0]["mean_kl"] == pytest.approx(0.2) and curve[1]["mean_kl"] == pytest.approx(0.6)
    assert curve[0]["top1"] == pytest.approx(2 / 3)

    # Pooled over traces: every position weighs the same; b only reaches the first bin.
    pooled = curve_of([a, b], bin_size=3)
    assert pooled[0]["traces"] == 2 and pooled[1]["traces"] == 1
    assert pooled[0]["mean_kl"] == pytest.approx((0.6 + 2.0) / 5)
    (row,) = summarize([a, b], bin_size=3)
    assert row["label"] == "snapkv@64" and row["traces"] == 2 and row["positions"] == 6
    assert row["mean_kl"] == pytest.approx(3.2 / 6) and row["top1"] == pytest.approx(3 / 6)
    assert row["ppl_ratio"] == pytest.approx(math.exp((11.5 - 8.0) / 6))
    assert row["live_tokens"] == pytest.approx((10 * 4 + 20 * 2) / 6)
    json.dumps(row)  # JSON-ready
    json.dumps(a.to_dict(per_position=True))


# ------------------------------------------------------------------------- CLI
runner = CliRunner()
WIDE = {"COLUMNS": "200"}


def replay_app() -> typer.Typer:
    app = typer.Typer()
    app.command("replay")(replay_cli.replay_command)

    @app.callback()
    def main() -> None:  # a callback keeps `replay` a subcommand, as in the real app
        pass

    return app


def write_traces(path) -> None:
    rows = [
        {"id": "wp-1", "variant": "well_posed", "problem": "What is 2+3?", "trace": "Add them: 2+3=5. " * 6},
        {"id": "mp-1", "variant": "missing_premise", "problem": "What is x?", "trace": "Unknown. " * 8},
        {
            "id": "wp-2",
            "variant": "well_posed",
            "problem": "Is 7 prime?",
            "trace": "Check 2, 3: no divisor. " * 5,
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def loader(monkeypatch):
    """Replace the command's model loader (a tiny Llama, a char tokenizer); records the calls.
    One thread, as conftest sets: more threads only make a tiny model's small ops wait."""
    monkeypatch.setenv("REASONKV_THREADS", "1")
    threads = torch.get_num_threads()
    calls: list[str] = []

    def load(name, **kwargs):
        calls.append(name)
        return tiny_llama(), CharTokenizer()

    monkeypatch.setattr(replay_cli, "load_model", load)
    # What is read before the weights: the tokenizer and the config (max_position_embeddings).
    monkeypatch.setattr(
        replay_cli, "load_tokenizer_and_config", lambda name: (CharTokenizer(), tiny_llama().config)
    )
    yield calls
    torch.set_num_threads(threads)


def test_replay_command_writes_results_table_and_plot(loader, tmp_path) -> None:
    traces, out, plot = tmp_path / "t.jsonl", tmp_path / "res" / "r.json", tmp_path / "fid.png"
    write_traces(traces)
    args = ["replay", "--traces", str(traces), "--model", "tiny", "--methods", "full,snapkv,streaming"]
    args += ["--budgets", "16,24", "--set", "interval=8", "--max-tokens", "90", "--bin", "32"]
    args += ["--out", str(out), "--plot", str(plot)]
    result = runner.invoke(replay_app(), args, env=WIDE)
    assert result.exit_code == 0, result.output
    assert loader == ["tiny"]

    record = json.loads(out.read_text())
    assert record["traces"] == ["wp-1", "wp-2"]  # well_posed rows only, in file order
    labels = [row["label"] for row in record["summary"]]
    assert labels == ["full", "snapkv@16", "snapkv@24", "streaming@16", "streaming@24"]
    # interval went to snapkv only (streaming has no such knob).
    assert record["runs"][1] == {"method": "snapkv", "budget": 16, "knobs": {"interval": 8}}
    assert record["runs"][3]["knobs"] == {}
    positions = sum(n - p - 1 for n, p in zip(record["tokens"], record["prompt_tokens"], strict=True))
    full, snap16 = record["summary"][0], record["summary"][1]
    assert full["mean_kl"] == 0.0 and full["top1"] == 1.0 and full["positions"] == positions
    assert snap16["mean_kl"] > 0 and len(snap16["curve"]) == math.ceil(max(record["tokens"]) / 32) - 1
    assert len(record["per_trace"]) == 2 * 5

    # The JSON holds exactly what the library computes for the same trace.
    model, tok = tiny_llama(), CharTokenizer()
    rows = [json.loads(line) for line in traces.read_text().splitlines()]
    inp = reasonkv.harness.traces.replay_input(tok, rows[0], 90)
    direct = replay_trace(model, inp.input_ids, inp.prompt_len, "snapkv", 16, {"interval": 8})
    stored = next(r for r in record["per_trace"] if r["trace"] == "wp-1" and r["budget"] == 16)
    assert stored["method"] == "snapkv"
    assert stored["mean_kl"] == pytest.approx(float(direct.kl.mean()), rel=1e-6)

    assert plot.exists() and plot.stat().st_size > 1000
    assert "snapkv" in result.stdout and "ppl ratio" in result.stdout
    # Not on a terminal: one plain line per finished trace × run, with its numbers.
    unit_lines = [line for line in result.stderr.splitlines() if ": KL " in line]
    assert len(unit_lines) == 2 * 5
    snap_line = next(line for line in unit_lines if line.startswith("wp-1 snapkv@16: "))
    assert f"KL {stored['mean_kl']:.4f}" in snap_line and "tokens/head" in snap_line


@pytest.mark.parametrize("columns", [80, 200])
def test_replay_table_fits_the_terminal_without_cutting_names(loader, tmp_path, columns) -> None:
    traces = tmp_path / "t.jsonl"
    write_traces(traces)
    args = ["replay", "--traces", str(traces), "--model", "tiny", "--methods", "full,reasonalloc-head-rkv"]
    args += ["--budgets", "16", "--set", "interval=8", "--max-tokens", "60", "--out", str(tmp_path / "r")]
    result = runner.invoke(replay_app(), args, env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    table = result.stdout[: result.stdout.index(" s wall")]
    assert "…" not in table and max(len(line) for line in table.splitlines()) <= columns
    assert ("reasonalloc-head-rkv" in table) == (columns == 200)  # at 80 it breaks after a hyphen
    assert "reasonalloc-" in table and "mean KL" in table and "top-1" in table


def test_replay_command_says_a_batch_of_quantized_rows_is_not_each_trace_alone(loader, tmp_path) -> None:
    traces = tmp_path / "t.jsonl"
    write_traces(traces)
    args = ["replay", "--traces", str(traces), "--model", "tiny", "--max-tokens", "60", "--budgets", "16"]
    args += ["--methods", "streaming,quant-int4", "--set", "group_size=16", "--out", str(tmp_path / "r.json")]
    batched = runner.invoke(replay_app(), [*args, "--batch"], env=WIDE)
    assert batched.exit_code == 0, batched.output
    assert "--batch with quantized storage (quant-int4)" in " ".join(errors_of(batched).split())
    alone = runner.invoke(replay_app(), args, env=WIDE)
    assert alone.exit_code == 0 and "quantized storage" not in errors_of(alone)


def test_replay_command_batch_equals_one_by_one(loader, tmp_path) -> None:
    """--batch replays both traces as one batch: the same rows, numbers equal to float rounding."""
    traces = tmp_path / "t.jsonl"
    write_traces(traces)
    args = ["replay", "--traces", str(traces), "--model", "tiny", "--methods", "snapkv,streaming"]
    args += ["--budgets", "16", "--set", "interval=8", "--max-tokens", "90"]
    records = []
    for mode in ("--one-by-one", "--batch"):
        out = tmp_path / f"{mode}.json"
        result = runner.invoke(replay_app(), [*args, "--out", str(out), mode], env=WIDE)
        assert result.exit_code == 0, result.output
        records.append(json.loads(out.read_text()))
    one, batched = records
    device = resolve_device("auto")  # as resolved, not auto: the CPU here, CUDA on a GPU machine
    dtype = str(resolve_dtype("auto", device)).removeprefix("torch.")
    assert batched["command"].endswith(f"--batch --device {device} --dtype {dtype}")
    pairs = zip(one["per_trace"], batched["per_trace"], strict=True)
    assert len(one["per_trace"]) == 4
    for a, b in sorted(pairs, key=lambda ab: (ab[0]["trace"], ab[0]["method"])):
        assert (a["trace"], a["method"], a["positions"]) == (b["trace"], b["method"], b["positions"])
        assert a["compressions"] == b["compressions"]
        assert b["mean_kl"] == pytest.approx(a["mean_kl"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "full,nope"], "unknown method 'nope'"),
        (["--budgets", "64,x"], "--budgets takes positive integers"),
        (["--budgets", "0"], "--budgets takes positive integers (tokens per KV head), got 0"),
        (["--set", "nope=1"], "unknown parameter(s) nope"),
        (["--set", "interval=2.5"], "'interval' of 'snapkv' expects an integer"),
        (["--variant", "other"], "no traces of variant 'other'"),
        (["--ids", "wp-9"], "trace ids not in"),
        (["--max-tokens", "1"], "--max-tokens must be at least 2"),
    ],
)
def test_bad_input_is_one_line_before_loading(loader, tmp_path, extra, message) -> None:
    traces = tmp_path / "t.jsonl"
    write_traces(traces)
    args = ["replay", "--traces", str(traces), "--methods", "full,snapkv", "--out", str(tmp_path / "r.json")]
    result = runner.invoke(replay_app(), args + extra, env=WIDE)
    assert result.exit_code == 2, result.output
    err = result.stderr or result.output
    assert message in err and len(err.strip().splitlines()) == 1
    assert loader == [], "the model was loaded although the arguments were invalid"


def test_missing_trace_file_and_too_small_budget_are_clean_errors(loader, tmp_path) -> None:
    missing = runner.invoke(replay_app(), ["replay", "--traces", str(tmp_path / "none.jsonl")], env=WIDE)
    assert missing.exit_code == 2 and "no trace file" in (missing.stderr or missing.output)
    traces = tmp_path / "t.jsonl"
    write_traces(traces)
    # Only make_cache (after loading) knows the protected window: snapkv protects 8 recent tokens.
    small = runner.invoke(
        replay_app(), ["replay", "--traces", str(traces), "--methods", "snapkv", "--budgets", "4"], env=WIDE
    )
    assert small.exit_code == 2 and "below the protected window" in (small.stderr or small.output)
