"""The figures of `reasonkv report`: one look per registered method, KL 0 kept off log axes
and named, eval accuracy inside [0, 1] with n and 95 % intervals, the model note."""

from __future__ import annotations

import warnings

import pytest

from reasonkv.harness.replay_plot import default_title, merge_short_tail, plot_fidelity
from reasonkv.harness.report import Section, summarize_results, write_report
from reasonkv.harness.report_plot import (
    METHOD_STYLES,
    _eval_figure,
    _replay_figure,
    is_ours,
    method_styles,
    model_note,
    wilson_interval,
)
from reasonkv.harness.runs import column_edges, plot_head_budgets
from reasonkv.methods.registry import METHODS
from reasonkv.util.plotting import pyplot


def test_every_registered_method_has_its_own_colour_and_marker() -> None:
    assert set(METHODS) <= set(METHOD_STYLES)
    looks = [(s["color"], s["marker"]) for s in METHOD_STYLES.values()]
    assert len(set(looks)) == len(looks)
    assert len({s["color"] for s in METHOD_STYLES.values()}) == len(looks)  # colours alone differ too


def test_styles_are_fixed_ours_thicker_and_knob_settings_dashed() -> None:
    names = ["snapkv[interval=8]", "snapkv[interval=32]", "beaconkv", "my-new-method", "other-new"]
    methods = {"snapkv[interval=8]": "snapkv", "snapkv[interval=32]": "snapkv"}
    styles = method_styles(names, methods)
    assert styles["snapkv[interval=8]"]["color"] == METHOD_STYLES["snapkv"]["color"]
    assert styles["snapkv[interval=8]"]["ls"] != styles["snapkv[interval=32]"]["ls"]
    assert styles["beaconkv"]["lw"] > styles["snapkv[interval=8]"]["lw"] and is_ours("reasonalloc-rkv")
    assert styles["my-new-method"]["color"] != styles["other-new"]["color"]
    assert method_styles(["beaconkv"]) == {"beaconkv": styles["beaconkv"]}  # the same in every figure


def test_wilson_interval() -> None:
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0) and wilson_interval(0, 0) == (0.0, 1.0)


def _replay(method, budget, kl, item="t1", live=100.0):
    n = 100
    return {
        "key": f"{method}{budget}{item}",
        "status": "ok",
        "config": {
            "kind": "replay",
            "model": "smollm2-135m",
            "dataset": "d",
            "item": item,
            "method": method,
            "budget": budget,
            "knobs": {},
        },
        "metrics": {
            "sums": {"n": n, "kl": kl * n, "top1": 90.0, "nll_full": 1.0, "nll": 2.0},
            "live_tokens": live,
        },
    }


def test_kl_zero_is_kept_off_the_log_axes_and_named(tmp_path) -> None:
    records = [_replay("full", None, 0.0, live=1000)]
    for b in (64, 128, 256, 512):
        records += [_replay("snapkv", b, 0.3 * 64 / b, live=b), _replay("beaconkv", b, 0.25 * 64 / b, live=b)]
        records.append(_replay("rpc", b, 0.0 if b == 512 else 0.05, live=2 * b))
    (section,) = summarize_results(records)
    plt = pyplot()
    by_name = {}
    for row in section.rows:
        by_name.setdefault(row["name"], []).append(row)
    fig, axes, caption = _replay_figure(plt, by_name, method_styles(list(by_name)), section)
    ax_mem = axes[0][0]
    assert ax_mem.get_yscale() == "log" and ax_mem.get_ylim()[0] > 0
    rpc_line = [ln for ln in ax_mem.get_lines() if ln.get_label() == "rpc"][0]
    assert list(rpc_line.get_xdata()) == [64, 128, 256]  # the 0 at 512 is not on the line
    assert "rpc@512" in caption and "snapkv" in caption  # named, and the relative panel's reference
    assert [t for t in ax_mem.get_xticks()] == [64, 128, 256, 512]
    plt.close(fig)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = write_report([section], tmp_path, ["x.jsonl"])
    text = paths["markdown"].read_text()
    assert model_note("smollm2-135m") in text and "rpc@512" in text
    assert model_note("m") is None


def test_quantized_methods_share_the_16_bit_peak_axis_as_single_points() -> None:
    """quant-int4 has no budget and a KL above 0: one point at its peak bytes, not the full
    cache's dashed line; the memory axis is the 16-bit peak (fp32 units derived at half)."""

    def with_peak(record, as_run, at16=None):
        record["metrics"]["decode_peak_kv_bytes"] = as_run
        if at16 is not None:
            record["metrics"]["decode_peak_kv_bytes_16bit"] = at16
        return record

    records = [with_peak(_replay("full", None, 0.0, live=1000), 64 * 2**20)]
    records += [with_peak(_replay("snapkv", b, 0.3 * 64 / b, live=b), b * 2**16) for b in (64, 128)]
    records.append(with_peak(_replay("quant-int4", None, 0.02, live=1000), 20 * 2**20, at16=12 * 2**20))
    (section,) = summarize_results(records)
    by_name = {}
    for row in section.rows:
        by_name.setdefault(row["name"], []).append(row)
    plt = pyplot()
    fig, axes, caption = _replay_figure(plt, by_name, method_styles(list(by_name)), section)
    ax_mem = axes[0][0]
    assert "16 bits" in ax_mem.get_xlabel()
    (quant,) = [ln for ln in ax_mem.get_lines() if ln.get_label() == "quant-int4"]
    assert list(quant.get_xdata()) == [12.0] and list(quant.get_ydata()) == [0.02]
    (snap,) = [ln for ln in ax_mem.get_lines() if ln.get_label() == "snapkv"]
    assert list(snap.get_xdata()) == [2.0, 4.0]  # b * 64 KiB as run, half at 16 bits
    dashed = [ln for ln in ax_mem.get_lines() if ln.get_label() == "full (KL 0)"]
    assert len(dashed) == 1 and list(dashed[0].get_xdata()) == [32.0, 32.0]
    assert "Single points" in caption
    plt.close(fig)


