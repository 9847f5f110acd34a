"""K/V bytes as a process pays for them: what is allocated now, and the most ever at once.

Storage reports every allocation and release, so the peak includes the moments when a layer
holds its old and its new tensors together (growing, or compacting into fresh storage), and
sums the layers at that moment. Peak memory is what decides how many sequences fit.

A second count, "at 16 bits", prices every floating-point element at 2 bytes (integer codes
as they are): what the same cache would hold served in bf16/fp16, which is how caches are
served, when the evidence model runs in fp32. Quantized and unquantized storage compare on it
at their serving cost instead of at fp32's doubled price for the unquantized part.

Beside the K/V, a sequence holds its slot indices, query windows, beacon buffers, per-token
scores and policy state. Each layer recounts those at the end of its step (`hold_beside`), by
the storage they hold (a view holds its whole storage), so `state` is everything the cache
holds between steps, and `peak_state` is the most at once: at every K/V moment (growth,
compaction, a step's dequantized view) the K/V then held plus the rest as last recounted.
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


def held_bytes(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """Bytes the distinct storages under `tensors` hold (a view holds its whole storage, and two
    views of one storage count once): as held, and with floating-point elements at 16 bits."""
    seen: set[tuple[int, torch.device]] = set()
    total = total_16bit = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        n = storage.nbytes()
        total += n
        size = t.element_size()
        total_16bit += n * min(size, SERVED_FLOAT_BYTES) // size if t.is_floating_point() else n
    return total, total_16bit


class MemoryMeter:
    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.current_16bit = 0
        self.peak_16bit = 0
        self._beside: dict[object, tuple[int, int]] = {}  # owner -> what it holds beside K/V
        self.beside = 0
        self.beside_16bit = 0
        self.peak_state = 0
        self.peak_state_16bit = 0

    def allocated(self, n_bytes: int, n_bytes_16bit: int | None = None) -> None:
        self.current += n_bytes
        self.current_16bit += n_bytes if n_bytes_16bit is None else n_bytes_16bit
        self.peak = max(self.peak, self.current)
        self.peak_16bit = max(self.peak_16bit, self.current_16bit)
        self._state_peaks()

    def released(self, n_bytes: int, n_bytes_16bit: int | None = None) -> None:
        self.current -= n_bytes
        self.current_16bit -= n_bytes if n_bytes_16bit is None else n_bytes_16bit

    def hold_beside(self, owner: object, n_bytes: int, n_bytes_16bit: int) -> None:
        """`owner` (a layer, the cache) now holds this much beside the K/V (replacing its last count)."""
        old, old_16bit = self._beside.get(owner, (0, 0))
        self._beside[owner] = (n_bytes, n_bytes_16bit)
        self.beside += n_bytes - old
        self.beside_16bit += n_bytes_16bit - old_16bit
        self._state_peaks()

    def beside_of(self, owner: object) -> int:
        """What `owner` held beside K/V at its last count (bytes, as held)."""
        return self._beside.get(owner, (0, 0))[0]

    @property
    def state(self) -> int:
        """Everything held now: K/V and what is held beside it."""
        return self.current + self.beside

    @property
    def state_16bit(self) -> int:
        return self.current_16bit + self.beside_16bit

    def _state_peaks(self) -> None:
        self.peak_state = max(self.peak_state, self.state)
        self.peak_state_16bit = max(self.peak_state_16bit, self.state_16bit)

    def add(self, *tensors: torch.Tensor) -> None:
        """Count `tensors` as allocated (both counts)."""
        self.allocated(sum(map(tensor_bytes, tensors)), sum(map(tensor_bytes_16bit, tensors)))

    def remove(self, *tensors: torch.Tensor) -> None:
        self.released(sum(map(tensor_bytes, tensors)), sum(map(tensor_bytes_16bit, tensors)))

    def reset(self) -> None:
        self.current = self.peak = self.current_16bit = self.peak_16bit = 0
        self._beside.clear()
        self.beside = self.beside_16bit = self.peak_state = self.peak_state_16bit = 0

    def restart_peak(self) -> tuple[int, int, int, int]:
        """Start new peaks from what is held now (e.g. after a prompt's forward); return the old
        ones (K/V bytes, K/V bytes at 16 bits, state bytes, state bytes at 16 bits)."""
        old = (self.peak, self.peak_16bit, self.peak_state, self.peak_state_16bit)
        self.peak, self.peak_16bit = self.current, self.current_16bit
        self.peak_state, self.peak_state_16bit = self.state, self.state_16bit
        return old
