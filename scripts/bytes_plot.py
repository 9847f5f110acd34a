"""KL and top-1 against peak K/V bytes per sequence at 16 bits: evicting, quantizing, or both.

Every point is a configuration replayed on the same traces, x its decode-time peak K/V of one
sequence alone with every unquantized value counted at 16 bits (what a bf16/fp16 server holds):
- evict-only at 16 bits: the peak sweep's pooled fidelity, at the alone peaks that
  `scripts/alone_peaks.py` predicts (fp32 bytes, halved: nothing is quantized there);
- everything that stores K/V below 16 bits (kv_bits, the two-tier cache, quant-int*):
  sweeps that replay each trace alone, at their metered 16-bit peaks.

    python scripts/bytes_plot.py --evict docs/results/replay-sweep-peak.jsonl \\
      --alone-peaks docs/results/alone-peaks.json --low-bit docs/results/bytes-sweep-alone.jsonl \\
      --methods beaconkv,h2o --out docs/results/bytes.png --json docs/results/bytes-points.json
    python scripts/bytes_plot.py --curves docs/results/bytes-length-probe.jsonl \
      --out docs/results/bytes-length-probe.png

`--state` also reads every point on per-sequence state (K/V and everything held beside it: slot
indices, query windows, beacon buffers, per-token scores, policy state), at 16-bit pricing:
- evict-only: `alone_peak_state_bytes_16bit` of the `--alone-peaks` file (predicted, exact);
- the low-bit units, recorded before the state meter: per trace, the metered peak K/V plus the
  predicted peak of what the same method, budget and schedule hold beside K/V with every storage
  knob removed (`STORAGE_KNOBS`), on the model in bf16 as `scripts/alone_peaks.py` predicts it,
  plus what the storage holds beside K/V on top of that (quantized storage: pre_rope's position
  offset, fp_sinks' indices; a low tier: an index and a score a slot, counted full). Pooled as
  the K/V. **That is an upper bound, not the peak**: the two peaks need not fall at the same step.
  The beside part is the most held beside K/V at once, which is at least the predicted peak state
  less the predicted peak K/V (6 KiB more for quant-int*, whose K/V peaks at a growth). It bounds
  the meter because the low-bit storage holds beside K/V what the 16-bit schedule does plus that
  extra, step by step, and because the bf16 prediction prices fp32 tensors (H2O's scores, a low
  tier's) at 4 bytes where the meter's 16-bit count prices every float at 2.
`--check-state FILE...` compares that bound with the metered state of units that have it. With
`--state` the plot is drawn on state (the goal: KL <= 0.05, top-1 >= 0.94 at SnapKV@128's state);
`--json` gets `state_16bit_mib` and the evict-only point at that state.

    python scripts/bytes_plot.py --evict docs/results/replay-sweep-peak.jsonl \
      --alone-peaks docs/results/alone-peaks.json --low-bit docs/results/bytes-sweep-alone.jsonl \
      --state --out docs/results/bytes-state.png --json docs/results/bytes-state-points.json
    python scripts/bytes_plot.py --check-state docs/results/report-set.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import torch

from reasonkv.core.models import load_model
from reasonkv.core.quantize import KVFormat
from reasonkv.harness.bench.capacity import alone_peaks, at_16_bits, storage_extra
from reasonkv.harness.report import load_records, summarize_results
from reasonkv.util.plotting import pyplot, save_figure

MIB = 2**20


def _label(row: dict) -> str:
    knobs = ",".join(f"{k}={v}" for k, v in sorted(row.get("knobs", {}).items()))
    return f"{row['method']}[{knobs}]" if knobs else row["method"]


SHORT = {
    "kv_bits": lambda v: f"{v}-bit",
    "group_size": lambda v: f"g{v}",
    "value_group_size": lambda v: f"vg{v}",
    "residual": lambda v: f"r{v}",
    "fp_sinks": lambda v: "sink" if v == 1 else f"{v} sinks",
    "pre_rope": lambda v: "pre-RoPE" if v else "",
    "hadamard": lambda v: "Hadamard" if v else "",
    "fraction": lambda v: f"evict 1/{1 / v:g}" if (1 / v).is_integer() else f"evict {v:g}",
}
"""Legend names of storage and schedule knobs (the legend would be wider than the plots)."""


def _legend(family: str) -> str:
    """A family's name with its knobs abbreviated: beaconkv[fp_sinks=1,kv_bits=4] -> beaconkv [4-bit sink]."""
    head, sep, rest = family.partition("[")
    if not sep:
        return family
    knobs, _, tail = rest.partition("]")
    parts = []
    for pair in knobs.split(","):
        k, _, v = pair.partition("=")
        value = {"True": True, "False": False}.get(v, v)
        if k in SHORT:
            value = float(v) if k == "fraction" else int(v) if v.isdigit() else value
            parts.append(SHORT[k](value))
        else:
            parts.append(pair)
    return f"{head} [{' '.join(p for p in parts if p)}]{tail}"


