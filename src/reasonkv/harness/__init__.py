"""The harness: replay, evaluation, sweeps, reports, benchmarks and analysis.

Library code built on `reasonkv.methods` and `reasonkv.core`; no command-line code."""
