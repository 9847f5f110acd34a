"""How long memory planning takes: `plan_batches` (what `reasonkv bench --batch auto` runs before
decoding) for a set of runs at each length, the best of a few repeats, with the plans it made.

It uses only the planner's public API, so it runs against another checkout too: put that
checkout's `src` first on PYTHONPATH to time it beside this one, and compare the plans (they
must be equal) as well as the seconds.

    python benchmarks/plan_speed.py --lengths 4096,16384 --out plan-speed.json
    git archive dd2cff3 src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src python benchmarks/plan_speed.py --commit dd2cff3 --out plan-speed-old.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import reasonkv
from reasonkv.core.models import load_model
from reasonkv.harness import bench
from reasonkv.util.formatting import parse_bytes

METHODS = "streaming,snapkv,rkv,beaconkv,h2o,tova,full"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--lengths", default="4096,16384", help="decode tokens, comma-separated")
    p.add_argument("--memory", default="2GiB", help="the memory a batch must fit (as --kv-memory takes it)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--commit", default=None, help="the commit timed, for a checkout git cannot name (git archive)"
    )
    args = p.parse_args()
    model, _ = load_model(args.model, device="cpu", dtype="float32")
    runs = [
        bench.BenchRun(m, None if bench.is_reference(m) else args.budget, {}) for m in args.methods.split(",")
    ]
    memory = parse_bytes(args.memory)
    rows = []
    print(f"{'tokens':>7} {'best of ' + str(args.repeats):>10}  plans (run: bytes a sequence, batch)")
    for n in map(int, args.lengths.split(",")):
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            plans = bench.plan_batches(model, runs, args.prompt, n, memory=memory, batch=None)
            seconds.append(time.perf_counter() - start)
        made = [[plan.run.label, plan.per_sequence, plan.batch] for plan in plans]
        rows.append({"tokens": n, "seconds": seconds, "best_seconds": min(seconds), "plans": made})
        print(f"{n:>7} {min(seconds) * 1e3:>8.0f} ms  " + ", ".join(f"{a}: {b}, {c}" for a, b, c in made))
    source = Path(reasonkv.__file__).resolve().parents[2]
    commit = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    record = {
        "model": args.model,
        "prompt": args.prompt,
        "budget": args.budget,
        "memory": args.memory,
        "source": str(source),
        "commit": args.commit or commit.stdout.strip() or None,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
