"""`reasonkv analyze`: the revisit rule, histograms and missed-revisit counts on hand-made
attention, the recording against plain attention, and the command end to end on a tiny model."""

from __future__ import annotations

import json
import re

import pytest
import torch
import typer

from cli_helpers import CharTokenizer, errors_of, runner
from conftest import TEST_DEVICE, build_tiny_model
from reasonkv.cli import analyze as analyze_cli
from reasonkv.harness.analyze import (
    NEVER_EVICTED,
    RevisitRule,
    analyze_trace,
    approx_far_fraction,
    classify,
    distance_edges,
    distance_histogram,
    eligible,
    eviction_times,
    far_fraction,
    far_keys,
    mean_distance,
    missed_revisits,
    needed_keys,
    persistent_keys,
    plot_pca,
    simulate_beacons,
    update_eviction_times,
)
from reasonkv.harness.profile import profile_trace
from reasonkv.harness.replay import ReplayRun

F64 = torch.float64


def row(n: int, mass: dict[int, float]) -> torch.Tensor:
    """An attention row over keys 0..n-1 with the given masses (dyadic: exact in float)."""
    r = torch.zeros(n, dtype=F64)
    for k, v in mass.items():
        r[k] = v
    return r


# ----------------------------------------------------------------- the rule
RULE = RevisitRule(distance=4, fraction=0.25, n_sink=2, top_k=2, persistent=None)
KEYS = torch.arange(10)  # query at 9: far keys are 2..5 (d >= 4, not sinks), near keys 6..9


def test_global_exactly_at_the_fraction_and_distance_boundaries() -> None:
    rows = torch.stack(
        [
            row(10, {0: 0.5, 5: 0.125, 9: 0.375}),  # key 5 is exactly D back: f = 0.125/0.5 = φ -> global
            row(10, {0: 0.5, 6: 0.125, 9: 0.375}),  # key 6 is D-1 back: not far -> local
            row(10, {0: 0.5, 5: 15 / 128, 9: 49 / 128}),  # f just under φ -> local
            row(10, {0: 0.25, 4: 0.125, 9: 0.625}),  # f = 0.125/0.75 < φ -> local
        ]
    )
    q = torch.full((4,), 9)
    f = far_fraction(rows, q, KEYS, RULE)
    assert f.tolist() == [0.25, 0.0, 15 / 64, 0.125 / 0.75]
    assert classify(rows, q, KEYS, RULE).tolist() == [True, False, False, False]


def test_sinks_are_left_out_of_both_masses() -> None:
    # Key 1 is a sink (n_sink=2) 8 tokens back: all its mass is ignored, so the query is local...
    r = row(10, {1: 0.5, 8: 0.25, 9: 0.25})
    assert far_fraction(r, torch.tensor(9), KEYS, RULE) == 0.0
    assert not classify(r, torch.tensor(9), KEYS, RULE)
    # ...while without sinks the same row is global, and the denominator only holds non-sinks.
    no_sink = RevisitRule(distance=4, fraction=0.25, n_sink=0, top_k=2, persistent=None)
    assert far_fraction(r, torch.tensor(9), KEYS, no_sink) == 0.5
    r2 = row(10, {0: 0.5, 2: 0.125, 8: 0.375})  # the sink's 0.5 leaves the denominator: f = 0.125 / 0.5
    assert far_fraction(r2, torch.tensor(9), KEYS, RULE) == 0.25
    # Only sink mass at all: f = 0, never a division by zero.
    assert far_fraction(row(10, {0: 1.0}), torch.tensor(9), KEYS, RULE) == 0.0


def test_only_the_top_k_far_keys_count_and_excluded_keys_leave_both_masses() -> None:
    r = row(10, {3: 0.0625, 4: 0.0625, 5: 0.0625, 9: 0.3125})  # counted mass 0.5, three far keys
    q = torch.tensor(9)
    assert far_fraction(r, q, KEYS, RULE) == 0.25  # top 2 of 3: 0.125 / 0.5
    top3 = RevisitRule(distance=4, fraction=0.25, n_sink=2, top_k=3, persistent=None)
    assert far_fraction(r, q, KEYS, top3) == 0.375
    excluded = torch.zeros(10, dtype=torch.bool)
    excluded[[4, 9]] = True  # a persistent key, and a near one: out of the far and the total mass
    assert far_fraction(r, q, KEYS, RULE, excluded) == 1.0  # 0.125 / (0.5 - 0.0625 - 0.3125)


