"""Run one vLLM engine over token-id prompts and write what it produced, as JSON.

`python engine_run.py SPEC.json OUT.json` (a spawned engine needs a script of its own: vLLM's
engine core is a separate process). SPEC: model (a folder), dtype, reasonkv (the
additional_config entry, or null: off), prompts (lists of token ids), max_tokens (one, or one a
prompt), extra_args (one a prompt, or null), block_size, num_blocks, max_num_seqs,
max_model_len, max_num_batched_tokens (null: vLLM's default), enable_prefix_caching,
kv_cache_dtype ("auto" unless given); optionally waves (lists of prompt indices, run one
`generate` after another: "waves" in the result has each one's tokens and cached prompt tokens)
and continuation (one more wave: prompt `from` and the first `take` tokens it generated in its
first wave, with its own max_tokens and extra_args). The environment chooses
the rest: VLLM_PLUGINS=none runs plain vLLM; REASONKV_VLLM_TRACE records the adapter's steps.
"""

from __future__ import annotations

import json
import os
import sys


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(open(spec_path).read())
    extra = {}
    if spec.get("reasonkv") is not None:
        extra["additional_config"] = {"reasonkv": spec["reasonkv"]}
    if "enable_prefix_caching" in spec:
        extra["enable_prefix_caching"] = spec["enable_prefix_caching"]
    if spec.get("kv_cache_dtype"):
        extra["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("max_num_batched_tokens"):
        extra["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 1024),
        enforce_eager=True,
        block_size=spec.get("block_size", 32),
        num_gpu_blocks_override=spec.get("num_blocks", 64),
        max_num_seqs=spec.get("max_num_seqs", 16),
        seed=0,
        **extra,
    )
    lengths = spec["max_tokens"]
    if isinstance(lengths, int):
        lengths = [lengths] * len(spec["prompts"])
    extra_args = spec.get("extra_args") or [None] * len(spec["prompts"])
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False, extra_args=extra)
        for n, extra in zip(lengths, extra_args, strict=True)
    ]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    if "waves" not in spec:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
        open(out_path, "w").write(json.dumps(result))
        return
    waves, first_output = [], {}
    for wave in spec["waves"]:
        trace_mark(len(waves))
        outputs = llm.generate([prompts[i] for i in wave], [params[i] for i in wave], use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        for i, out in zip(wave, tokens, strict=True):
            first_output.setdefault(i, out)
        waves.append({"tokens": tokens, "cached": [o.num_cached_tokens for o in outputs]})
    more = spec.get("continuation")
    if more is not None:
        trace_mark(len(waves))
        prompt = spec["prompts"][more["from"]] + first_output[more["from"]][: more["take"]]
        param = SamplingParams(
            max_tokens=more["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
            extra_args=more.get("extra_args"),
        )  # fmt: skip
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], [param], use_tqdm=False)
        waves.append({"tokens": [list(output.outputs[0].token_ids)], "cached": [output.num_cached_tokens]})
    open(out_path, "w").write(json.dumps({"waves": waves}))


def trace_mark(wave: int) -> None:
    """A line in the adapter's trace where a wave starts (the scheduler's lines follow)."""
    path = os.environ.get("REASONKV_VLLM_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": "wave", "wave": wave}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
