"""Speed and memory benchmark: every method decodes exactly the same tokens.

The reference cache (the method that keeps every token) first writes `n` tokens greedily,
EOS suppressed so it never stops early. Every method × budget is then teacher-forced
through those tokens, one per forward: every run does identical model work, and only the
cache's costs differ (the keys attention reads; scoring, selection and compaction). A run's
step times, cache bytes, RSS, time inside the cache's own sections and top-1 agreement with
the reference are each also given as a ratio to the reference, and its decode time as
overhead over BASELINE at the same budget: the cost of scoring. (A small model's greedy
continuation may loop; speed does not care, only the top-1 column then reads high.)

Modules: runs (what to measure), timing, memory, decode (the loops), measure (runs and
ratios; one after the other or interleaved), capacity (batch capacity at fixed K/V memory:
the largest batch each run fits, decoded together), profiler, machine, tables, plots.
"""

from reasonkv.harness.bench.capacity import (
    MAX_BATCH,
    AlonePeaks,
    BatchPlan,
    alone_peaks,
    cache_allocations,
    capacity_batch,
    measure_batches,
    peak_kv_slots,
    peak_slots,
    peak_state_bytes,
    plan_batches,
    run_batch_capacity,
    slot_bytes,
)
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
    is_plain_reference,
    is_reference,
    plan_runs,
    reference_method,
    windows_of,
)
from reasonkv.harness.bench.tables import capacity_table, memory_table, summary_table, windows_table
from reasonkv.harness.bench.timing import SCORING, SELECTION, SectionTimer, instrument

__all__ = [
    "BASELINE",
    "MAX_BATCH",
    "PROFILE_GROUPS",
    "SAMPLE_EVERY",
    "SCORING",
    "SELECTION",
    "AlonePeaks",
    "BatchPlan",
    "BenchRun",
    "DecodeTrace",
    "Progress",
    "SectionTimer",
    "add_ratios",
    "alone_peaks",
    "cache_allocations",
    "capacity_batch",
    "capacity_table",
    "cache_bytes",
    "current_rss",
    "decode",
    "decode_many",
    "eos_ids",
    "instrument",
    "is_plain_reference",
    "is_reference",
    "machine_info",
    "max_rss",
    "measure_batches",
    "measure_runs",
    "memory_table",
    "peak_kv_slots",
    "peak_slots",
    "peak_state_bytes",
    "plan_batches",
    "plan_runs",
    "plot_benchmark",
    "profile_decode",
    "prompt_input",
    "reference_method",
    "reference_tokens",
    "release_memory",
    "run_batch_capacity",
    "run_benchmark",
    "slot_bytes",
    "summary_table",
    "windows_of",
    "windows_table",
]
