"""Which of a compressed request's prompt blocks a paged engine's prefix cache may share.

A prefix cache names a block by the tokens it holds (a hash of them and of all before) and lets
a later request with the same tokens attend to it instead of computing it. Compaction moves a
request's kept tokens into its first slots, so a block it has rewritten no longer holds the
tokens its name says. Two rules keep sharing safe and the outputs unchanged:

- **Only blocks compaction never rewrites are named** (registered): with `protect_prompt` the
  whole prompt is always kept and, kept slots being in order, every prompt token stays in its
  slot; the prompt's full blocks are never written again (the storage moves nothing into a slot
  that keeps its token). Without it the prompt may be evicted: nothing is shared.
- **A request may start from a shared prefix** (hit) only where its step can do without the
  queries of that prefix, which no forward computes for it: the window's queries must all come
  after the hit (the hit ends at least `window_keep` tokens before the prompt's end), and the
  scorer's state must keep nothing of older prompt queries (`keeps_old_prompt_queries`).
  The step then starts as if the first chunk of the prompt had been fed without its queries
  (`PagedRowsStorage.add_row(request, held)` and `LayerStep.advance` by the shared tokens).

A head allocator that keeps what it saw (ReasonAlloc's running entropy) takes no hit either.
Requests that are not compressed follow the engine's own rules. Imports no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from reasonkv.core.step import LayerPolicy, window_keep


@dataclass(frozen=True)
class PromptSharing:
    """How much of one compressed request's prompt the prefix cache may share, in tokens."""

    hit: int
    """At most this many first tokens may come from blocks other requests computed (whole blocks)."""
    named: int
    """At most this many first tokens' blocks may be registered for later requests (whole blocks)."""


NOTHING_SHARED = PromptSharing(0, 0)


def prompt_sharing(policy: LayerPolicy, prompt_len: int, block_size: int) -> PromptSharing:
    """What a request compressed by `policy` with a prompt of `prompt_len` tokens may share."""
    if not policy.protect_prompt:
        return NOTHING_SHARED
    named = prompt_len // block_size * block_size
    if policy.scorer.keeps_old_prompt_queries() or policy.head_allocator is not None:
        return PromptSharing(0, named)
    hit = max(prompt_len - window_keep(policy), 0) // block_size * block_size
    return PromptSharing(hit, named)
