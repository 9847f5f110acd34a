"""K/V bytes as a process pays for them: what is allocated now, and the most ever at once.

Storage reports every allocation and release, so the peak includes the moments when a layer
holds its old and its new tensors together (growing, or compacting into fresh storage), and
sums the layers at that moment. Peak memory is what decides how many sequences fit.

A second count, "at 16 bits", prices every floating-point element at 2 bytes (integer codes
as they are): what the same cache would hold served in bf16/fp16, which is how caches are
served, when the evidence model runs in fp32. Quantized and unquantized storage compare on it
at their serving cost instead of at fp32's doubled price for the unquantized part.
"""

from __future__ import annotations

import torch

SERVED_FLOAT_BYTES = 2
"""Bytes a floating-point element costs at serving precision (bf16 / fp16)."""


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tensor_bytes_16bit(t: torch.Tensor) -> int:
    """`t`'s bytes with floating-point elements at 16 bits (integer codes unchanged)."""
    size = min(t.element_size(), SERVED_FLOAT_BYTES) if t.is_floating_point() else t.element_size()
    return t.numel() * size


class MemoryMeter:
    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.current_16bit = 0
        self.peak_16bit = 0

    def allocated(self, n_bytes: int, n_bytes_16bit: int | None = None) -> None:
        self.current += n_bytes
        self.current_16bit += n_bytes if n_bytes_16bit is None else n_bytes_16bit
        self.peak = max(self.peak, self.current)
        self.peak_16bit = max(self.peak_16bit, self.current_16bit)

    def released(self, n_bytes: int, n_bytes_16bit: int | None = None) -> None:
        self.current -= n_bytes
        self.current_16bit -= n_bytes if n_bytes_16bit is None else n_bytes_16bit

    def add(self, *tensors: torch.Tensor) -> None:
        """Count `tensors` as allocated (both counts)."""
        self.allocated(sum(map(tensor_bytes, tensors)), sum(map(tensor_bytes_16bit, tensors)))

    def remove(self, *tensors: torch.Tensor) -> None:
        self.released(sum(map(tensor_bytes, tensors)), sum(map(tensor_bytes_16bit, tensors)))

    def reset(self) -> None:
        self.current = self.peak = self.current_16bit = self.peak_16bit = 0

    def restart_peak(self) -> tuple[int, int]:
        """Start new peaks from what is held now (e.g. after a prompt's forward); return the old
        ones (bytes, bytes at 16 bits)."""
        old = (self.peak, self.peak_16bit)
        self.peak, self.peak_16bit = self.current, self.current_16bit
        return old
