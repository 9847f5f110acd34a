"""How stable is the shipped Reasoning Wave? Split-half agreement of its per-trace curves,
and agreement with a second profile made from traces of other reasoning models.

Run: .venv/bin/python scripts/wave_stability.py [TRACES.jsonl]   (prints JSON; ~3 min on 2 cores)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import reasonkv
from reasonkv.harness.profile import curve_agreement, profile_traces
from reasonkv.harness.traces import load_traces
from reasonkv.methods.profiles import PACKAGED_PROFILES

TRACES = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/data/traces/mip_overthinking_math500.jsonl")


def main() -> None:
    shipped = json.loads((PACKAGED_PROFILES / "smollm2-135m.json").read_text())
    curves = torch.tensor(shipped["per_trace_demand"])
    half = curves.shape[0] // 2
    out = {
        "first_half_vs_second_half": curve_agreement(
            curves[:half].mean(0).tolist(), curves[half:].mean(0).tolist()
        ),
        "odd_vs_even": curve_agreement(curves[1::2].mean(0).tolist(), curves[0::2].mean(0).tolist()),
    }
    model, tokenizer = reasonkv.load_model("smollm2-135m")
    rows = load_traces(TRACES)
    other = [r for r in rows if r["model"] == "Qwen/QwQ-32B"][:8] + [
        r for r in rows if r["model"] == "GAIR/LIMO"
    ][:8]
    second = profile_traces(model, tokenizer, other, max_tokens=shipped["max_tokens"])
    out["shipped_vs_qwq_and_limo"] = curve_agreement(shipped["demand"], second["demand"])
    out["second_profile_traces"] = second["traces"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