def test_eligibility_and_causality() -> None:
    assert eligible(torch.tensor([5, 6, 7]), RULE).tolist() == [False, True, True]  # p - 4 >= 2
    # Keys after the query (and EMPTY slots) never count, whatever their weight.
    slots = torch.tensor([0, 2, 7, torch.iinfo(torch.int64).max])
    r = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=F64)
    assert far_fraction(r, torch.tensor(6), slots, RULE) == 1.0  # only key 2 is counted, and it is far
    # An ineligible query is local even with all its mass far.
    assert not classify(row(10, {2: 1.0}), torch.tensor(5), KEYS, RULE)
    assert classify(row(10, {2: 1.0}), torch.tensor(6), KEYS, RULE)


def test_rule_arguments_are_checked() -> None:
    for bad in ({"distance": 0}, {"distance": 4, "fraction": 0.0}, {"distance": 4, "top_k": 0}):
        with pytest.raises(ValueError):
            RevisitRule(**bad)
    with pytest.raises(ValueError, match="σ"):
        RevisitRule(4, persistent=1.5)


# ---------------------------------------------------------- distances, needs
def test_distance_histogram_and_mean_distance() -> None:
    edges = distance_edges(10)
    assert edges.tolist() == [0, 1, 2, 4, 8, 16]  # bins [0,1) [1,2) [2,4) [4,8) [8,16)
    rule = RevisitRule(distance=4, n_sink=1, persistent=None)
    # query 10: key 0 is a sink (ignored), distances 0, 1, 3, 5, 9.
    r = row(11, {0: 0.5, 10: 0.125, 9: 0.125, 7: 0.0625, 5: 0.0625, 1: 0.125})
    hist = distance_histogram(r, torch.tensor(10), torch.arange(11), edges, rule)
    assert hist.tolist() == [0.25, 0.25, 0.125, 0.125, 0.25]  # normalised by the 0.5 non-sink mass
    md = mean_distance(r, torch.tensor(10), torch.arange(11), rule)
    assert md == pytest.approx((0.125 * 0 + 0.125 * 1 + 0.0625 * 3 + 0.0625 * 5 + 0.125 * 9) / 0.5)
    # Batched: two queries at once, the second with nothing counted -> zeros.
    both = distance_histogram(
        torch.stack([r, row(11, {0: 1.0})]), torch.tensor([10, 10]), torch.arange(11), edges, rule
    )
    assert both[1].tolist() == [0.0] * 5


def test_needed_keys_shortest_prefix_reaching_the_mass() -> None:
    rule = RevisitRule(distance=4, n_sink=2, top_k=8, persistent=None)
    r = row(10, {2: 0.125, 3: 0.25, 5: 0.125, 9: 0.5})  # far: 3 (0.25), then 2 and 5 tied (0.125)
    pos, w = needed_keys(r, torch.tensor(9), KEYS, rule, mass=0.5)
    assert pos.tolist()[:2] == [3, -1] and w.tolist()[0] == 0.25  # 0.25 reaches exactly half of 0.5
    pos, w = needed_keys(r, torch.tensor(9), KEYS, rule, mass=0.75)
    assert pos.tolist()[:3] == [3, 2, -1]  # tie between 2 and 5 goes to the older key
    pos, _ = needed_keys(r, torch.tensor(9), KEYS, rule, mass=1.0)
    assert pos.tolist()[:4] == [3, 2, 5, -1]
    top, tw = far_keys(r, torch.tensor(9), KEYS, rule)
    assert top.tolist() == [3, 2, 5] + [-1] * 5  # key 4 is far but has no attention: not listed
    assert tw.tolist() == [0.25, 0.125, 0.125] + [0.0] * 5