def _family(row: dict) -> str:
    """Which curve a point belongs to: a method under one knob setting, budgets along it. A
    two-tier cache's low budget is a multiple of its budget here, so the curve is keyed by
    that multiple, its bits and its other knobs."""
    knobs = dict(row.get("knobs", {}))
    low = knobs.pop("low_budget", 0)
    if not low:
        return _label(row)
    bits = knobs.pop("low_bits", KVFormat().low_bits)
    ratio = low / row["budget"] if row.get("budget") else None
    size = f"{ratio:g}x its budget" if ratio else f"{low} tokens"
    return f"{_label({'method': row['method'], 'knobs': knobs})} + a {bits}-bit tier of {size}"


def _rows(path: Path) -> list[dict]:
    records, _ = load_records([path])
    return _summarized(records)


def _summarized(records: list[dict]) -> list[dict]:
    return [row for section in summarize_results(records) for row in section.rows]


BOUND = (
    "an upper bound of the peak state: the metered peak K/V plus the predicted peak of what is "
    "held beside it, two peaks that need not fall at the same step"
)


class BesidePredictor:
    """What a replay unit held beside its K/V at most while decoding, at 16-bit pricing, predicted
    from the schedule (`capacity.alone_peaks`, the model loaded in bf16 as `scripts/alone_peaks.py`
    loads it: tensors kept in fp32 by design, such as H2O's scores, at their 4 bytes): the same
    method, budget and schedule knobs with every storage knob (`STORAGE_KNOBS`) removed, plus
    what its storage holds beside K/V that 16-bit storage does not (`storage_extra`)."""

    def __init__(self) -> None:
        self._models: dict[str, torch.nn.Module] = {}
        self._memo: dict[tuple, int] = {}

    def model(self, name: str) -> torch.nn.Module:
        if name not in self._models:
            self._models[name] = load_model(name, device="cpu", dtype="bfloat16")[0]
        return self._models[name]

    def beside(self, unit: dict) -> int:
        """Bytes: the per-sequence beside peak, the cache's own (budgets, fed ids) and the
        storage's extra. A ValueError says why the schedule cannot be followed."""
        c, m = unit["config"], unit["metrics"]
        prompt, n = m["prompt_len"], m["tokens"] - 1 - m["prompt_len"]
        plain = at_16_bits(c["method"], c.get("knobs", {}))
        key = (c["model"], c["method"], c.get("budget"), json.dumps(plain, sort_keys=True), prompt, n)
        if key not in self._memo:
            peaks = alone_peaks(self.model(c["model"]), c["method"], c.get("budget"), plain, prompt, n)
            self._memo[key] = peaks.beside + peaks.own
        return self._memo[key] + storage_extra(self.model(c["model"]), c["method"], c.get("knobs", {}))

    def bound(self, unit: dict) -> float | None:
        """The unit's state bound (`BOUND`) at 16 bits, or None (no 16-bit K/V peak recorded)."""
        kv = unit["metrics"].get("decode_peak_kv_bytes_16bit")
        return None if kv is None else kv + self.beside(unit)


