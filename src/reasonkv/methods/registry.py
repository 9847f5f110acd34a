"""The one registry of named methods: each is a scorer + an allocator + a schedule + the
protected window, with the paper's defaults. The CLI, sweeps and docs read it, so a new
method is one entry here plus its scorer file."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from reasonkv.core.policy import (
    AllQueriesScorer,
    BeaconKVScorer,
    H2OScorer,
    InitialRecentScorer,
    RandomScorer,
    RecentQueryScorer,
    RKVScorer,
    RPCScorer,
    SnapKVScorer,
    StreamingScorer,
    TOVAScorer,
)
from reasonkv.core.policy.allocators import AdaKVHeadAllocator, PyramidAllocator, UniformAllocator
from reasonkv.core.policy.allocators.reasonalloc import EntropyHeadSplit, ReasonAllocAllocator
from reasonkv.core.policy.knob import MAX_TOKENS, Bounds
from reasonkv.core.policy.schedules import (
    NEVER,
    EveryStep,
    FixedBuffer,
    MaxMinThreshold,
    PeriodicRatio,
    Schedule,
)
from reasonkv.core.quantize import KVFormat
from reasonkv.methods.presets import PRESETS, Preset

PROTECTION_KNOBS = {
    "n_sink": "first real tokens always kept (attention sinks)",
    "n_recent": "newest tokens always kept",
    "protect_prompt": "keep the whole prompt (counted in the budget; kept whole even past it)",
}
PROTECTION_BOUNDS = {"n_sink": Bounds(ge=0, le=MAX_TOKENS), "n_recent": Bounds(ge=0, le=MAX_TOKENS)}
"""The protection knobs' ranges (protect_prompt is true or false)."""


@dataclass(frozen=True)
class MethodSpec:
    name: str
    description: str
    paper: str
    scorer: type
    schedule: type[Schedule] | Schedule
    allocator: type = UniformAllocator
    defaults: dict = field(default_factory=dict)
    compresses: bool = True
    head_allocator: type | None = None
    """Optional per-head split at each compression (LayerPolicy.head_allocator), e.g. AdaKV."""
    storage: type = KVFormat
    """How the cache stores what it keeps (kv_bits, group_size, residual): every method has it."""
    preset_of: str | None = None
    """For a preset (methods/presets.py): the method it sets knobs of; its knobs are in `defaults`."""

    def knobs(self) -> dict[str, object]:
        """Every settable parameter with its default for this method."""
        out: dict[str, object] = {}
        schedule = self.schedule if isinstance(self.schedule, type) else None
        for cls in (self.scorer, self.allocator, schedule, self.head_allocator, self.storage):
            if cls is None:
                continue
            for f in dataclasses.fields(cls):
                if f.name != "name" and f.init:
                    out[f.name] = f.default if f.default is not dataclasses.MISSING else None
        out.update({"n_sink": 4, "n_recent": 8, "protect_prompt": False})
        out.update(self.defaults)
        return out


METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in METHODS or spec.name in PRESETS:
        kind = "method" if spec.name in METHODS else "preset"
        raise ValueError(f"{spec.name!r} is already registered as a {kind}")
    METHODS[spec.name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    """The registered method, or for a preset its method with the preset's knobs as defaults
    (so a preset's name works wherever a method's does, the caller's knobs over its own)."""
    if name in METHODS:
        return METHODS[name]
    if name in PRESETS:
        return preset_spec(PRESETS[name])
    names = ", ".join(METHODS) + (f"; presets: {', '.join(PRESETS)}" if PRESETS else "")
    raise ValueError(f"unknown method {name!r}; available: {names}")


def preset_spec(preset: Preset) -> MethodSpec:
    """A preset as a MethodSpec: its method's parts, the preset's knobs over the defaults."""
    base = METHODS.get(preset.method)
    if base is None:  # a preset of a method that is not registered is the preset's own error
        raise ValueError(f"preset {preset.name!r} is of method {preset.method!r}, which is not registered")
    knobs = ", ".join(f"{k}={v}" for k, v in preset.knobs.items())
    return dataclasses.replace(
        base,
        name=preset.name,
        description=f"{preset.method} with {knobs}: {preset.summary}",
        defaults={**base.defaults, **preset.knobs},
        preset_of=preset.method,
    )


def resolve(name: str, knobs: dict[str, object] | None = None) -> tuple[str, dict[str, object]]:
    """(method, knobs) that `name` with `knobs` stands for: a preset becomes its method with the
    preset's knobs under the given ones; a method's name is returned as it is. Unknown names
    raise ValueError."""
    spec = get_method(name)
    given = dict(knobs or {})
    if spec.preset_of is None:
        return name, given
    return spec.preset_of, {**PRESETS[name].knobs, **given}


def available_methods() -> dict[str, str]:
    """Method names with a one-line description (presets: `available_presets`)."""
    return {name: spec.description for name, spec in METHODS.items()}


def available_presets() -> dict[str, str]:
    """Preset names with what they stand for and their evidence."""
    return {name: f"{get_method(name).description} ({p.evidence})" for name, p in PRESETS.items()}


register(
    MethodSpec(
        "full",
        "no eviction: the reference every method is measured against",
        "-",
        StreamingScorer,
        NEVER,
        defaults={"n_sink": 0, "n_recent": 0},
        compresses=False,
    )
)
for _bits in (8, 4, 2):
    register(
        MethodSpec(
            f"quant-int{_bits}",
            f"no eviction; every token stored at {_bits} bits (KIVI-style: keys per channel, values per "
            "token, the newest `residual` tokens in full precision)",
            "KIVI, Liu et al. 2024, arXiv:2402.02750",
            StreamingScorer,
            NEVER,
            defaults={"n_sink": 0, "n_recent": 0, "kv_bits": _bits},
            compresses=False,
        )
    )
register(
    MethodSpec(
        "streaming",
        "attention sinks + the most recent tokens, no scoring",
        "StreamingLLM, Xiao et al. 2023, arXiv:2309.17453",
        StreamingScorer,
        EveryStep,
        defaults={"n_sink": 4, "n_recent": 1},
    )
)
register(
    MethodSpec(
        "tova",
        "keep what the current query attends to most (group mean), every step",
        "TOVA, Oren et al. 2024, arXiv:2401.06104",
        TOVAScorer,
        EveryStep,
        defaults={"n_sink": 0, "n_recent": 1},
    )
)
register(
    MethodSpec(
        "snapkv",
        "decode-time SnapKV: last 8 queries' attention, max-pooled; compress to B every 128 steps",
        "SnapKV, Li et al. 2024, arXiv:2404.14469 (decode variant of R-KV, arXiv:2505.24133)",
        SnapKVScorer,
        FixedBuffer,
        defaults={"n_sink": 0, "n_recent": 8},
    )
)


register(
    MethodSpec(
        "h2o",
        "heavy hitters by cumulative attention (summed over the GQA group) + the recent half of the "
        "budget (recent_ratio), every step",
        "H2O, Zhang et al. 2023, arXiv:2306.14048",
        H2OScorer,
        EveryStep,
        defaults={"n_sink": 0, "n_recent": 0},
    )
)
register(
    MethodSpec(
        "rkv",
        "R-KV: λ·importance (last 8 queries, group-max logits, max-pool 7) − (1−λ)·key redundancy "
        "(cosine > 0.5, newest duplicate spared), λ=0.1; compress to B every 128 steps",
        "R-KV, Cai et al. 2025, arXiv:2505.24133",
        RKVScorer,
        FixedBuffer,
        defaults={"n_sink": 0, "n_recent": 8},
    )
)
register(
    MethodSpec(
        "rpc",
        "RPC: every P generated tokens keep P/c of them, chosen by the last R=32 queries (mean over all "
        "heads, avg-pool 7); prompt and last R kept. budget = P/c per period (P = budget·ratio unless "
        "interval is set); set window and n_recent together (both are R)",
        "Reasoning Path Compression, Song et al. 2025, arXiv:2505.13866",
        RPCScorer,
        PeriodicRatio,
        defaults={"n_sink": 0, "n_recent": 32, "protect_prompt": True},
    )
)


register(
    MethodSpec(
        "beaconkv",
        "BeaconKV: max attention of beacon queries (continual FPS over pre-RoPE queries, grow to "
        "beacon_max, shrink to beacon_min, rotated to the current position) and the recent queries, over the "
        "GQA group; sinks + recent kept; at B_max evict fraction·B_max",
        "BeaconKV, Kim et al. 2026, arXiv:2609.04971",
        BeaconKVScorer,
        MaxMinThreshold,
        defaults={"n_sink": 4, "n_recent": 16},
    )
)
register(
    MethodSpec(
        "recent-query",
        "BeaconKV's comparator: the last 32 queries score keys (max over them and the GQA group), "
        "no beacons; sinks + recent kept; at B_max evict fraction·B_max",
        "BeaconKV's 32 recent + 0 beacons ablation, Kim et al. 2026, arXiv:2609.04971",
        RecentQueryScorer,
        MaxMinThreshold,
        defaults={"n_sink": 4, "n_recent": 16},
    )
)
register(
    MethodSpec(
        "initial-recent",
        "BeaconKV's Initial+Recent comparator: the first beacon_min generated queries of each head "
        "(beacon_feed), kept forever (no FPS), rotated to the current position, and the recent queries "
        "score keys (max over them and the GQA group); sinks + recent kept; at B_max evict fraction·B_max",
        "BeaconKV's Initial+Recent comparator (Table 3), Kim et al. 2026, arXiv:2609.04971",
        InitialRecentScorer,
        MaxMinThreshold,
        defaults={"n_sink": 4, "n_recent": 16},
    )
)
register(
    MethodSpec(
        "beaconkv-all-queries",
        "BeaconKV's offline alternatives (ablation only): every admitted query held, the scoring set "
        "picked from all of them at each compression (selection: naive FPS, or K-means centroids), "
        "rotated to the current position, with the recent queries (max over them and the GQA group); "
        "sinks + recent kept; at B_max evict fraction·B_max",
        "BeaconKV's Figure 7 alternatives to continual FPS, Kim et al. 2026, arXiv:2609.04971",
        AllQueriesScorer,
        MaxMinThreshold,
        defaults={"n_sink": 4, "n_recent": 16},
    )
)
register(
    MethodSpec(
        "random",
        "the floor: sinks + recent kept, the rest evicted uniformly at random per head (seeded); "
        "at B_max evict fraction·B_max",
        "random eviction, the baseline of arXiv:2609.03430",
        RandomScorer,
        MaxMinThreshold,
        defaults={"n_sink": 4, "n_recent": 16},
    )
)
register(
    MethodSpec(
        "pyramidkv",
        "SnapKV scores with PyramidKV's layer budgets (linear, layer 0 largest, β=20, "
        "mean = budget); compress to the layer's budget every 128 steps",
        "PyramidKV, Cai et al. 2024, arXiv:2406.02069 (SnapKV scoring, decode variant)",
        SnapKVScorer,
        FixedBuffer,
        allocator=PyramidAllocator,
        defaults={"n_sink": 0, "n_recent": 8},
    )
)
register(
    MethodSpec(
        "adakv-snapkv",
        "SnapKV scores, AdaKV head split: global top-k over a layer's heads with a floor "
        "(floor_alpha), real per-head lengths; compress every 128 steps",
        "AdaKV, Feng et al. 2024, arXiv:2407.11550 (SnapKV scoring, decode variant)",
        SnapKVScorer,
        FixedBuffer,
        defaults={"n_sink": 0, "n_recent": 8},
        head_allocator=AdaKVHeadAllocator,
    )
)
register(
    MethodSpec(
        "pyramid-rkv",
        "R-KV scores with PyramidKV's layer budgets (linear, layer 0 largest, β=20); "
        "compress every 128 steps — ReasonAlloc's monotone baseline",
        "Pyramid-RKV as in ReasonAlloc, arXiv:2606.11164 "
        "(PyramidKV arXiv:2406.02069 + R-KV arXiv:2505.24133)",
        RKVScorer,
        FixedBuffer,
        allocator=PyramidAllocator,
        defaults={"n_sink": 0, "n_recent": 8},
    )
)
register(
    MethodSpec(
        "adakv-rkv",
        "R-KV scores, AdaKV head split: global top-k over a layer's heads with a floor "
        "(floor_alpha), real per-head lengths; compress every 128 steps",
        "AdaKV, Feng et al. 2024, arXiv:2407.11550 (R-KV scoring, arXiv:2505.24133)",
        RKVScorer,
        FixedBuffer,
        defaults={"n_sink": 0, "n_recent": 8},
        head_allocator=AdaKVHeadAllocator,
    )
)

# --- ReasonAlloc: profiled layer budgets x entropy head split, on top of any policy ---
_REASONALLOC = "ReasonAlloc, arXiv:2606.11164"
_REASONALLOC_WHAT = (
    "layer budgets follow the profiled Reasoning Wave (demand^(1/tau), exact total); at each "
    "compression heads split the layer budget by 1 - normalised entropy (EMA, floor)"
)


def with_reasonalloc(
    base: str, name: str, description: str, layers: bool = True, heads: bool = True
) -> MethodSpec:
    """`base`'s scorer, schedule and protection under ReasonAlloc's budgets (either level can be
    switched off for the ablations)."""
    spec = get_method(base)
    return dataclasses.replace(
        spec,
        name=name,
        description=description,
        paper=_REASONALLOC,
        allocator=ReasonAllocAllocator,
        head_allocator=EntropyHeadSplit if heads else None,
        defaults={**spec.defaults, **({} if layers else {"layer_level": False})},
    )


for _base, _label in (("rkv", "R-KV"), ("snapkv", "SnapKV"), ("beaconkv", "BeaconKV")):
    register(with_reasonalloc(_base, f"reasonalloc-{_base}", f"{_label} scores; {_REASONALLOC_WHAT}"))
register(
    with_reasonalloc(
        "rkv",
        "reasonalloc-layer-rkv",
        "ablation: R-KV with ReasonAlloc's profiled layer budgets only (heads uniform)",
        heads=False,
    )
)
register(
    with_reasonalloc(
        "rkv",
        "reasonalloc-head-rkv",
        "ablation: R-KV with ReasonAlloc's online head split only (layers uniform)",
        layers=False,
    )
)
