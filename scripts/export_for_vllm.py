"""Save a model reasonkv loads (the bundled GGUF by default) as the folder vLLM loads:

    python scripts/export_for_vllm.py build/smollm2-135m [--model NAME] [--dtype float32]

`reasonkv serve` does this by itself, once, into a cache folder (reasonkv.core.model_folder).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reasonkv.core.model_folder import export_model_folder
from reasonkv.core.models import DEFAULT_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    print(export_model_folder(args.out, args.model, args.dtype))


if __name__ == "__main__":
    main()