def state_rows(path: Path, predictor: BesidePredictor) -> list[float | None]:
    """Per row of `_rows(path)`: its state bound (`BOUND`) in bytes, pooled over traces as the
    row's `peak_kv_bytes_16bit` is (summarize_results on copies of the units whose 16-bit K/V
    peak is their bound); None where a unit's schedule cannot be followed."""
    records, _ = load_records([path])
    bounded = []
    for unit in records:
        unit = copy.deepcopy(unit)
        if unit.get("status") == "ok" and unit.get("kind") == "replay":
            try:
                bound = predictor.bound(unit)
            except ValueError:
                bound = None
            unit["metrics"]["decode_peak_kv_bytes_16bit"] = bound
            unit["metrics"]["decode_peak_kv_bytes"] = None  # no fallback to the fp32 K/V
        bounded.append(unit)
    return [row.get("peak_kv_bytes_16bit") for row in _summarized(bounded)]


def check_state(paths: list[Path], predictor: BesidePredictor) -> None:
    """Every unit of `paths` with a metered 16-bit peak state, against its bound."""
    records, _ = load_records(paths)
    print(f"bound = {BOUND}; ratio = bound / metered (at least 1: the bound holds)")
    ratios, batched = [], 0
    for unit in records:
        c, m = unit["config"], unit["metrics"]
        if unit.get("status") != "ok" or m.get("decode_peak_state_bytes_16bit") is None:
            continue
        if m.get("batch_rows", 1) > 1:  # a batched row's meter is the batch's share, not one alone
            batched += 1
            continue
        kv, metered = m["decode_peak_kv_bytes_16bit"], m["decode_peak_state_bytes_16bit"]
        try:
            bound = predictor.bound(unit)
        except ValueError as err:
            print(f"{c['method']}@{c.get('budget')} {c['item']}: no bound ({err})")
            continue
        if bound is None:
            continue
        ratios.append(bound / metered)
        print(
            f"{c['method']}@{c.get('budget')} {c['item']:<44} prompt {m['prompt_len']:>3}  K/V {kv:>9.0f}  "
            f"state {metered:>9.0f}  beside: metered {metered - kv:>8.0f} predicted {bound - kv:>8.0f}  "
            f"bound {bound:>9.0f}  ratio {ratios[-1]:.4f}"
        )
    if ratios:
        print(f"{len(ratios)} units: ratio {min(ratios):.4f} to {max(ratios):.4f}")
    if batched:
        print(f"left out: {batched} units replayed in a batch (their meter is not one sequence alone)")


def alone_peaks_16bit(path: Path) -> dict[tuple[str, int], float]:
    """(method, budget) -> peak bytes of one sequence alone at 16 bits, for the unquantized,
    default-knob rows of `scripts/alone_peaks.py --out` (fp32 bytes there, so halved)."""
    rows = json.loads(path.read_text())["rows"]
    return {
        (r["method"], r["budget"]): r["alone_peak_kv_bytes"] / 2
        for r in rows
        if not r["knobs"] and r.get("alone_peak_kv_bytes") is not None
    }


def alone_states_16bit(path: Path) -> dict[tuple[str, int], float]:
    """(method, budget) -> predicted peak state of one sequence alone at 16 bits (bf16 model),
    for the default-knob rows of `scripts/alone_peaks.py --out` that have it."""
    rows = json.loads(path.read_text())["rows"]
    return {
        (r["method"], r["budget"]): r["alone_peak_state_bytes_16bit"]
        for r in rows
        if not r["knobs"] and r.get("alone_peak_state_bytes_16bit") is not None
    }


