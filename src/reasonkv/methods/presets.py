"""Presets: the configurations docs/results.md recommends, by name. A preset is a method and
knobs (`beaconkv-int4` is `beaconkv` with eight storage and schedule knobs), accepted wherever
a method name is (make_cache, the CLI's --method/--methods, sweep grids), the caller's knobs
over the preset's. `registry.get_method` resolves them; this module is data only, so the
registry can read it without importing itself back.

Each preset names its evidence: the numbers, the traces they come from, the records and the
grid that made them, and the section of docs/results.md that reads them. A preset's knobs are
fixed once published: a new measurement is a new preset, so a record that names one keeps its
meaning (sweep records hold the preset's knobs spelled out too, see `knobs.check_values`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

TUNING_SET = (
    "the tuning set (the 12 publish traces, examples/data/mip-math500-12.jsonl), SmolLM2-135M, 2,048 tokens"
)
"""Where every preset's numbers come from: the traces the knobs were chosen on (docs/results.md,
"Every byte a sequence holds"). None is measured on the report set yet."""


@dataclass(frozen=True)
class Preset:
    name: str
    method: str
    """The registered method whose knobs it sets."""
    knobs: Mapping[str, object]
    summary: str
    """What it is for, in a line."""
    measured: str
    """Its numbers, with the budget they were measured at."""
    records: str
    """The results file the numbers are read from (a path in the repository)."""
    grid: str
    """The sweep grid that made those records (rerunning it skips every unit already there)."""
    section: str
    """The section of docs/results.md that reads the numbers."""
    budget: int | None = None
    """The budget the numbers were measured at (a preset does not set the budget: pass it)."""
    traces: str = field(default=TUNING_SET)

    def __post_init__(self) -> None:
        object.__setattr__(self, "knobs", MappingProxyType(dict(self.knobs)))

    @property
    def evidence(self) -> str:
        """The numbers and where they come from, in one string."""
        return f"{self.measured}; on {self.traces}; {self.sources}"

    @property
    def sources(self) -> str:
        """Where the numbers are: records, grid and the section that reads them."""
        return f"records {self.records}, grid {self.grid}; docs/results.md, {self.section!r}"


PRESETS: dict[str, Preset] = {}


def register_preset(preset: Preset) -> Preset:
    """Add a preset (its base method and knobs are checked by the registry and the tests)."""
    if preset.name in PRESETS:
        raise ValueError(f"preset {preset.name!r} is already registered")
    PRESETS[preset.name] = preset
    return preset


_QUANTIZE = "Quantize, evict, or both"

register_preset(
    Preset(
        "beaconkv-int4",
        "beaconkv",
        {
            "kv_bits": 4,
            "group_size": 32,
            "value_group_size": 64,
            "residual": 0,
            "fp_sinks": 1,
            "pre_rope": True,
            "hadamard": True,
            "fraction": 0.0625,
        },
        "BeaconKV storing what it keeps at 4 bits (keys before RoPE, Hadamard basis, the sink exact, "
        "evicting 1/16 at a time): the top-1 goal at SnapKV@128's K/V memory; about 38 % slower to decode "
        "on one CPU thread (the rotations on every read); the head dim must be a power of two, 64 or more",
        "budget 671: KL 0.0354, top-1 0.943, peak K/V 5.60 MiB and peak state 7.92 MiB a sequence at "
        "16-bit pricing (above SnapKV@128's 6.26 MiB of state); on the report set, each trace alone: "
        "KL 0.0478, top-1 0.929",
        "docs/results/bytes-sweep-alone.jsonl",
        "examples/bytes/beaconkv-int4-basis-vg64-f16.toml",
        _QUANTIZE,
        budget=671,
    )
)
register_preset(
    Preset(
        "h2o-int4",
        "h2o",
        {"kv_bits": 4, "group_size": 32, "residual": 0, "fp_sinks": 1},
        "H2O storing what it keeps at 4 bits, group 32, no residual, the sink exact (no change of "
        "basis to pay for on every read)",
        "budget 640: KL 0.0385, top-1 0.932, peak K/V 5.82 MiB and peak state about 6.5 MiB a "
        "sequence at 16-bit pricing; on the report set, each trace alone: KL 0.0474, top-1 0.923 "
        "(its state the same)",
        "docs/results/bytes-sweep-alone.jsonl",
        "examples/bytes/goal-level-sinks.toml",
        _QUANTIZE,
        budget=640,
    )
)
register_preset(
    Preset(
        "beaconkv-lean",
        "beaconkv",
        {"beacon_bits": 8, "window_bits": 8, "upkeep_every": 1},
        "BeaconKV with its beacon buffers and query window as 8-bit codes, fed every step: about "
        "half of what it holds beside its K/V, no measured loss of fidelity",
        "budget 128: KL 0.2292, top-1 0.818, peak state 3.84 MiB a sequence; budget 256: KL 0.1206, "
        "top-1 0.881, 6.83 MiB (the state: one sequence alone, 160 + 1,888 tokens, 16-bit pricing, "
        "predicted by benchmarks/state_table.py, docs/performance-data/state-smollm2-8bit.json; "
        "BeaconKV at its defaults: 0.2274 and 0.1212 at 4.85 and 7.85 MiB)",
        "docs/results/state-probe.jsonl",
        "examples/probes/beacon-bits-8.toml",
        "Every byte a sequence holds",
        budget=256,
    )
)
