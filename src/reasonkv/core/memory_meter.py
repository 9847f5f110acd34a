"""K/V bytes as a process pays for them: what is allocated now, and the most ever at once.

Storage reports every allocation and release, so the peak includes the moments when a layer
holds its old and its new tensors together (growing, or compacting into fresh storage), and
sums the layers at that moment. Peak memory is what decides how many sequences fit.
"""

from __future__ import annotations


class MemoryMeter:
    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def allocated(self, n_bytes: int) -> None:
        self.current += n_bytes
        self.peak = max(self.peak, self.current)

    def released(self, n_bytes: int) -> None:
        self.current -= n_bytes

    def reset(self) -> None:
        self.current = self.peak = 0

    def restart_peak(self) -> int:
        """Start a new peak from what is held now (e.g. after a prompt's forward); return the old one."""
        old, self.peak = self.peak, self.current
        return old
