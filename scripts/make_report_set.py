"""Write the report traces: 12 traces no knob was chosen on, beside the 12 publish traces.

Knobs (budgets, storage settings, BeaconKV's fraction) were searched on the 12 publish traces
(`examples/data/mip-math500-12.jsonl`, the tuning set). Numbers that read a knob so chosen are
reported on these instead. The rule, applied to the MiP-Overthinking file beside the project:
well-posed rows longer than 9,000 characters (so 2,048 tokens replay), 3 each from DeepSeek-R1,
R1-Distill-Qwen-32B, QwQ-32B and s1.1-32B (the tuning set's mix), on none of the tuning set's
problems and none of the 16 traces the shipped Reasoning Wave profile was made from, the lowest
`source_index` first, one trace a problem.

    python scripts/make_report_set.py ../shared/data/traces/mip_overthinking_math500.jsonl \
        --out examples/data/mip-math500-report-12.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODELS = (
    "deepseek-ai/DeepSeek-R1",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
    "Qwen/QwQ-32B",
    "simplescaling/s1.1-32B",
)
PER_MODEL = 3
MIN_CHARS = 9000
ROOT = Path(__file__).resolve().parents[1]
TUNING = ROOT / "examples/data/mip-math500-12.jsonl"
PROFILE = ROOT / "src/reasonkv/profiles/smollm2-135m.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", type=Path, help="the MiP-Overthinking MATH-500 trace file")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rows = [json.loads(line) for line in args.traces.read_text().splitlines() if line.strip()]
    tuning = [json.loads(line) for line in TUNING.read_text().splitlines() if line.strip()]
    profiled = set(json.loads(PROFILE.read_text())["traces"])
    taken_problems = {r["math500_unique_id"] for r in tuning}
    excluded = {r["id"] for r in tuning} | profiled
    chosen = []
    for model in MODELS:
        pool = sorted(
            (
                r
                for r in rows
                if r["model"] == model
                and r["variant"] == "well_posed"
                and r["n_chars"] > MIN_CHARS
                and r["id"] not in excluded
            ),
            key=lambda r: r["source_index"],
        )
        picked = 0
        for r in pool:
            if picked == PER_MODEL:
                break
            if r["math500_unique_id"] in taken_problems:
                continue
            chosen.append(r)
            taken_problems.add(r["math500_unique_id"])
            picked += 1
        if picked < PER_MODEL:
            raise SystemExit(f"only {picked} traces of {model} fit the rule")
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen))
    print(f"wrote {len(chosen)} traces to {args.out}:")
    for r in chosen:
        print(f"  {r['id']}  {r['n_chars']} chars")


if __name__ == "__main__":
    main()