# ------------------------------------------------------------ missed revisits
def test_eviction_times_and_missed_revisits_on_hand_made_kept_sets() -> None:
    n = 8

    def kept(*tokens: int) -> torch.Tensor:
        k = torch.zeros(1, n, dtype=torch.bool)
        k[0, list(tokens)] = True
        return k

    steps = [(4, kept(0, 1, 2, 3)), (6, kept(0, 2, 4, 5)), (8, kept(0, 4, 6, 7))]
    ev = eviction_times(steps, n)
    never = NEVER_EVICTED
    assert ev[0].tolist() == [never, 6, 8, 6, never, 8, never, never]
    # An eviction time is never overwritten, and unseen tokens are never 'evicted'.
    again = update_eviction_times(ev, kept(0), 8)
    assert again[0].tolist() == [never, 6, 8, 6, 8, 8, 8, 8]
    assert update_eviction_times(torch.full((1, n), never), kept(), 3)[0].tolist() == [3, 3, 3] + [never] * 5

    needed = torch.tensor([[[1, 3, -1], [1, 2, -1], [1, 3, 5], [0, 4, -1]]])  # [H=1, Q=4, K=3]
    queries = torch.tensor([5, 6, 8, 8])
    missed = missed_revisits(needed, queries, ev)
    assert missed.tolist() == [[0, 1, 3, 0]]
    # The same count from a slow loop over the kept sets: key j is missed at p when the last
    # step with seen <= p did not keep it (evictions are final).
    slow = []
    for q, keys in zip(queries.tolist(), needed[0].tolist(), strict=True):
        last = [k for s, k in steps if s <= q][-1][0]
        slow.append(sum(1 for j in keys if j >= 0 and not bool(last[j])))
    assert slow == missed[0].tolist()


def test_persistent_keys_are_a_fixpoint() -> None:
    # Four queries; key 10 is everyone's strongest far key, key 11 the second of three of them.
    top = torch.tensor([[[10, 11, 20, -1], [10, 11, 21, -1], [10, 11, 22, -1], [10, 23, 24, -1]]])
    support = torch.full((30,), 4)
    rule = RevisitRule(distance=1, top_k=1, persistent=0.5, min_support=1)
    one_round = persistent_keys(top, support, rule, rounds=1)[0]
    assert one_round.nonzero().flatten().tolist() == [10]
    fixed = persistent_keys(top, support, rule)[0]
    assert fixed.nonzero().flatten().tolist() == [10, 11]  # 11 enters everyone's top 1 once 10 is out
    low_support = support.clone()
    low_support[11] = 3
    assert (
        persistent_keys(top, low_support, RevisitRule(1, top_k=1, persistent=0.5, min_support=4))[0].sum()
        == 1
    )
    assert not persistent_keys(top, support, RevisitRule(1, top_k=1, persistent=None)).any()


def test_approx_far_fraction_is_exact_when_the_lists_hold_every_key() -> None:
    torch.manual_seed(0)
    attn = torch.softmax(torch.randn(2, 6, 40, dtype=F64) * 3, -1)
    q = torch.arange(34, 40)
    keys = torch.arange(40)
    rule = RevisitRule(distance=8, top_k=4, n_sink=2, persistent=None)
    excluded = torch.zeros(2, 40, dtype=torch.bool)
    excluded[:, [5, 17]] = True
    top, w = far_keys(attn, q, keys, rule, k=40)
    counted = (keys >= 2) & (keys[None, :] <= q[:, None])
    total = torch.where(counted, attn, 0.0).sum(-1)
    approx = approx_far_fraction(top, w, total, excluded, rule)
    exact = far_fraction(attn, q, keys, rule, excluded[:, None, :])
    assert torch.allclose(approx, exact)


# ---------------------------------------------------------------- recording
TRACE_ROW = {
    "id": "wp-1",
    "variant": "well_posed",
    "problem": "What is 2+3? Think.",
    "trace": "First add two and three: 2+3=5. Check again: five. " * 3,
}


@pytest.fixture(scope="module")
def tiny_inputs():
    from reasonkv.harness.traces import replay_input

    inp = replay_input(CharTokenizer(), TRACE_ROW, 150)
    return inp.input_ids, inp.prompt_len


def test_recorded_attention_is_the_models_attention(tiny_inputs) -> None:
    ids, prompt = tiny_inputs
    model = build_tiny_model("llama", "eager")
    with torch.no_grad():  # plain attention, before install
        ref = model(input_ids=ids.to(TEST_DEVICE), output_attentions=True).attentions
    rule = RevisitRule(distance=16, persistent=None)
    an = analyze_trace(model, ids, prompt, rule, layers=[0, 1], window=40, block=32)
    n = ids.shape[1]
    assert an.positions.tolist() == list(range(prompt, n))
    assert an.map_positions.tolist() == list(range(n - 40, n))
    for li in (0, 1):
        group_mean = ref[li][0].reshape(2, 2, n, n).mean(1).cpu()  # 4 query heads, 2 KV heads
        torch.testing.assert_close(an.maps[li], group_mean[:, n - 40 :], atol=1e-5, rtol=1e-4)
        # The per-query statistics come from the same rows: recompute them from the reference.
        attn = group_mean[:, prompt:]
        q = torch.arange(prompt, n)
        torch.testing.assert_close(
            an.far_frac[li], far_fraction(attn, q, torch.arange(n), rule), atol=1e-5, rtol=1e-4
        )
    # Pre-RoPE queries of every token are kept for the drawn layers.
    assert an.pre_queries[0].shape == (n, 4, 16)


