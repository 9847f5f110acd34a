"""Reasoning Wave profiles on disk: JSON keyed by a hash of the attention-relevant config,
so a profile is never applied to a model it was not made for. Making one is the harness's
job (`reasonkv.harness.profile`); reading one is all a cache needs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from reasonkv.util.records import write_json_atomic

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
    profile = json.loads(path.read_text())
    if "demand" not in profile or "config_hash" not in profile:
        raise ValueError(f"{path} is not a reasonkv profile (no demand curve / config hash)")
    if config is not None and profile["config_hash"] != config_hash(config):
        raise ValueError(
            f"profile {path} was made for {profile.get('model')!r} (config {profile['config_hash']}), "
            f"not for this model (config {config_hash(config)}); profile this model with `reasonkv profile`"
        )
    return profile


def find_profile(config, search: list[Path] | None = None) -> Path | None:
    """The packaged (or given) profile whose config hash matches this model, if any."""
    want = config_hash(config)
    for folder in search or [PACKAGED_PROFILES]:
        for path in sorted(Path(folder).glob("*.json")):
            try:
                if json.loads(path.read_text()).get("config_hash") == want:
                    return path
            except (OSError, json.JSONDecodeError):
                continue
    return None
