"""A method as it will run: name, budget and knobs checked once and its parts built once, at
the edge where a user names it (the CLI, `make_cache`, vLLM's config and a request's entry, a
sweep grid). Everything below takes this value and checks or builds nothing again."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from reasonkv.core.policy.contract import Allocator
from reasonkv.core.policy.knob import MAX_TOKENS
from reasonkv.core.step import LayerPolicy
from reasonkv.methods.knobs import (
    KnobError,
    at_budget,
    build_parts,
    check_budget,
    check_policy_budget,
    check_profile,
    check_protected_window,
    check_values,
    knob_bounds,
    min_budget,
)
from reasonkv.methods.registry import MethodSpec, get_method


@dataclass(frozen=True)
class ResolvedMethod:
    """One method setting, checked: equal when name, budget and knobs are (the parts built from
    them do not compare)."""

    name: str
    """As asked: a preset keeps its own name (`beaconkv-int4`)."""
    budget: int | None
    """Tokens per KV head; None for a method that never compresses (it ignores any budget)."""
    knobs: Mapping[str, object]
    """The checked knobs as a record keeps them: as given, a preset's spelled out under them
    (no default filled in, so a default never enters a record's key)."""
    spec: MethodSpec = dataclasses.field(compare=False, repr=False)
    """The registry's entry (a preset's: its method's parts with the preset's defaults)."""
    allocator: Allocator = dataclasses.field(compare=False, repr=False)
    """Each layer's and KV head's budget from the mean one."""
    policy: LayerPolicy = dataclasses.field(compare=False, repr=False)
    """What every layer applies, built at this budget; without RoPE (`with_rope` adds the model's)."""

    def __reduce__(self) -> tuple:
        """Pickled as its setting, resolved again where it lands (another process is another edge)."""
        return resolve_method, (self.name, self.budget, dict(self.knobs))

    @property
    def method(self) -> str:
        """The registered method that runs (a preset's method)."""
        return self.spec.preset_of or self.spec.name

    @property
    def compresses(self) -> bool:
        return self.spec.compresses

    @property
    def stores_quantized(self) -> bool:
        """Whether any K/V is kept below the model's precision (its storage format says)."""
        fmt = self.policy.kv_format
        return fmt is not None and fmt.below_model_precision

    def layer_budgets(
        self, n_layers: int, n_kv_heads: int, load_demand: Callable[[str | None], list[float]] | None = None
    ) -> torch.Tensor:
        """Each layer's and KV head's budget [layers, KV heads] for a model of this size (a
        profile-driven allocator reads its demand curve through `load_demand`). KnobError when
        a layer's budget, after compressing, is below the protected window."""
        policy, budget = self.policy, self.budget
        stats = {"min_budget": min_budget(policy.schedule, policy.protected), "load_demand": load_demand}
        budgets = self.allocator.allocate(n_layers, n_kv_heads, budget or 1, stats).long()
        if budget is not None:
            smallest = min(policy.schedule.target(int(b)) for b in budgets.flatten().tolist())
            check_protected_window(self.spec, budget, smallest, policy.protected)
        return budgets

    def token_knobs(self) -> dict[str, int]:
        """The knobs set here that count tokens (declared up to MAX_TOKENS), with their values."""
        return {
            name: value
            for name, value in sorted(self.knobs.items())
            if isinstance(value, int) and any(b.le == MAX_TOKENS for b in knob_bounds(self.spec, name))
        }

    def with_rope(self, inv_freq, attention_scaling: float = 1.0) -> LayerPolicy:
        """The policy with the model's RoPE inverse frequencies (for scorers that rotate queries,
        and pre-RoPE storage). The scorer and schedule hold no per-sequence state (that lives in
        `PolicyStates`), so every cache made from this value may share them."""
        return dataclasses.replace(
            self.policy, rope_inv_freq=inv_freq, rope_attention_scaling=attention_scaling
        )


def resolve_method(
    name: str, budget: object = None, knobs: Mapping[str, object] | None = None
) -> ResolvedMethod:
    """Check `name` with `budget` and `knobs` and build its parts, once: unknown names, knobs of
    the wrong type, choice or range, knobs that do not fit together, a bad budget or one below
    the protected window, and an unreadable profile are a KnobError (a ValueError) in one line,
    before any model loads."""
    if not isinstance(name, str):
        raise KnobError(f"a method is named by a string, got {name!r}")
    try:
        spec = get_method(name)
    except ValueError as err:
        raise KnobError(str(err)) from None
    checked = check_values(spec, dict(knobs or {}))
    budget = check_budget(spec, budget)
    allocator, policy = build_parts(spec, at_budget(spec, budget, checked))
    if budget is not None:
        check_policy_budget(spec, budget, policy)
    check_profile(spec, checked)
    return ResolvedMethod(name, budget, MappingProxyType(checked), spec, allocator, policy)