def points(
    evict: Path,
    peaks: dict[tuple[str, int], float],
    low_bit: Path,
    methods: list[str],
    states: dict[tuple[str, int], float] | None = None,
    predictor: BesidePredictor | None = None,
) -> list[dict]:
    """The plot's points; with `states` (evict-only) and `predictor` (the low-bit units) each
    also has `state_16bit_mib`: evict-only predicted, the low-bit units' bound (`BOUND`)."""
    out = []
    evicted = [row for row in _rows(evict) if row["method"] in methods and not row.get("knobs")]
    full = max((row["traces"] for row in evicted), default=0)
    for row in evicted:
        key = (row["method"], row.get("budget"))
        if key in peaks:
            pt = {**_point(row), "peak_16bit_mib": peaks[key] / MIB, "family": f"{row['method']} (16-bit)"}
            if states is not None:
                pt["state_16bit_mib"] = states[key] / MIB if key in states else None
                pt["state_16bit_is"] = "predicted (scripts/alone_peaks.py)"
            out.append(pt)
    rows = _rows(low_bit)
    bounds = state_rows(low_bit, predictor) if predictor is not None else [None] * len(rows)
    for row, bound in zip(rows, bounds, strict=True):
        if row.get("peak_kv_bytes_16bit") is None:
            continue
        if row["traces"] < full:  # a sweep still running: its mean is not comparable yet
            print(f"left out (partial: {row['traces']} of {full} traces): {_label(row)}@{row.get('budget')}")
            continue
        pt = {**_point(row), "peak_16bit_mib": row["peak_kv_bytes_16bit"] / MIB, "family": _family(row)}
        if predictor is not None:
            pt["state_16bit_mib"] = None if bound is None else bound / MIB
            pt["state_16bit_is"] = BOUND
        out.append(pt)
    return out


def _point(row: dict) -> dict:
    return {
        "label": _label(row),
        "budget": row.get("budget"),
        "traces": row["traces"],
        "mean_kl": row["mean_kl"],
        "top1": row["top1"],
    }


def evict_only_at(pts: list[dict], mib: float, axis: str = "peak_16bit_mib") -> dict | None:
    """The best evict-only (16-bit) point at `mib` of `axis` (peak K/V, or `state_16bit_mib`):
    per method, KL interpolated log-log and top-1 linearly in log memory between its two nearest
    budgets (past its last two: extrapolated, and said so); the method with the lowest KL wins."""
    best = None
    for fam in {p["family"] for p in pts if p["family"].endswith("(16-bit)")}:
        mine = sorted(
            (p for p in pts if p["family"] == fam and p.get(axis) is not None), key=lambda p: p[axis]
        )
        if len(mine) < 2 or mib < mine[0][axis]:
            continue
        i = next((i for i in range(len(mine) - 1) if mib <= mine[i + 1][axis]), len(mine) - 2)
        a, b = mine[i], mine[i + 1]
        t = math.log(mib / a[axis]) / math.log(b[axis] / a[axis])
        kl = math.exp(math.log(a["mean_kl"]) + t * (math.log(b["mean_kl"]) - math.log(a["mean_kl"])))
        top1 = a["top1"] + t * (b["top1"] - a["top1"])
        if best is None or kl < best["mean_kl"]:
            best = {"method": fam.split(" ")[0], "mean_kl": kl, "top1": top1, "extrapolated": t > 1}
    return best


def goal_bytes(peaks: dict[tuple[str, int], float]) -> float | None:
    """The issue's reference memory: SnapKV@128's peak alone, at 16 bits (MiB)."""
    peak = peaks.get(("snapkv", 128))
    return None if peak is None else peak / MIB


