"""Thought revisiting, measured on a user's own model and trace (`reasonkv analyze`).

Long chains of thought have queries that look far back ("thought revisiting"); a replay of
one trace with the full cache records each query's attention, per layer and KV head, and
from it: which queries are global (revisits.py: the rule), where attention lands by distance,
the keys each global query needed, and the per-layer attention entropy (the Reasoning Wave).
Method caches replay the same trace in lock-step (trace.py); the keys they had evicted before
a global query needed them are its missed revisits. report.py draws it all (figures.py) into
an offline index.html; beacons.py simulates BeaconKV's beacons on the recorded queries.

Modules: revisits (tensor math), beacons (FPS simulation, PCA), recorder (observing a
replay), trace (analyze_trace and the method lanes), results (what it returns), figures and
report (the page).
"""

from reasonkv.harness.analyze.beacons import pca_2d, simulate_beacons, unit
from reasonkv.harness.analyze.figures import (
    plot_attention_map,
    plot_distance_histograms,
    plot_entropy,
    plot_global_heatmap,
    plot_missed,
    plot_pca,
)
from reasonkv.harness.analyze.report import render_html, revisit_examples, summary_dict, write_report
from reasonkv.harness.analyze.results import MethodResult, TraceAnalysis
from reasonkv.harness.analyze.revisits import (
    NEVER_EVICTED,
    RevisitRule,
    approx_far_fraction,
    classify,
    default_distance,
    distance_edges,
    distance_histogram,
    eligible,
    eviction_times,
    far_fraction,
    far_keys,
    mean_distance,
    missed_revisits,
    needed_keys,
    normalised_entropy,
    persistent_keys,
    update_eviction_times,
)
from reasonkv.harness.analyze.trace import analyze_trace

__all__ = [
    "NEVER_EVICTED",
    "MethodResult",
    "RevisitRule",
    "TraceAnalysis",
    "analyze_trace",
    "approx_far_fraction",
    "classify",
    "default_distance",
    "distance_edges",
    "distance_histogram",
    "eligible",
    "eviction_times",
    "far_fraction",
    "far_keys",
    "mean_distance",
    "missed_revisits",
    "needed_keys",
    "normalised_entropy",
    "pca_2d",
    "persistent_keys",
    "plot_attention_map",
    "plot_distance_histograms",
    "plot_entropy",
    "plot_global_heatmap",
    "plot_missed",
    "plot_pca",
    "render_html",
    "revisit_examples",
    "simulate_beacons",
    "summary_dict",
    "unit",
    "update_eviction_times",
    "write_report",
]
