"""What one request may hold in an engine whose memory is sized up front, checked on its
settings alone (no model, no tensor) before it is scheduled.

A serving engine sizes its KV pool for `max_model_len`; what a request holds beside its K/V
(the query window, a scorer's buffers) lives outside that pool, and a knob sizes it. So:
- a token-count knob (a window, a buffer, a period) is at most `max_model_len`: longer than the
  context it cannot mean more, and it is what sizes buffers and loops;
- the head-dim vectors a request holds beside its K/V in a layer (query window, scorer state)
  are at most those of one uncompressed request at `max_model_len` (a key and a value per KV
  head and token): compressed, a request never holds more than the engine was sized for;
- a setting that cannot evict a token at that length is refused: it would pay the step's cost
  and save nothing. (A layer holds at most `max_model_len - 1` tokens: the last sampled token
  is never fed back.)
"""

from __future__ import annotations

from reasonkv.core.models import ModelShape
from reasonkv.core.step import LayerPolicy, window_keep
from reasonkv.methods.knobs import KnobError
from reasonkv.methods.resolved import ResolvedMethod


def check_fits(
    resolved: ResolvedMethod,
    policy: LayerPolicy,
    shape: ModelShape,
    max_model_len: int,
    query_wait: int = 0,
) -> None:
    """Raise KnobError (one line) when this resolved setting, as `policy` runs it, breaks a rule
    above; `query_wait` is the decode queries the engine lets wait beside the window."""
    method, budget = resolved.name, resolved.budget
    for name, value in resolved.token_knobs().items():
        if value > max_model_len:
            raise KnobError(
                f"parameter {name!r} of {method!r} counts tokens: at most max_model_len "
                f"({max_model_len}), got {value}"
            )
    first = policy.schedule.first_eviction(budget, policy.n_recent)
    if first is None or first >= max_model_len:  # a layer holds at most max_model_len - 1 tokens
        raise KnobError(
            f"budget {budget} never evicts a token of a request of at most max_model_len "
            f"({max_model_len}) tokens with {method!r}: lower it, or serve without reasonkv"
        )
    queries = (window_keep(policy) + query_wait) * shape.n_heads
    beside = queries + policy.scorer.state_vectors(shape.n_heads, shape.n_kv_heads)
    full = 2 * shape.n_kv_heads * max_model_len
    if beside > full:
        raise KnobError(
            f"{method!r} with these parameters holds {beside} vectors a layer beside its K/V "
            f"(queries and scorer state), more than one uncompressed request of max_model_len "
            f"({max_model_len}) tokens holds ({full}): lower its windows or buffers"
        )
