"""Speed and memory benchmark: every method decodes exactly the same tokens.

The reference cache (the method that keeps every token) first writes `n` tokens greedily
(EOS suppressed, so it never stops early). Then every method × budget is *teacher-forced*
through those tokens, one token per forward (`model(input_ids=token, cache=cache)`), so every
run does identical model work and the only differences are the cache's: how many keys
attention reads, and what scoring, selection and compaction cost. Per run we record

- the wall time of every decode step (tokens/s per length window),
- `cache.memory()` at each length mark (physical and K/V bytes), and samples of it in between,
- the process RSS (sampled) and its peak (per run only when runs go one after the other),
- the time spent inside the cache's own work, through its timer hook (the sections it opens:
  the K/V write, the mask, scoring, selection with its compaction, the post-attention work),
- top-1 agreement of each step's argmax with the reference's next token (a free fidelity check),

and each as a ratio to the reference measured in the same process, plus the overhead over
BASELINE (streaming) at the same budget: the cost of scoring.

Runs go one after the other (each from a clean memory baseline), or interleaved: every run
takes its step i before any takes step i + 1, so on a shared machine a burst of load from
other processes slows all runs alike and the ratios stay fair.

The greedy continuation of a small model may loop after a few hundred tokens; that does not
matter for speed (every run does the same work), only the top-1 column reads high then.

Modules: runs (what to measure), timing, memory, decode (the loops), measure (runs and
ratios), profiler, machine, tables, plots.
"""

from reasonkv.harness.bench.decode import (
    SAMPLE_EVERY,
    DecodeTrace,
    Progress,
    decode,
    decode_many,
    eos_ids,
    prompt_input,
    reference_tokens,
)
from reasonkv.harness.bench.machine import machine_info
from reasonkv.harness.bench.measure import add_ratios, measure_runs, run_benchmark
from reasonkv.harness.bench.memory import cache_bytes, current_rss, max_rss, release_memory
from reasonkv.harness.bench.plots import plot_benchmark
from reasonkv.harness.bench.profiler import PROFILE_GROUPS, profile_decode
from reasonkv.harness.bench.runs import (
    BASELINE,
    BenchRun,
    is_reference,
    plan_runs,
    reference_method,
    windows_of,
)
from reasonkv.harness.bench.tables import memory_table, summary_table, windows_table
from reasonkv.harness.bench.timing import SCORING, SELECTION, SectionTimer, instrument

__all__ = [
    "BASELINE",
    "PROFILE_GROUPS",
    "SAMPLE_EVERY",
    "SCORING",
    "SELECTION",
    "BenchRun",
    "DecodeTrace",
    "Progress",
    "SectionTimer",
    "add_ratios",
    "cache_bytes",
    "current_rss",
    "decode",
    "decode_many",
    "eos_ids",
    "instrument",
    "is_reference",
    "machine_info",
    "max_rss",
    "measure_runs",
    "memory_table",
    "plan_runs",
    "plot_benchmark",
    "profile_decode",
    "prompt_input",
    "reference_method",
    "reference_tokens",
    "release_memory",
    "run_benchmark",
    "summary_table",
    "windows_of",
    "windows_table",
]
