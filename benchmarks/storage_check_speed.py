"""How long judging quantized storage takes: `build_policy` (what `make_cache` and vLLM's
adapter run before a cache exists) for quantized settings on a model's shape, cold (the best
of a few repeats, each with nothing measured before) and again (a setting already judged in
the process), with each setting's verdict.

It uses only `resolve_method` and `build_policy`, so it runs against another checkout too: put
that checkout's `src` first on PYTHONPATH to time it beside this one (the verdicts must be equal).

    python benchmarks/storage_check_speed.py --out storage-check.json
    mkdir -p /tmp/old && git archive 38bd2d9 src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src python benchmarks/storage_check_speed.py --commit 38bd2d9 --out old.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import reasonkv
from reasonkv.core.models import ModelShape
from reasonkv.methods.api import build_policy
from reasonkv.methods.knobs import KnobError
from reasonkv.methods.resolved import resolve_method

SHAPES = {  # (layers, heads, KV heads, head dim), from each model's config.json
    "smollm2-135m": (30, 9, 3, 64),
    "qwen3-8b": (36, 32, 8, 128),
}
SETTINGS = [  # (method, budget, knobs): layer budgets alike and not, the three schedules, a refusal
    ("snapkv", 512, {"kv_bits": 4}),
    ("pyramidkv", 512, {"kv_bits": 4}),
    ("h2o", 512, {"kv_bits": 4}),
    ("beaconkv", 512, {"kv_bits": 4}),
    ("adakv-snapkv", 512, {"kv_bits": 4}),
    ("streaming", 256, {"kv_bits": 2, "group_size": 64}),
    ("h2o", 24, {"kv_bits": 4}),
]


def forget() -> None:
    """Forget the runs this process made, where the checkout keeps them."""
    try:
        from reasonkv.core import storage_peak
    except ImportError:
        return
    storage_peak._MEASURED.clear()


def judge(method: str, budget: int, knobs: dict, shape: ModelShape) -> str:
    try:
        build_policy(resolve_method(method, budget, knobs), shape)
    except KnobError as err:
        return f"refused: {err}"
    return "accepted"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", default=None, help="the commit timed, for a checkout git cannot name")
    args = p.parse_args()
    rows = []
    print(f"{'model':<14} {'setting':<44} {'cold ms':>8} {'again ms':>9}  verdict")
    for name in args.models.split(","):
        layers, heads, kv_heads, head_dim = SHAPES[name]
        shape = ModelShape(name, "llama", layers, heads, kv_heads, head_dim)
        for method, budget, knobs in SETTINGS:
            cold = []
            for _ in range(args.repeats):
                forget()
                start = time.perf_counter()
                verdict = judge(method, budget, knobs, shape)
                cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            judge(method, budget, knobs, shape)
            again = time.perf_counter() - start
            setting = f"{method}@{budget} " + " ".join(f"{k}={v}" for k, v in knobs.items())
            row = {"model": name, "setting": setting, "cold_seconds": cold, "again_seconds": again}
            rows.append({**row, "verdict": verdict})
            short = verdict if len(verdict) < 60 else verdict[:57] + "..."
            times = f"{min(cold) * 1e3:>8.1f} {again * 1e3:>9.1f}"
            print(f"{name:<14} {setting:<44} {times}  {short}", flush=True)
    source = Path(reasonkv.__file__).resolve().parents[2]
    commit = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    record = {"source": str(source), "commit": args.commit or commit.stdout.strip() or None, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
