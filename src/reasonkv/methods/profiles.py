"""Reasoning Wave profiles on disk: JSON keyed by a hash of the attention-relevant config,
so a profile is never applied to a model it was not made for. Making one is the harness's
job (`reasonkv.harness.profile`); reading one is all a cache needs."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from reasonkv.util.records import RecordError, describe_json, read_json_object, write_json_atomic

PROFILE_FORMAT = 1
PACKAGED_PROFILES = Path(__file__).resolve().parent.parent / "profiles"


def config_hash(config) -> str:
    """Hash of the config fields that shape attention (and the vocabulary, to tell models apart)."""
    keys = (
        "model_type",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_size",
        "intermediate_size",
        "vocab_size",
        "rope_parameters",
        "rope_theta",
    )
    data = {k: getattr(config, k, None) for k in keys}
    blob = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def save_profile(profile: dict, path: str | Path) -> Path:
    return write_json_atomic(profile, path, indent=1)


def load_profile(path: str | Path, config=None) -> dict:
    """Read a profile; with `config`, refuse it unless it was made for that model."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no profile at {path}")
    profile = read_json_object(path, "profile")
    if "demand" not in profile or "config_hash" not in profile:
        raise RecordError(f"{path} is not a reasonkv profile (no demand curve / config hash)")
    check_demand(profile["demand"], path)
    if config is not None and profile["config_hash"] != config_hash(config):
        raise ValueError(
            f"profile {path} was made for {profile.get('model')!r} (config {profile['config_hash']}), "
            f"not for this model (config {config_hash(config)}); profile this model with `reasonkv profile`"
        )
    n_layers = getattr(config, "num_hidden_layers", None)
    if n_layers is not None and len(profile["demand"]) != n_layers:
        raise RecordError(
            f"{path}: `demand` has {len(profile['demand'])} values, one per layer, but the model has "
            f"{n_layers} layers"
        )
    return profile


def check_demand(demand: object, path: str | Path) -> None:
    """A demand curve is a non-empty list of finite numbers >= 0, not all zero (budgets are
    proportional to it); anything else is a RecordError naming the file and the bad value."""
    if not isinstance(demand, list) or not demand:
        got = "an empty list" if demand == [] else describe_json(demand)
        raise RecordError(f"{path}: `demand` must be a non-empty list of numbers (one per layer), got {got}")
    for layer, value in enumerate(demand):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < 0:
            shown = describe_json(value) if not ok else repr(value)
            raise RecordError(f"{path}: `demand` of layer {layer} must be a finite number >= 0, got {shown}")
    if not any(demand):
        raise RecordError(
            f"{path}: `demand` is zero on every layer, so it says nothing about where to keep tokens"
        )


def find_profile(config, search: list[Path] | None = None) -> Path | None:
    """The packaged (or given) profile whose config hash matches this model, if any."""
    want = config_hash(config)
    for folder in search or [PACKAGED_PROFILES]:
        for path in sorted(Path(folder).glob("*.json")):
            try:
                if read_json_object(path).get("config_hash") == want:
                    return path
            except (OSError, ValueError):
                continue
    return None
