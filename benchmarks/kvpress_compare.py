"""kvpress's decode-time SnapKV next to reasonkv's, on the same model, tokens and budget.

kvpress 0.5.5 needs transformers < 5.3 and reasonkv needs >= 5.20 (under 5.2.0 its cache
layer is abstract: `get_max_cache_shape` is missing, and 5.2.0 does not hand the attention
kwargs to `cache.update`). So the two sides run in two processes, each in its own venv, on
identical token streams:

1. `--role reasonkv` (the main venv): tokenizes the traces (chat template, as `reasonkv
   replay`), then teacher-forces them token by token through the full cache and each of
   our methods (`--ours`, default snapkv) at budget `--target`, interval `--interval`
   (`--ours beaconkv:budget=208` gives one method its own budget).
2. `--role kvpress` (the kvpress venv): the same token ids, token by token, with explicit
   absolute `position_ids` as kvpress's own pipeline passes them, through a DynamicCache
   with no press and with `DecodingPress(SnapKVPress(), compression_interval, target_size)`
   (plus `--presses`: `snapkv-own-rope`, SnapKV whose buffered queries get their own RoPE
   positions, to price kvpress's use of the current step's position for all of them;
   `streaming`, `knorm`).

Each side measures against its own full cache: per trace position (a fed trace token
predicting the next) KL(full ‖ method) and top-1 agreement, decode tokens/s, and physical
K/V bytes after every step. The full caches of both sides are compared too (they should
agree up to float noise: same GGUF weights, different transformers versions).

    python benchmarks/kvpress_compare.py --setup       # once: build/kvpress-venv
    .venv/bin/python benchmarks/kvpress_compare.py --out kvpress_compare.json
    python benchmarks/kvpress_compare.py --dry-run     # print the plan only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reasonkv.core.hf_compat import cache_arg

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / "build" / "kvpress-venv"
DEFAULT_TRACES = ROOT.parent / "shared" / "data" / "traces" / "mip_overthinking_math500.jsonl"
REQUIREMENTS = Path(__file__).with_name("requirements-kvpress.txt")
PRESSES = ("snapkv", "snapkv-own-rope", "streaming", "knorm")


# ------------------------------------------------------------------ shared arithmetic
def fidelity(ref_logp, ref_argmax, logits):
    """Per position: KL(ref ‖ other) from the reference's log-probs [k, V] and the other's
    logits [k, V], and top-1 agreement. The same formula as reasonkv.harness.replay (both
    venvs run this one function)."""
    import torch

    logq = torch.log_softmax(logits.to(ref_logp.dtype), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - logq)).sum(-1).clamp(min=0.0)
    return kl, ref_argmax == logits.argmax(-1)


def teacher_force(forward, ids, prompt_len: int, kv_bytes, on_logits) -> dict:
    """Prefill the prompt, then feed trace tokens one per forward; `forward(ids, start)` runs
    one forward of ids [1, q] starting at absolute position `start` and returns the last
    logits [V]; `on_logits(i, logits)` gets position i's logits (token prompt_len + i fed).
    Returns step times and K/V bytes (sampled after every step, outside the timing)."""
    import torch

    n = int(ids.shape[1])
    with torch.no_grad():
        forward(ids[:, :prompt_len], 0)
        seconds, stored = [], []
        for i, p in enumerate(range(prompt_len, n - 1)):
            start = time.perf_counter()
            logits = forward(ids[:, p : p + 1], p)
            seconds.append(time.perf_counter() - start)
            stored.append(kv_bytes())
            on_logits(i, logits)
    return {
        "steps": len(seconds),
        "seconds": sum(seconds),
        "kv_bytes_mean": sum(b for b, _ in stored) / max(1, len(stored)),
        "kv_bytes_peak": max((b for b, _ in stored), default=0),
        "kv_bytes_last": stored[-1][0] if stored else 0,
        "live_tokens_mean": sum(t for _, t in stored) / max(1, len(stored)),
    }


class Recorder:
    """Collects one run's per-position numbers on one trace (`teacher_force`'s on_logits)."""

    def __init__(self, ids, prompt_len: int, ref_logp: list | None, ref_argmax):
        import torch

        positions = int(ids.shape[1]) - 1 - prompt_len
        self.targets = ids[0, prompt_len + 1 :]
        self.ref_logp, self.ref_argmax = ref_logp, ref_argmax  # None: this is the full run
        self.logp: list = []
        self.kl = torch.zeros(positions, dtype=torch.float64)
        self.top1 = torch.ones(positions, dtype=torch.bool)
        self.argmax = torch.zeros(positions, dtype=torch.long)
        self.nll = torch.zeros(positions, dtype=torch.float64)

    def __call__(self, i: int, logits) -> None:
        import torch

        logits = logits.float()
        logp = torch.log_softmax(logits, -1)
        self.argmax[i] = int(logits.argmax())
        self.nll[i] = -float(logp[int(self.targets[i])])
        if self.ref_logp is None:
            self.logp.append(logp)
            return
        kl, agree = fidelity(self.ref_logp[i][None], self.ref_argmax[i : i + 1], logits[None])
        self.kl[i], self.top1[i] = float(kl[0]), bool(agree[0])


def run_side(prefix: str, ids_list, prompt_lens, runs, make_forward) -> list[dict]:
    """For each trace: the full run first (its log-probs are the reference), then every run.
    `make_forward(run)` -> (forward, kv_bytes, cleanup) for a fresh cache of that run."""
    results = []
    for t, (ids, prompt_len) in enumerate(zip(ids_list, prompt_lens, strict=True)):
        positions = int(ids.shape[1]) - 1 - prompt_len
        reference: Recorder | None = None
        for run in runs:
            is_full = run["name"] == "full"
            forward, kv_bytes, cleanup = make_forward(run)
            rec = Recorder(
                ids, prompt_len, None if is_full else reference.logp, None if is_full else reference.argmax
            )
            stats = teacher_force(forward, ids, prompt_len, kv_bytes, rec)
            extra = cleanup()
            if is_full:
                reference = rec
            row = {
                "trace": t,
                "run": run["name"],
                "label": run["label"],
                "positions": positions,
                "kl_sum": float(rec.kl.sum()),
                "top1_sum": int(rec.top1.sum()),
                "tokens_per_second": stats["steps"] / max(stats["seconds"], 1e-12),
                **stats,
                **extra,
            }
            if is_full:
                row["argmax"] = rec.argmax.tolist()
                row["nll"] = rec.nll.tolist()
            results.append(row)
            print(
                f"[{prefix}] trace {t + 1}/{len(ids_list)} {run['label']}: {positions} positions, "
                f"mean KL {row['kl_sum'] / positions:.4f}, top-1 {row['top1_sum'] / positions:.3f}, "
                f"{row['tokens_per_second']:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    return results


def summarize(rows: list[dict]) -> list[dict]:
    """Pool the traces per run: every position weighs the same."""
    out: dict[str, dict] = {}
    for r in rows:
        zero = {"positions": 0, "kl": 0.0, "top1": 0, "steps": 0, "seconds": 0.0, "compressions": 0}
        zero.update(kv_mean_weighted=0.0, kv_peak=0, live_weighted=0.0)
        s = out.setdefault(r["label"], {"label": r["label"], "run": r["run"], **zero})
        s["positions"] += r["positions"]
        s["kl"] += r["kl_sum"]
        s["top1"] += r["top1_sum"]
        s["steps"] += r["steps"]
        s["seconds"] += r["seconds"]
        s["kv_mean_weighted"] += r["kv_bytes_mean"] * r["steps"]
        s["live_weighted"] += r["live_tokens_mean"] * r["steps"]
        s["kv_peak"] = max(s["kv_peak"], r["kv_bytes_peak"])
        s["compressions"] += r.get("compressions", 0)
    rows_out = []
    for s in out.values():
        rows_out.append(
            {
                "label": s["label"],
                "run": s["run"],
                "positions": s["positions"],
                "mean_kl": s["kl"] / max(1, s["positions"]),
                "top1": s["top1"] / max(1, s["positions"]),
                "tokens_per_second": s["steps"] / max(s["seconds"], 1e-12),
                "kv_bytes_mean": s["kv_mean_weighted"] / max(1, s["steps"]),
                "kv_bytes_peak": s["kv_peak"],
                "live_tokens_mean": s["live_weighted"] / max(1, s["steps"]),
                "compressions": s["compressions"],
            }
        )
    return rows_out


# ------------------------------------------------------------------------- our side
def worker_reasonkv(job: dict, result_path: Path) -> None:
    import torch
    import transformers

    from reasonkv.core.models import BUNDLED_GGUF, bundled_gguf_path, load_model
    from reasonkv.harness.bench import cache_bytes
    from reasonkv.harness.traces import load_traces, replay_input
    from reasonkv.methods.api import make_cache
    from reasonkv.util.runtime import quiet_loading

    torch.set_num_threads(job["threads"])
    with quiet_loading():
        model, tokenizer = load_model(job["model"])
    gguf = str(bundled_gguf_path(job["model"])) if job["model"] in BUNDLED_GGUF else job["model"]
    rows = load_traces(job["traces"], limit=job["limit"], variant=job["variant"])
    inputs = [replay_input(tokenizer, r, job["max_tokens"]) for r in rows]
    runs = [{"name": "full", "label": "full", "method": "full", "knobs": {}}]
    for spec in job["ours"]:
        method, _, rest = spec.partition(":")
        knobs = {"interval": job["interval"]} if method in ("snapkv", "rkv", "pyramidkv") else {}
        for item in filter(None, rest.split(":")):
            key, _, value = item.partition("=")
            knobs[key] = _auto(value)
        budget = knobs.pop("budget", job["target"])  # e.g. to match kvpress's mean live tokens
        runs.append(
            {"name": spec, "label": f"reasonkv {spec}", "method": method, "knobs": knobs, "budget": budget}
        )

    def make_forward(run):
        budget = None if run["method"] == "full" else run["budget"]
        cache = make_cache(model, run["method"], budget, **run["knobs"])

        def forward(ids, start):
            return model(input_ids=ids, **cache_arg(cache), logits_to_keep=1).logits[0, -1]

        def kv_bytes():
            kv, _ = cache_bytes(cache)
            live = [layer.n_valid.double().mean() for layer in cache.layers if layer.is_initialized]
            return kv, float(sum(live) / max(1, len(live)))

        def cleanup():
            mem = cache.memory()
            return {"compressions": len(cache.events), "physical_bytes_last": int(mem["physical_bytes"])}

        return forward, kv_bytes, cleanup

    results = run_side(
        "reasonkv", [i.input_ids for i in inputs], [i.prompt_len for i in inputs], runs, make_forward
    )
    out = {
        "side": "reasonkv",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version,
        },
        "threads": torch.get_num_threads(),
        "gguf": gguf,
        "traces": [{"id": i.id, "prompt_len": i.prompt_len, "ids": i.input_ids[0].tolist()} for i in inputs],
        "runs": runs,
        "results": results,
    }
    result_path.write_text(json.dumps(out))


def _auto(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


# ------------------------------------------------------------------------ kvpress side
def worker_kvpress(job: dict, tokens_path: Path, result_path: Path) -> None:
    import kvpress
    import torch
    import transformers
    from kvpress import DecodingPress, KnormPress, SnapKVPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM, DynamicCache

    class SnapKVOwnPositions(SnapKVPress):
        """SnapKVPress whose buffered window queries are rotated to their own positions.

        Stock decode-time SnapKV recomputes the window's queries from buffered hidden states
        and rotates them with `kwargs["position_embeddings"]`: during decoding that is the
        current step's single position, broadcast to all `window_size` queries. Here the
        queries of the last `window_size` steps get positions now - window_size + 1 .. now."""

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            if attentions is None and kwargs.get("position_ids") is not None:
                w = self.window_size
                now = kwargs["position_ids"][:, -1:]
                positions = now - torch.arange(w - 1, -1, -1, device=now.device)
                cos, sin = module.rotary_emb(hidden_states[:, -w:], positions)
                kwargs = {**kwargs, "position_embeddings": (cos, sin)}
            return super().score(module, hidden_states, keys, values, attentions, kwargs)

    bases = {
        "snapkv": SnapKVPress,
        "snapkv-own-rope": SnapKVOwnPositions,
        "streaming": StreamingLLMPress,
        "knorm": KnormPress,
    }
    torch.set_num_threads(job["threads"])
    transformers.utils.logging.disable_progress_bar()
    data = json.loads(tokens_path.read_text())
    gguf = Path(data["gguf"])
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    ids_list = [torch.tensor([t["ids"]]) for t in data["traces"]]
    prompt_lens = [t["prompt_len"] for t in data["traces"]]
    runs = [{"name": "full", "label": "full"}]
    runs += [{"name": p, "label": f"kvpress DecodingPress({bases[p].__name__})"} for p in job["presses"]]

    def make_forward(run):
        cache = DynamicCache()
        press = None
        if run["name"] != "full":
            press = DecodingPress(
                base_press=bases[run["name"]](),
                compression_interval=job["interval"],
                target_size=job["target"],
            )
        context = press(model) if press is not None else None
        if context is not None:
            context.__enter__()
        counts = {"compressions": 0}
        if press is not None:
            original = press.compress

            def counted(*args, **kwargs):
                counts["compressions"] += 1
                return original(*args, **kwargs)

            press.compress = counted

        def forward(ids, start):
            positions = torch.arange(start, start + ids.shape[1])[None]
            return model(
                input_ids=ids, past_key_values=cache, position_ids=positions, logits_to_keep=1
            ).logits[0, -1]

        def kv_bytes():
            total, tokens = 0, 0
            for layer in cache.layers:
                if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                    continue
                total += layer.keys.numel() * layer.keys.element_size()
                total += layer.values.numel() * layer.values.element_size()
                tokens += layer.keys.shape[-2]
            return total, tokens / max(1, len(cache.layers))

        def cleanup():
            if context is not None:
                context.__exit__(None, None, None)
            return dict(counts)

        return forward, kv_bytes, cleanup

    results = run_side("kvpress", ids_list, prompt_lens, runs, make_forward)
    out = {
        "side": "kvpress",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress"),
            "python": sys.version,
        },
        "threads": torch.get_num_threads(),
        "runs": runs,
        "results": results,
    }
    result_path.write_text(json.dumps(out))


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


# ----------------------------------------------------------------------------- driver
def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def setup_commands(venv: Path) -> list[list[str]]:
    pip = [str(venv_python(venv)), "-m", "pip", "install", "-q"]
    torch_pin = next(
        (line.strip() for line in REQUIREMENTS.read_text().splitlines() if line.startswith("torch")), "torch"
    )
    return [
        [sys.executable, "-m", "venv", str(venv)],
        pip + [torch_pin],  # the CPU wheel first, so kvpress does not pull another build
        pip + ["-r", str(REQUIREMENTS)],
    ]


def default_main_python() -> str:
    local = ROOT / ".venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    return str(local) if local.exists() else sys.executable


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    p.add_argument("--variant", default="well_posed")
    p.add_argument("--limit", type=int, default=3, help="first N traces of the variant")
    p.add_argument("--max-tokens", type=int, default=1024, help="prompt + trace tokens per trace")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--target", type=int, default=128, help="tokens kept per head (our budget)")
    p.add_argument("--interval", type=int, default=128, help="decode steps between compressions")
    p.add_argument(
        "--ours",
        default="snapkv",
        help="our methods, comma-separated; knobs as method:key=value:key=value (interval is --interval; "
        "budget=N replaces --target for that method)",
    )
    p.add_argument("--presses", default="snapkv,snapkv-own-rope", help=f"kvpress bases of {PRESSES}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the kvpress venv")
    p.add_argument("--python", default=None, help="python of the reasonkv venv (default: .venv)")
    p.add_argument("--out", type=Path, default=Path("kvpress_compare.json"))
    p.add_argument("--setup", action="store_true", help="create the kvpress venv if it is missing")
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    p.add_argument(
        "--role", choices=("driver", "reasonkv", "kvpress"), default="driver", help=argparse.SUPPRESS
    )
    p.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ours = [x.strip() for x in args.ours.split(",") if x.strip()]
    args.presses = [x.strip() for x in args.presses.split(",") if x.strip()]
    unknown = sorted(set(args.presses) - set(PRESSES))
    if unknown:
        p.error(f"unknown press(es) {', '.join(unknown)}; choose from {', '.join(PRESSES)}")
    return args


def job_of(args: argparse.Namespace) -> dict:
    return {
        "traces": str(args.traces),
        "variant": args.variant,
        "limit": args.limit,
        "max_tokens": args.max_tokens,
        "model": args.model,
        "target": args.target,
        "interval": args.interval,
        "ours": args.ours,
        "presses": args.presses,
        "threads": args.threads,
    }


def print_table(summary: list[dict], cross: dict) -> None:
    def mib(x: float) -> str:
        return f"{x / 2**20:.2f}"

    header = f"{'run':<46} {'mean KL':>8} {'top-1':>6} {'tok/s':>6} {'× full':>6} "
    header += f"{'KV MiB':>7} {'peak':>6} {'live':>6}"
    print(header)
    print("-" * len(header))
    for side in ("reasonkv", "kvpress"):
        rows = [r for r in summary if r["side"] == side]
        full = next(r for r in rows if r["run"] == "full")
        for r in rows:
            label = r["label"] if r["run"] != "full" else f"{side} full ({r['transformers']})"
            print(
                f"{label:<46} {r['mean_kl']:>8.4f} {r['top1']:>6.3f} {r['tokens_per_second']:>6.1f} "
                f"{r['tokens_per_second'] / full['tokens_per_second']:>6.2f} {mib(r['kv_bytes_mean']):>7} "
                f"{mib(r['kv_bytes_peak']):>6} {r['live_tokens_mean']:>6.0f}"
            )
    print(
        f"full vs full across venvs: top-1 {cross['argmax_agreement']:.4f}, "
        f"max |ΔNLL| {cross['max_abs_nll_diff']:.2e}, mean |ΔNLL| {cross['mean_abs_nll_diff']:.2e}"
    )
    print(
        "KV MiB: physical K/V bytes, mean over decode steps; live: mean tokens per layer (per head for ours)."
    )


def driver(args: argparse.Namespace) -> int:
    main_python = args.python or default_main_python()
    kv_python = venv_python(args.venv)
    script = str(Path(__file__).resolve())
    work = Path(tempfile.mkdtemp(prefix="kvpress_compare_"))
    job_path, ours_path, theirs_path = work / "job.json", work / "reasonkv.json", work / "kvpress.json"
    ours_cmd = [main_python, script, "--role", "reasonkv", "--job", str(job_path), "--result", str(ours_path)]
    theirs_cmd = [str(kv_python), script, "--role", "kvpress", "--job", str(job_path)]
    theirs_cmd += ["--tokens", str(ours_path), "--result", str(theirs_path)]
    if args.dry_run:
        print("job:", json.dumps(job_of(args)))
        if not kv_python.exists():
            print("the kvpress venv is missing; --setup would run:")
            for cmd in setup_commands(args.venv):
                print("  " + shlex.join(cmd))
            print("  (" + ", ".join(x for x in REQUIREMENTS.read_text().split() if "==" in x) + ")")
        print("1. " + shlex.join(ours_cmd))
        print("2. " + shlex.join(theirs_cmd))
        print(f"-> {args.out}")
        return 0
    if not args.traces.exists():
        print(f"error: no trace file at {args.traces}", file=sys.stderr)
        return 2
    if not kv_python.exists():
        if not args.setup:
            print(f"error: no kvpress venv at {args.venv}; run with --setup to create it", file=sys.stderr)
            return 2
        for cmd in setup_commands(args.venv):
            print("+ " + shlex.join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True)
    job_path.write_text(json.dumps(job_of(args)))
    load_before = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    start = time.perf_counter()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}  # no loading bars
    subprocess.run(ours_cmd, check=True, env=env)
    subprocess.run(theirs_cmd, check=True, env={**env, "PYTHONPATH": ""})
    wall = time.perf_counter() - start
    ours, theirs = json.loads(ours_path.read_text()), json.loads(theirs_path.read_text())

    summary = []
    for side in (ours, theirs):
        for row in summarize(side["results"]):
            summary.append({"side": side["side"], "transformers": side["versions"]["transformers"], **row})
    full_ours = [r for r in ours["results"] if r["run"] == "full"]
    full_theirs = [r for r in theirs["results"] if r["run"] == "full"]
    agree = total = 0
    diffs: list[float] = []
    for a, b in zip(full_ours, full_theirs, strict=True):
        agree += sum(x == y for x, y in zip(a["argmax"], b["argmax"], strict=True))
        total += len(a["argmax"])
        diffs += [abs(x - y) for x, y in zip(a["nll"], b["nll"], strict=True)]
    cross = {
        "argmax_agreement": agree / max(1, total),
        "max_abs_nll_diff": max(diffs, default=0.0),
        "mean_abs_nll_diff": sum(diffs) / max(1, len(diffs)),
    }
    for side in (ours, theirs):
        for r in side["results"]:
            r.pop("argmax", None)
            r.pop("nll", None)
    record = {
        "kind": "kvpress_compare",
        "command": shlex.join([Path(sys.executable).name, "benchmarks/kvpress_compare.py", *sys.argv[1:]]),
        "job": job_of(args),
        "traces": [
            {"id": t["id"], "prompt_len": t["prompt_len"], "tokens": len(t["ids"])} for t in ours["traces"]
        ],
        "note": "each side against its own full cache; tokens/s ratio to that side's full cache",
        "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "wall_seconds": wall,
        "versions": {"reasonkv": ours["versions"], "kvpress": theirs["versions"]},
        "threads": {"reasonkv": ours["threads"], "kvpress": theirs["threads"]},
        "summary": summary,
        "full_vs_full": cross,
        "per_trace": {"reasonkv": ours["results"], "kvpress": theirs["results"]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print_table(summary, cross)
    print(f"{wall:.0f} s wall; results -> {args.out}")
    if any(math.isnan(r["mean_kl"]) for r in summary):
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "reasonkv":
        worker_reasonkv(json.loads(args.job.read_text()), args.result)
        return 0
    if args.role == "kvpress":
        worker_kvpress(json.loads(args.job.read_text()), args.tokens, args.result)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
