"""Where BeaconKV's per-step cost goes, and whether torch.compile would help its FPS.

Decodes `--steps` random tokens after a `--prompt`-token prefill with `beaconkv` at
`--budget` on the default model, one torch thread, timing from outside (wrappers, the
cache is not modified): the whole step, the scorer's `on_step` (queue upkeep, batched
feeds included), `score` (feeds it triggers included), and the beacon feeds by how many
layers each served. Then times farthest-point sampling on buffers of the model's shape
(layers x KV heads x 32 points x head dim: one batched shrink), eager and under `torch.compile`.

    REASONKV_THREADS=1 .venv/bin/python benchmarks/beacon_upkeep.py --out beacon_upkeep.json
    REASONKV_THREADS=1 .venv/bin/python benchmarks/beacon_upkeep.py --set upkeep_every=1 --no-compile \
        --steps 256 --out upkeep-1.json    # another knob setting, side by side with the default
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from reasonkv.core.hf_compat import cache_arg


def decode_profile(model_name: str, budget: int, prompt: int, steps: int, seed: int, knobs: dict) -> dict:
    import reasonkv
    import reasonkv.core.policy.fps as fps
    from reasonkv.core.models import load_model
    from reasonkv.harness.bench import SectionTimer
    from reasonkv.util.runtime import quiet_loading

    with quiet_loading():
        model, _ = load_model(model_name)
    timer = SectionTimer()
    cache = reasonkv.make_cache(model, "beaconkv", budget, **knobs)
    cache.timer = timer  # on_step, score and the rest of the step
    scorer = cache.policy.scorer
    feed = scorer._feed

    def counted_feed(members, *args):
        return timer.wrap(f"feed ({len(members)} layers)", feed)(members, *args)

    scorer._feed = counted_feed
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prompt + steps), generator=gen)
    with torch.no_grad():
        model(input_ids=ids[:, :prompt], **cache_arg(cache))
        timer.reset()  # the prefill's feeds are not decode steps
        t0 = time.perf_counter()
        for i in range(prompt, prompt + steps):
            model(input_ids=ids[:, i : i + 1], **cache_arg(cache))
        wall = time.perf_counter() - t0
    step_ms = 1e3 * wall / steps
    parts = {
        name: {"ms_per_step": 1e3 * v["seconds"] / steps, "calls": v["calls"], "share": v["seconds"] / wall}
        for name, v in timer.as_dict().items()
    }
    return {
        "model": model_name,
        "budget": budget,
        "knobs": knobs,
        "prompt": prompt,
        "steps": steps,
        "layers": len(cache.layers),
        "kv_heads": cache.layers[0].keys.shape[1],
        "head_dim": cache.layers[0].keys.shape[3],
        "step_ms": step_ms,
        "parts": parts,
        "beacon_ms_per_step": parts["on_step"]["ms_per_step"] + parts["score"]["ms_per_step"],
        "fps_module": fps.__name__,
    }


def fps_compile(shape: tuple[int, ...], keep: int, repeats: int) -> dict:
    from reasonkv.core.policy.fps import farthest_point_sample

    points = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    seed = shape[-2] - 1

    def per_call_ms(fn) -> float:
        fn(points, keep, seed)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn(points, keep, seed)
        return 1e3 * (time.perf_counter() - t0) / repeats

    eager = per_call_ms(farthest_point_sample)
    t0 = time.perf_counter()
    compiled_fn = torch.compile(farthest_point_sample, dynamic=False)
    compiled_fn(points, keep, seed)
    compile_s = time.perf_counter() - t0
    compiled = per_call_ms(compiled_fn)
    same = torch.equal(compiled_fn(points, keep, seed), farthest_point_sample(points, keep, seed))
    return {
        "shape": list(shape),
        "keep": keep,
        "eager_ms": eager,
        "compiled_ms": compiled,
        "compile_seconds": compile_s,
        "same_result": same,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--prompt", type=int, default=600, help="prefill tokens (past the budget: it compresses)")
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile comparison")
    p.add_argument("--set", action="append", default=[], help="key=value: a beaconkv knob (int), repeatable")
    p.add_argument("--out", type=Path, default=Path("beacon_upkeep.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    knobs = {k: int(v) for k, v in (s.split("=", 1) for s in args.set)}
    profile = decode_profile(args.model, args.budget, args.prompt, args.steps, args.seed, knobs)
    print(
        f"beaconkv@{args.budget}, {args.steps} decode steps after {args.prompt}: "
        f"{profile['step_ms']:.1f} ms/step"
    )
    print(f"{'part':<22}{'ms/step':>9}{'share':>8}{'calls':>8}")
    for name, part in profile["parts"].items():
        print(f"{name:<22}{part['ms_per_step']:>9.2f}{100 * part['share']:>7.1f}%{part['calls']:>8}")
    print("(on_step includes the feeds it triggers, score the ones it triggers)")
    record = {
        "command": "benchmarks/beacon_upkeep.py",
        "args": vars(args) | {"out": str(args.out)},
        **profile,
    }
    if not args.no_compile:
        shape = (profile["layers"], profile["kv_heads"], 32, profile["head_dim"])  # beacon_max = 32
        fps = fps_compile(shape, 16, 200)
        record["fps"] = fps
        print(
            f"FPS {tuple(shape)} -> 16: eager {fps['eager_ms']:.3f} ms, "
            f"torch.compile {fps['compiled_ms']:.3f} ms "
            f"(compile {fps['compile_seconds']:.1f} s, same result: {fps['same_result']})"
        )
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
