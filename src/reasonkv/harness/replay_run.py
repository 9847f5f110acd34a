"""One method setting a replay, a sweep or a benchmark runs: method, budget, knobs, and the
value they resolve to once for every cache the run makes."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from reasonkv.methods.resolved import ResolvedMethod, resolve_method


@dataclass(frozen=True)
class ReplayRun:
    """One method setting to replay: method name, budget (None for `full`), knobs."""

    method: str
    budget: int | None = None
    knobs: dict = field(default_factory=dict)
    tag: str = ""
    """Knobs this run alone was given (e.g. ":kv_bits=4"), so that two settings of one method
    have two labels."""

    @property
    def name(self) -> str:
        """The method with the knobs this run alone was given: "snapkv:kv_bits=4"."""
        return self.method + self.tag

    @property
    def label(self) -> str:
        return self.name if self.budget is None else f"{self.name}@{self.budget}"

    @classmethod
    def of(cls, resolved: ResolvedMethod, tag: str = "") -> ReplayRun:
        """The run of a value resolved already (it is not resolved again)."""
        run = cls(resolved.name, resolved.budget, dict(resolved.knobs), tag)
        run.__dict__["resolved"] = resolved  # where the cached property keeps it
        return run

    @functools.cached_property
    def resolved(self) -> ResolvedMethod:
        """The setting checked and its parts built once, for every cache this run makes."""
        return resolve_method(self.method, self.budget, self.knobs)

    def to_dict(self) -> dict:
        """The run as saved in every record: method, budget, knobs."""
        return {"method": self.method, "budget": self.budget, "knobs": dict(self.knobs)}
