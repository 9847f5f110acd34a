"""One request's slots of one layer in a serving engine's paged cache: the step's second storage.

A serving engine (vLLM) stores the keys and values in its own paged cache and attends with its
own kernel; what reasonkv adds is the decision of which tokens to keep, made by the same
`LayerStep` (core/step.py) that runs in transformers. `PagedRequestStorage` is the `StepStorage`
it runs over here: which token each slot holds and the per-token scorer state (one row, the
request), K/V read from the engine's cache only when a hook asks (`ReadKV`), and a kept selection
moved, as stored, into the request's first slots (`MoveKV`), after which the engine frees the
blocks past the new length.

One block table is shared by all layers and heads of a request, so every head keeps the same
number of tokens: only methods with one budget for every layer and head run here (the adapter
refuses the others by name before the engine starts).

A decode step that does not compress touches no tensor here: its token is only counted, and
the new slots' indices and zero states join when a policy next reads them.

Pure torch: it imports no engine and no transformers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PENDING_QUERIES = 8
"""Decode queries a request's layer sets aside before they join its query window
(`LayerStep(query_wait=...)`): the window then changes once per this many steps."""

ReadKV = Callable[[int, bool], tuple[torch.Tensor, torch.Tensor | None]]
"""`read(length, values)`: the request's first `length` keys of this layer, [1, H, length, D] in
slot order and in the model's dtype (dequantised where the engine stores fp8), and its values the
same way when `values` is true (else None)."""

MoveKV = Callable[[torch.Tensor, int], None]
"""`move(slots, first)`: slots [H, K - first], ascending per head: each head's kept slots of this
layer past the first `first` (which keep their tokens where they are), moved as the engine stores
them (bytes and all: no rounding) into the request's slots `first` .. K - 1."""


class PagedRequestStorage:
    """The `StepStorage` of one (request, layer) whose K/V live in the engine's paged cache."""

    def __init__(
        self, n_heads: int, head_dim: int, state_names: tuple[str, ...], dtype: torch.dtype, device
    ) -> None:
        self.n_heads, self.head_dim, self.dtype, self.device = n_heads, head_dim, dtype, device
        self._token_index = torch.empty(1, n_heads, 0, dtype=torch.long, device=device)
        self._token_state = {n: torch.zeros(1, n_heads, 0, device=device) for n in state_names}
        self._joined = 0  # tokens [0, _joined) have slots in _token_index; the rest are counted only
        self._counted = 0
        self._read: ReadKV | None = None
        self._move: MoveKV | None = None
        self._kv: dict[str, torch.Tensor | None] = {}
        self.compacted = False  # a selection was written this step

    # ------------------------------------------------------------ the engine's side
    def extend(self, q: int) -> None:
        """Count q tokens the engine has written after the held slots."""
        self._counted += q

    def bind(self, read: ReadKV, move: MoveKV) -> None:
        """This step's access to the engine's cache (reads are made at most once a step)."""
        self._read, self._move, self._kv, self.compacted = read, move, {}, False

    def unbind(self) -> None:
        self._read = self._move = None
        self._kv = {}

    @property
    def length(self) -> int:
        """Slots the request holds in this layer (every head the same)."""
        return self._token_index.shape[-1] + self._counted - self._joined

    # ------------------------------------------------------------ StepStorage
    @property
    def token_index(self) -> torch.Tensor:
        self._join()
        return self._token_index

    @property
    def token_state(self) -> dict[str, torch.Tensor]:
        self._join()
        return self._token_state

    @property
    def n_valid(self) -> torch.Tensor:
        return torch.full((1, self.n_heads), self.length, dtype=torch.long, device=self.device)

    @property
    def live_upper(self) -> int:
        return self.length * self.n_heads

    @property
    def shape(self) -> tuple[int, int, int, torch.device]:
        return 1, self.n_heads, self.head_dim, self.device

    def record_positions(self, index: torch.Tensor, positions: torch.Tensor) -> None:
        """Keys are stored post-RoPE by the engine: nothing to record."""

    def read_keys(self) -> torch.Tensor:
        if "keys" not in self._kv:
            self._kv["keys"], self._kv["values"] = self._read(self.length, False)
        return self._kv["keys"]

    def read_values(self) -> torch.Tensor:
        keys = self.read_keys()
        if self._kv["values"] is None:
            self._kv["values"] = self._read(keys.shape[2], True)[1]
        return self._kv["values"]

    def single_evictions(self, keep: torch.Tensor, protected: torch.Tensor) -> torch.Tensor | None:
        return None  # no holes in a block table: every selection is written compacted

    def evict_slot(self, victim: torch.Tensor, scores: torch.Tensor) -> None:
        raise RuntimeError("a paged request keeps no holes")

    def keep_slots(self, slots: torch.Tensor, new_len: torch.Tensor, scores: torch.Tensor) -> None:
        slots = slots[0]  # [H, K] ascending
        # Slots that keep their token are not written: a kept prompt's blocks stay as they are
        # (a prefix cache may share them: serving/prefix_sharing.py). One read for the three counts.
        stays = (slots == torch.arange(slots.shape[-1], device=slots.device)).all(0)
        counts = torch.stack([new_len.min(), new_len.max(), stays.int().cumprod(0).sum()])
        kept, widest, first = counts.tolist()
        if kept != widest:
            raise RuntimeError(
                f"heads keep {new_len.tolist()} tokens; a shared block table needs one count for every head"
            )
        slots = slots[:, :kept]
        if first < kept:
            self._move(slots[:, first:], first)
        index = self.token_index
        self._token_index = index.gather(2, slots[None])
        self._token_state = {n: t.gather(2, slots[None]) for n, t in self._token_state.items()}
        self._kv, self.compacted = {}, True

    def _join(self) -> None:
        """Give the counted tokens their slots: their sequence indices, and zero scorer states."""
        q = self._counted - self._joined
        if q == 0:
            return
        new = torch.arange(self._joined, self._counted, device=self.device).expand(1, self.n_heads, q)
        self._token_index = torch.cat([self._token_index, new], dim=-1)
        for name, tensor in self._token_state.items():
            self._token_state[name] = torch.cat([tensor, tensor.new_zeros(1, self.n_heads, q)], dim=-1)
        self._joined = self._counted
