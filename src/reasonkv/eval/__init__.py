"""Evaluation harness: datasets, trace replay, accuracy, sweeps (depends on the layers above it)."""
