"""The one registry of named methods: each is a scorer + an allocator + a schedule + the
protected window, with the paper's defaults. The CLI, sweeps and docs read it, so a new
method is one entry here plus its scorer file."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from reasonkv.budgets import UniformAllocator
from reasonkv.policies import SnapKVScorer, StreamingScorer, TOVAScorer
from reasonkv.schedules import NEVER, EveryStep, FixedBuffer, Schedule

PROTECTION_KNOBS = {
    "n_sink": "first real tokens always kept (attention sinks)",
    "n_recent": "newest tokens always kept",
    "protect_prompt": "keep the whole prompt",
}


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

    def knobs(self) -> dict[str, object]:
        """Every settable parameter with its default for this method."""
        out: dict[str, object] = {}
        for cls in (self.scorer, self.allocator, self.schedule if isinstance(self.schedule, type) else None):
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
    if spec.name in METHODS:
        raise ValueError(f"method {spec.name!r} is already registered")
    METHODS[spec.name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}") from None


def available_methods() -> dict[str, str]:
    """Method names with a one-line description."""
    return {name: spec.description for name, spec in METHODS.items()}


register(MethodSpec(
    "full", "no eviction: the reference every method is measured against", "-",
    StreamingScorer, NEVER, defaults={"n_sink": 0, "n_recent": 0}, compresses=False,
))
register(MethodSpec(
    "streaming", "attention sinks + the most recent tokens, no scoring",
    "StreamingLLM, Xiao et al. 2023, arXiv:2309.17453",
    StreamingScorer, EveryStep, defaults={"n_sink": 4, "n_recent": 1},
))
register(MethodSpec(
    "tova", "keep what the current query attends to most (group mean), every step",
    "TOVA, Oren et al. 2024, arXiv:2401.06104",
    TOVAScorer, EveryStep, defaults={"n_sink": 0, "n_recent": 1},
))
register(MethodSpec(
    "snapkv", "decode-time SnapKV: last 8 queries' attention, max-pooled; compress to B every 128 steps",
    "SnapKV, Li et al. 2024, arXiv:2404.14469 (decode variant of R-KV, arXiv:2505.24133)",
    SnapKVScorer, FixedBuffer, defaults={"n_sink": 0, "n_recent": 8},
))
