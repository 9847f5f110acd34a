"""Compare a rerun of sweep units with a published results file, unit key by unit key.

A unit's key does not depend on the grid or the commit, so rerunning a sub-grid after a code
change and comparing tells whether the published numbers still hold:

    python scripts/compare_sweeps.py RERUN.jsonl docs/results/replay-sweep.jsonl

Prints one line per unit (KL, top-1, live tokens: rerun vs published) and the largest
relative KL difference; exits 1 when top-1 or live tokens differ, or KL by more than --rtol.
"""

from __future__ import annotations

import argparse
import json
import sys


def ok_units(path: str) -> dict[str, dict]:
    units = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("status") == "ok":
                units.setdefault(record["key"], record)  # the first ok line counts, as in the report
    return units


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rerun")
    parser.add_argument("published")
    parser.add_argument("--rtol", type=float, default=1e-4, help="largest relative KL difference accepted")
    args = parser.parse_args()
    published = ok_units(args.published)
    worst, failed = 0.0, False
    for key, unit in ok_units(args.rerun).items():
        c, a = unit["config"], unit["metrics"]
        if key not in published:
            print(f"{c['method']} {c['budget']} {c['item']}: not in the published file")
            continue
        b = published[key]["metrics"]
        rel = abs(a["mean_kl"] - b["mean_kl"]) / max(abs(b["mean_kl"]), 1e-12)
        worst = max(worst, rel)
        same = a["top1"] == b["top1"] and a["live_tokens"] == b["live_tokens"]
        failed |= not same or rel > args.rtol
        print(
            f"{c['method']:22s} {str(c['budget']):>5s} {c['item'][-24:]:>24s}  KL {a['mean_kl']:.6f} vs "
            f"{b['mean_kl']:.6f} (rel {rel:.1e})  top-1 {a['top1']:.4f} vs {b['top1']:.4f}  "
            f"live {a['live_tokens']:.2f} vs {b['live_tokens']:.2f}"
        )
    print(f"largest relative KL difference: {worst:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
