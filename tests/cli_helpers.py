"""What the command-line tests share: a Typer runner, a character tokenizer and a tiny Llama
(the fixtures that replace the slow model load, `fake_loader` and `no_loading`, are in conftest)."""

from __future__ import annotations

import torch
import typer
from transformers import LlamaForCausalLM
from typer.testing import CliRunner

from conftest import build_tiny_model

runner = CliRunner()
WIDE = {"COLUMNS": "250"}


class CharTokenizer:
    """Just enough of a tokenizer for reasonkv.generate: one token per character, left padding."""

    pad_token_id = 0
    pad_token = "<pad>"
    eos_token_id = None
    chat_template = None
    padding_side = "left"

    def encode_one(self, text: str) -> list[int]:
        return [3 + ord(c) % 120 for c in text]

    def __call__(self, texts, return_tensors=None, padding=False, add_special_tokens=True):
        if isinstance(texts, str):
            return {"input_ids": self.encode_one(texts)}
        ids = [self.encode_one(t) for t in texts]
        width = max(map(len, ids))
        input_ids = torch.tensor([[0] * (width - len(r)) + r for r in ids])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
        return {"input_ids": input_ids, "attention_mask": mask}

    def batch_decode(self, rows, skip_special_tokens=True):
        keep = lambda i: not (skip_special_tokens and i == 0)
        return [" ".join(f"t{i}" for i in map(int, row) if keep(i)) for row in rows]


def tiny_llama(attn: str = "sdpa") -> LlamaForCausalLM:
    """conftest's tiny Llama at init range 0.02, with BOS id 1 (no EOS)."""
    return build_tiny_model("llama", attn, seed=0, init_range=0.02, bos_token_id=1)


def errors_of(result) -> str:
    return result.stderr if result.stderr else result.output


def bench_app() -> typer.Typer:
    """The `reasonkv bench` command alone (a second, empty command keeps it a subcommand)."""
    from reasonkv.cli import bench as bench_cli

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("bench")(bench_cli.bench_command)

    @app.command("noop")
    def noop() -> None:
        pass

    return app