def plot(
    pts: list[dict],
    out: Path,
    goal_mib: float | None = None,
    axis: str = "peak_16bit_mib",
    goal: tuple[float, float] = (0.07, 0.94),
) -> Path:
    """KL and top-1 of every point against `axis` (peak K/V, or `state_16bit_mib`), with the
    goal's levels (KL, top-1) at `goal_mib`."""
    plt = pyplot()
    fig, (ax_kl, ax_top1) = plt.subplots(1, 2, figsize=(12, 6.4))
    families = list(dict.fromkeys(p["family"] for p in pts))
    colors = plt.get_cmap("tab20").colors  # more curves than the default cycle's 10 colours
    for i, fam in enumerate(families):
        mine = sorted(
            (p for p in pts if p["family"] == fam and p.get(axis) is not None), key=lambda p: p[axis]
        )
        x = [p[axis] for p in mine]
        style = {
            "marker": "os^Dv"[i % 5],
            "color": colors[(2 * i) % 20 + (2 * i) // 20 % 2],
            "linestyle": "-" if len(mine) > 1 else "none",
            "label": _legend(fam),
        }
        ax_kl.plot(x, [p["mean_kl"] for p in mine], **style)
        ax_top1.plot(x, [p["top1"] for p in mine], **style)
    if goal_mib is not None:  # the goal: KL and top-1 levels at SnapKV@128's memory
        for ax, level in zip((ax_kl, ax_top1), goal, strict=True):
            ax.axvline(goal_mib, color="grey", linestyle=":", linewidth=1)
            ax.axhline(level, color="grey", linestyle=":", linewidth=1)
            ax.annotate(
                "goal at snapkv@128's " + ("memory" if axis == "peak_16bit_mib" else "state"),
                (goal_mib, level),
                fontsize=7,
                color="grey",
                xytext=(4, 4),
                textcoords="offset points",
            )
    for ax in (ax_kl, ax_top1):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(
            "peak K/V per sequence, MiB at 16 bits (one trace alone)"
            if axis == "peak_16bit_mib"
            else "peak state per sequence, MiB at 16 bits, one trace alone\n"
            "(evict-only predicted; the rest a bound: metered K/V + predicted beside)"
        )
        ax.grid(alpha=0.3, which="both")
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("mean KL(full ‖ method), nats")
    ax_top1.set_ylabel("top-1 agreement with the full cache")
    fig.legend(*ax_kl.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7, frameon=False)
    traces = sorted({p["traces"] for p in pts})
    fig.suptitle(
        "Evict, quantize, or both: SmolLM2-135M (not a reasoning model) reading "
        f"{'/'.join(map(str, traces))} reasoning traces, 2,048 tokens",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.2, 1, 1))  # the legend below both plots
    return save_figure(fig, out)