def test_entropy_curve_equals_the_profilers(tiny_inputs) -> None:
    ids, prompt = tiny_inputs
    model = build_tiny_model("llama")
    an = analyze_trace(model, ids, prompt, RevisitRule(16, persistent=None), stride=16, layers=[0])
    ref = profile_trace(model, ids, prompt, stride=16)["entropy"].mean((0, 2)).cpu()
    torch.testing.assert_close(an.entropy_curve(), ref, atol=1e-5, rtol=1e-5)


def test_chunked_method_replay_equals_stepwise_and_missed_counts_match_a_loop(tiny_inputs) -> None:
    ids, prompt = tiny_inputs
    model = build_tiny_model("llama")
    runs = [ReplayRun("full"), ReplayRun("snapkv", 24, {"interval": 8}), ReplayRun("beaconkv", 24, {})]
    rule = RevisitRule(16)
    chunked = analyze_trace(model, ids, prompt, rule, layers=[1], runs=runs, block=48)
    stepwise = analyze_trace(model, ids, prompt, rule, layers=[1], runs=runs, block=48, stepwise=True)
    assert torch.equal(chunked.is_global, stepwise.is_global)
    for a, b in zip(chunked.methods, stepwise.methods, strict=True):
        assert torch.equal(a.evicted_at, b.evicted_at), a.label
        assert a.forwards < b.forwards or a.method == "full"
        assert a.mean_kl == pytest.approx(b.mean_kl, abs=1e-6)
    full, snap, beacon = chunked.methods
    assert (full.evicted_at == NEVER_EVICTED).all() and full.mean_kl == 0.0
    assert chunked.missed(full)["missed_keys"] == 0
    # Slow reference of the missed count: every (layer, head, global query, needed key).
    for result in (snap, beacon):
        slow = 0
        for li, h, i in chunked.is_global.nonzero().tolist():
            p = int(chunked.positions[i])
            for j in chunked.needed[li, h, i].tolist():
                slow += j >= 0 and int(result.evicted_at[li, h, j]) <= p
        got = chunked.missed(result)
        assert got["missed_keys"] == slow > 0  # a random tiny model revisits a lot; 24 tokens lose some
        assert got["missed_keys"] <= got["needed_keys"]


def test_beacons_and_pca_plot(tmp_path) -> None:
    torch.manual_seed(0)
    pre = torch.randn(80, 2, 16)  # 80 queries of a 2-head group
    beacons, source = simulate_beacons(pre, beacon_max=8, beacon_min=4, recent=5)
    points = pre[:75].reshape(-1, 16)
    assert 4 <= beacons.shape[0] < 8
    torch.testing.assert_close(beacons, points[source])  # beacons are copies of buffered points
    png = plot_pca(
        pre.reshape(-1, 16),
        torch.rand(160) < 0.2,
        torch.arange(80).repeat_interleave(2),
        beacons,
        tmp_path / "pca.png",
        is_prompt=torch.arange(160) < 20,
    )
    assert png.exists() and png.stat().st_size > 5000


# ---------------------------------------------------------------- command
def analyze_app() -> typer.Typer:
    app = typer.Typer()
    app.command("analyze")(analyze_cli.analyze_command)

    @app.callback()
    def main() -> None:  # keeps `analyze` a subcommand, as in the real app
        pass

    return app


@pytest.fixture
def loader(monkeypatch):
    monkeypatch.setenv("REASONKV_THREADS", "1")
    threads = torch.get_num_threads()
    calls: list[str] = []

    def load(name, **kwargs):
        calls.append(name)
        return build_tiny_model("llama"), CharTokenizer()

    monkeypatch.setattr(analyze_cli, "load_model", load)
    # What is read before the weights: the tokenizer and the config (max_position_embeddings).
    monkeypatch.setattr(
        analyze_cli,
        "load_tokenizer_and_config",
        lambda name: (CharTokenizer(), build_tiny_model("llama").config),
    )
    yield calls
    torch.set_num_threads(threads)