def test_eval_accuracy_axis_is_clamped_with_n_and_intervals() -> None:
    rows = []
    for b, p in ((64, 0.0), (128, 0.5), (None, 1.0)):
        rows.append(
            {
                "method": "snapkv" if b else "full",
                "name": "snapkv" if b else "full",
                "budget": b,
                "units": 3,
                "errors": 0,
                "problems": 3,
                "seeds": 2,
                "samples": 6,
                "pass@1": p,
                "mean_length": 10.0,
                "truncation_rate": 0.0,
                "tokens_per_second": 1.0,
            }
        )
    section = Section("eval", "m", "d", rows)
    by_name = {"snapkv": rows[:2], "full": rows[2:]}
    plt = pyplot()
    fig, (ax_acc, _), caption = _eval_figure(plt, by_name, method_styles(list(by_name)), section)
    assert ax_acc.get_ylim() == (0.0, 1.0)
    assert "2 samples × 3 problems" in caption and "Wilson" in caption
    assert len(ax_acc.containers) == 1  # the error bars of snapkv
    plt.close(fig)


# ----------------------------------------------------------------------- replay --plot
def _bin(start, end, n, kl, top1):
    return {"start": start, "end": end, "positions": n, "mean_kl": kl, "top1": top1}


def test_a_short_last_bin_is_merged_into_the_one_before() -> None:
    curve = [_bin(0, 256, 1000, 0.1, 0.9), _bin(256, 512, 1000, 0.2, 0.8), _bin(512, 533, 21, 0.0, 1.0)]
    merged = merge_short_tail(curve)
    assert [(c["start"], c["end"], c["positions"]) for c in merged] == [(0, 256, 1000), (256, 533, 1021)]
    assert merged[-1]["mean_kl"] == pytest.approx(0.2 * 1000 / 1021)
    assert merged[-1]["top1"] == pytest.approx((0.8 * 1000 + 21) / 1021)
    full_tail = curve[:2] + [_bin(512, 768, 600, 0.3, 0.7)]
    assert merge_short_tail(full_tail) == full_tail  # half a bin or more stays its own bin
    assert merge_short_tail([_bin(0, 5, 0, None, None), _bin(5, 9, 3, 0.1, 0.9)]) == [_bin(5, 9, 3, 0.1, 0.9)]


def test_replay_plot_names_model_traces_and_positions(tmp_path) -> None:
    curve = [_bin(0, 256, 1000, 0.1, 0.9), _bin(256, 300, 10, 0.0, 1.0)]
    rows = [
        {"method": m, "budget": b, "label": f"{m}@{b}", "traces": 3, "positions": 1010, "curve": curve}
        for m in ("snapkv", "beaconkv")
        for b in (64, 128)
    ]
    title = default_title(rows, "smollm2-135m")
    assert "smollm2-135m" in title and "3 traces" in title and "1,010 positions" in title
    assert model_note("smollm2-135m") in title
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_fidelity(rows, tmp_path / "f.png", model="smollm2-135m").stat().st_size > 1000


# ----------------------------------------------------------------------- plot budgets
def test_budget_columns_sit_at_their_steps_and_one_event_layers_draw(tmp_path) -> None:
    assert column_edges([100, 150, 250], 40) == [75, 125, 200, 300]  # each column centred on its step
    assert column_edges([200], 40) == [180, 220]  # one compression: a column of the given width
    record = {
        "method": "snapkv",
        "budget": 4,
        "events": [
            {"layer": 0, "seen": 100, "lengths": [4, 4]},
            {"layer": 0, "seen": 150, "lengths": [3, 5]},
            {"layer": 0, "seen": 250, "lengths": [2, 6]},
            {"layer": 1, "seen": 200, "lengths": [4, 4]},  # drew an empty panel and warned before
        ],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "identical low and high xlims" among them
        assert plot_head_budgets(record, tmp_path / "b.png").stat().st_size > 1000
        assert plot_head_budgets(record, tmp_path / "one.png", layers=[1]).stat().st_size > 1000


def test_units_run_in_another_dtype_or_device_get_their_own_section() -> None:
    fp32 = _replay("snapkv", 64, 0.3, live=64)
    bf16 = _replay("snapkv", 64, 0.5, live=64)
    bf16["key"], bf16["config"] = "k-bf16", {**bf16["config"], "dtype": "bfloat16"}
    gpu = _replay("snapkv", 64, 0.4, live=64)
    gpu["key"], gpu["config"] = "k-gpu", {**gpu["config"], "device": "cuda", "dtype": "bfloat16"}
    sections = summarize_results([fp32, bf16, gpu])
    assert {s.model for s in sections} == {"smollm2-135m"}  # its note still found by name
    assert [s.placement for s in sections] == ["", "bfloat16", "cuda, bfloat16"]
    assert sections[2].title == "replay fidelity · smollm2-135m (cuda, bfloat16) · d"
    assert [len(s.rows) for s in sections] == [1, 1, 1]