def curves(path: Path, out: Path) -> Path:
    """KL per position bin, pooled over traces, one line per method × budget: where a budget
    starts to bind, eviction's KL rises; quantization's stays level and its bytes grow."""
    records, _ = load_records([path])
    pooled: dict[str, dict[int, list[float]]] = {}
    for r in records:
        if r.get("status") != "ok" or r["config"]["method"] == "full":
            continue
        c = r["config"]
        name = c["method"] if c.get("budget") is None else f"{c['method']}@{c['budget']}"
        for b in r["metrics"]["curve"]:  # bins share their starts; a trace's last one ends early
            kl_sum, n = pooled.setdefault(name, {}).setdefault(b["start"], [0.0, 0])
            pooled[name][b["start"]] = [kl_sum + b["mean_kl"] * b["positions"], n + b["positions"]]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, bins in pooled.items():
        starts = sorted(bins)
        ax.plot(
            starts, [bins[x][0] / bins[x][1] for x in starts], marker="o", label=name, drawstyle="steps-post"
        )
    ax.set_yscale("log")
    ax.set_xlabel("trace position (start of each bin, prompt included)")
    ax.set_ylabel("mean KL(full ‖ method) in the bin, nats")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    traces = len({r["config"]["item"] for r in records})
    ax.set_title(f"Along the chain: SmolLM2-135M (not a reasoning model), {traces} traces", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--evict", type=Path, help="the peak sweep (evict-only, 16 bits)")
    p.add_argument("--alone-peaks", type=Path, help="scripts/alone_peaks.py --out JSON")
    p.add_argument("--low-bit", type=Path, help="sweep of low-bit units, each trace alone")
    p.add_argument("--curves", type=Path, help="instead: KL along the chain of this sweep's units")
    p.add_argument("--methods", default="beaconkv,h2o", help="evict-only methods to draw")
    p.add_argument("--out", type=Path, default=Path("bytes.png"))
    p.add_argument("--json", type=Path, default=None, help="also write the points here")
    p.add_argument(
        "--state",
        action="store_true",
        help="also read every point on per-sequence state at 16 bits (the low-bit units: an upper "
        "bound) in the printed table, --json and the plot",
    )
    p.add_argument(
        "--check-state",
        type=Path,
        nargs="+",
        help="instead: these units' metered peak state against the bound",
    )
    args = p.parse_args()
    if args.curves is not None:
        print("plot ->", curves(args.curves, args.out))
        return
    if args.check_state:
        check_state(args.check_state, BesidePredictor())
        return
    if None in (args.evict, args.alone_peaks, args.low_bit):
        p.error("--evict, --alone-peaks and --low-bit are needed (or --curves, --check-state)")
    peaks = alone_peaks_16bit(args.alone_peaks)
    states = alone_states_16bit(args.alone_peaks) if args.state else None
    predictor = BesidePredictor() if args.state else None
    pts = points(args.evict, peaks, args.low_bit, args.methods.split(","), states, predictor)
    if args.state:
        print(f"state: evict-only predicted; the rest {BOUND}")
    for pt in sorted(pts, key=lambda q: (q["family"], q["peak_16bit_mib"])):
        line = (
            f"{pt['family']:<46} {pt['label']:<40} {pt['budget']!s:>5} {pt['peak_16bit_mib']:6.2f} MiB "
            f"KL {pt['mean_kl']:.4f} top-1 {pt['top1']:.3f} ({pt['traces']} traces)"
        )
        evicts = pt["family"].endswith("(16-bit)")
        ref = None if evicts else evict_only_at(pts, pt["peak_16bit_mib"])
        if ref is not None:
            pt["evict_only_there"] = ref
            line += (
                f"; best evict-only there{' (extrapolated)' if ref['extrapolated'] else ''}: "
                f"{ref['method']} {ref['mean_kl']:.4f} / {ref['top1']:.3f}, "
                f"KL {100 * (pt['mean_kl'] / ref['mean_kl'] - 1):+.0f} %"
            )
        if args.state:
            state = pt["state_16bit_mib"]
            line += f"; state {'-' if state is None else f'{state:.2f}'}{'' if evicts else ' (bound)'} MiB"
            at = None if evicts or state is None else evict_only_at(pts, state, "state_16bit_mib")
            if at is not None:
                pt["evict_only_at_state"] = at
                line += (
                    f", best evict-only at that state{' (extrapolated)' if at['extrapolated'] else ''}: "
                    f"{at['method']} {at['mean_kl']:.4f} / {at['top1']:.3f}, "
                    f"KL {100 * (pt['mean_kl'] / at['mean_kl'] - 1):+.0f} %"
                )
        print(line)
    if args.state:  # issue 28's goal: KL <= 0.05 and top-1 >= 0.94 at SnapKV@128's state
        snap = states.get(("snapkv", 128))
        goal_mib = None if snap is None else snap / MIB
        print("plot ->", plot(pts, args.out, goal_mib, "state_16bit_mib", (0.05, 0.94)))
    else:
        print("plot ->", plot(pts, args.out, goal_bytes(peaks)))
    if args.json:
        args.json.write_text(json.dumps(pts, indent=1) + "\n")


if __name__ == "__main__":
    main()