def test_analyze_command_writes_an_offline_report(loader, tmp_path, monkeypatch) -> None:
    traces, out = tmp_path / "t.jsonl", tmp_path / "report"
    other = {**TRACE_ROW, "id": "wp-0", "trace": "No."}
    traces.write_text(json.dumps(other) + "\n" + json.dumps(TRACE_ROW) + "\n")
    monkeypatch.chdir(tmp_path)  # relative paths in, absolute ones in the echoed command
    args = ["analyze", "--traces", "t.jsonl", "--id", "wp-1", "--model", "tiny", "--out", "report"]
    args += ["--max-tokens", "150", "--methods", "full,snapkv", "--budget", "24", "--set", "interval=8"]
    args += ["--layers", "1", "--window", "48"]
    result = runner.invoke(analyze_app(), args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert loader == ["tiny"]
    page = (out / "index.html").read_text()
    images = re.findall(r'<img src="([^"]+)"', page)
    assert {"global_share.png", "distance_histograms.png", "entropy_wave.png", "missed_revisits.png"} <= set(
        images
    )
    assert any(i.startswith("attention_L1_H") for i in images) and any(
        i.startswith("pca_L1_H") for i in images
    )
    for img in images:
        assert (out / img).stat().st_size > 3000, img
    assert "http" not in page and "<script" not in page  # offline: nothing fetched
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trace"] == "wp-1" and summary["layers"] == [1]
    assert (
        f"--traces {traces.resolve()}" in summary["command"]
        and f"--out {out.resolve()}" in summary["command"]
    )
    assert "grey ticks" not in page and ("persistent key" in page or "no persistent keys" in page)
    assert summary["rule"]["distance"] == max(16, summary["tokens"] // 8)
    labels = [m["label"] for m in summary["methods"]]
    assert labels == ["full", "snapkv@24"]
    assert summary["methods"][0]["missed_keys"] == 0 and summary["methods"][1]["missed_keys"] > 0
    assert "missed" in result.output and "snapkv@24" in result.output


def test_analyze_command_errors_before_loading(loader, tmp_path) -> None:
    traces = tmp_path / "t.jsonl"
    traces.write_text(json.dumps(TRACE_ROW) + "\n")
    base = ["analyze", "--traces", str(traces), "--out", str(tmp_path / "o")]
    for extra, message in (
        (["--methods", "nope"], "nope"),
        (["--id", "missing"], "missing"),
        (["--fraction", "1.5"], "φ"),
        (["--layers", "a,b"], "--layers"),
    ):
        result = runner.invoke(analyze_app(), base + extra)
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.output
    assert loader == []
    late = runner.invoke(analyze_app(), [*base, "--layers", "7", "--methods", "none"])
    assert late.exit_code == 2 and "layers 0..1" in late.output


class ByteTokenizer:
    """One token per UTF-8 byte, as byte-level BPE splits a rare character: decoding a cut
    character gives U+FFFD."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_highlighted_tokens_keep_multi_byte_characters_whole() -> None:
    from reasonkv.harness.analyze.report import _snippet

    text = "x = t\u2265 0 \U0001f600 ok"
    ids = list(text.encode())
    for pos in range(len(ids)):
        s = _snippet(ByteTokenizer(), ids, pos, 3, 3)
        shown = s["left"] + s["token"] + s["right"]
        assert "\ufffd" not in shown and shown in text, (pos, s)
    ge = text.encode().index("\u2265".encode())
    for pos in range(ge, ge + 3):  # any of the three bytes of ≥ highlights the whole character
        assert _snippet(ByteTokenizer(), ids, pos, 3, 3)["token"] == "\u2265"
    assert _snippet(ByteTokenizer(), ids, ge - 1, 3, 3) == {
        "pos": ge - 1,
        "left": " = ",
        "token": "t",
        "right": "\u2265",
    }


def test_analyze_refuses_a_trace_past_the_models_positions_before_the_weights_load(
    loader, tmp_path, monkeypatch
) -> None:
    config = build_tiny_model("llama").config
    config.max_position_embeddings = 64
    monkeypatch.setattr(analyze_cli, "load_tokenizer_and_config", lambda name: (CharTokenizer(), config))
    traces = tmp_path / "t.jsonl"
    traces.write_text(json.dumps(TRACE_ROW) + "\n")
    args = ["analyze", "--traces", str(traces), "--model", "tiny", "--out", str(tmp_path / "r")]
    result = runner.invoke(analyze_app(), [*args, "--max-tokens", "150"], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    err = " ".join(errors_of(result).split())
    assert f"t.jsonl:1 (trace {TRACE_ROW['id']!r})" in err and "64 positions" in err, err
    assert loader == [], "the weights were loaded although the trace could not be analysed"
