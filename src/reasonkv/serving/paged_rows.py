"""One layer's slots of a serving engine's requests, one row a request: the step's second storage.

A serving engine (vLLM) stores the keys and values in its own paged cache and attends with its
own kernel; what reasonkv adds is the decision of which tokens to keep, made by the same
`LayerStep` (core/step.py) that runs in transformers. `PagedRowsStorage` is the `StepStorage`
it runs over here: which token each slot of each row holds and the per-token scorer state
([R, H, T], a shorter row padded with EMPTY), K/V read from the engine's cache for every row
in one call when a hook asks (`ReadKV`), and the kept selections of every compressing row
moved, as stored, into their rows' first slots in one call (`MoveKV`), after which the engine
frees the blocks past each new length.

Rows come and go (`RowsStorage`): a request's prompt runs in a storage of its own, which then
joins its layer's pool of requests (`join_rows`); a finished request leaves (`select_rows`);
the rows that compress in a step are copied out, compressed and written back in place
(`rows_copy`, `put_rows`), so the others are neither read, scored nor copied.

One block table is shared by all layers and heads of a request, so every head of a row keeps
the same number of tokens: only methods with one budget for every layer and head run here (the
adapter refuses the others by name before the engine starts).

A decode step that does not compress touches no tensor here: its tokens are only counted (the
same count for every row), and the new slots' indices and zero states join when a policy next
reads them.

Pure torch: it imports no engine and no transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from reasonkv.core.policy.base import EMPTY

PENDING_QUERIES = 8
"""Decode queries a layer sets aside before they join its query window
(`LayerStep(query_wait=...)`): the window then changes once per this many steps."""

ReadKV = Callable[[list, int, bool], tuple[torch.Tensor, torch.Tensor | None]]
"""`read(ids, length, values)`: the first `length` keys of this layer of each request in `ids`,
[R, H, length, D] in slot order and in the model's dtype (dequantised where the engine stores
fp8; slots past a request's own are read as whatever they hold), and its values the same way
when `values` is true (else None)."""

MoveKV = Callable[[list, torch.Tensor, list, tuple[torch.Tensor, torch.Tensor]], None]
"""`move(ids, slots, kept, read)`: for each request of `ids`, its heads' kept slots `slots[r]`
[H, K] (ascending) of this layer moved into its slots 0 .. kept[r] - 1 (`kept`: ints), exactly
as stored (no second rounding); `read` holds the keys and values this step read (`ReadKV`), for
an engine that writes them back rather than moving its stored bytes. A token slot every head
keeps in place (slots[r, h, k] == k) is not written."""


def padded(t: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """`t` [..., T] widened to `width` with `fill` (exact for any integer: `pad` goes through a float)."""
    missing = width - t.shape[-1]
    return t if missing <= 0 else torch.cat([t, t.new_full((*t.shape[:-1], missing), fill)], dim=-1)


class PagedRowsStorage:
    """The `RowsStorage` of one layer's requests whose K/V live in the engine's paged cache."""

    def __init__(
        self, n_heads: int, head_dim: int, state_names: tuple[str, ...], dtype: torch.dtype, device
    ) -> None:
        self.n_heads, self.head_dim, self.dtype, self.device = n_heads, head_dim, dtype, device
        self.ids: list[Hashable] = []  # each row's request
        self._token_index = torch.empty(0, n_heads, 0, dtype=torch.long, device=device)
        self._token_state = {n: torch.zeros(0, n_heads, 0, device=device) for n in state_names}
        self._width: list[int] = []  # slots of each row with an entry in _token_index
        self._next: list[int] = []  # sequence index of each row's first token without one
        self._waiting = 0  # tokens counted after every row's joined slots (one count for all)
        self._read: ReadKV | None = None
        self._move: MoveKV | None = None
        self._kv: dict[str, torch.Tensor | None] = {}
        self.compacted: set[Hashable] = set()  # requests whose slots a selection wrote this step

    # ------------------------------------------------------------ the engine's side
    def add_row(self, request: Hashable, held: int = 0) -> None:
        """A first row: `request`, whose first `held` tokens the engine stores already (a
        prefix-cache hit) in its slots 0 .. held - 1. Only an empty storage takes one."""
        if self.ids:
            raise ValueError("a request's row is added to an empty storage (others join)")
        self.ids = [request]
        self._token_index = self._token_index.new_empty(1, self.n_heads, 0)
        self._token_state = {n: t.new_zeros(1, self.n_heads, 0) for n, t in self._token_state.items()}
        self._width, self._next, self._waiting = [0], [0], held

    def extend(self, q: int) -> None:
        """Count q tokens of every row, written by the engine after the row's held slots."""
        self._waiting += q

    def bind(self, read: ReadKV, move: MoveKV) -> None:
        """This step's access to the engine's cache (reads are made at most once a step)."""
        self._read, self._move, self._kv = read, move, {}

    def unbind(self) -> None:
        self._read = self._move = None
        self._kv = {}

    def lengths(self) -> list[int]:
        """Slots each row holds (every head the same)."""
        return [w + self._waiting for w in self._width]

    def length(self, request: Hashable) -> int:
        return self._width[self.ids.index(request)] + self._waiting

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
        lengths = torch.tensor(self.lengths(), dtype=torch.long, device=self.device)
        return lengths[:, None].expand(len(self.ids), self.n_heads)

    @property
    def live_upper(self) -> int:
        return max(self.lengths(), default=0) * self.n_heads

    @property
    def shape(self) -> tuple[int, int, int, torch.device]:
        return len(self.ids), self.n_heads, self.head_dim, self.device

    def record_positions(self, index: torch.Tensor, positions: torch.Tensor) -> None:
        """Keys are stored post-RoPE by the engine: nothing to record."""

    def read_keys(self) -> torch.Tensor:
        if "keys" not in self._kv:
            index = self.token_index
            keys, _ = self._read(self.ids, index.shape[-1], False)
            self._kv["keys"] = self._past_rows_zeroed(keys)
            self._kv["values"] = None
        return self._kv["keys"]

    def read_values(self) -> torch.Tensor:
        keys = self.read_keys()
        if self._kv["values"] is None:
            self._kv["values"] = self._past_rows_zeroed(self._read(self.ids, keys.shape[2], True)[1])
        return self._kv["values"]

    def _past_rows_zeroed(self, kv: torch.Tensor) -> torch.Tensor:
        """Zero where a shorter row has no slot: another request's data, or none, never scored."""
        if len(set(self._width)) <= 1:
            return kv
        return kv.masked_fill((self._token_index == EMPTY)[..., None], 0)

    def single_evictions(self, keep: torch.Tensor, protected: torch.Tensor) -> torch.Tensor | None:
        return None  # no holes in a block table: every selection is written compacted

    def evict_slot(self, victim: torch.Tensor, scores: torch.Tensor) -> None:
        raise RuntimeError("a paged request keeps no holes")

    def keep_slots(self, slots: torch.Tensor, new_len: torch.Tensor, scores: torch.Tensor) -> None:
        # One read for the rows' least and most kept a head (a block table is one count a row).
        least, most = torch.stack([new_len.amin(-1), new_len.amax(-1)]).tolist()
        if least != most:
            raise RuntimeError(
                f"heads keep {new_len.tolist()} tokens; a shared block table needs one count for every head"
            )
        width = max(most, default=0)
        slots = slots[:, :, :width]
        # Slots that keep their token are not written: a kept prompt's blocks stay as they are
        # (a prefix cache may share them: serving/prefix_sharing.py).
        self._move(self.ids, slots, most, (self.read_keys(), self.read_values()))
        index = self.token_index
        within = torch.arange(width, device=slots.device) < new_len[:, :1, None]  # [R, 1, K]
        safe = slots.clamp(max=max(index.shape[-1] - 1, 0))
        self._token_index = index.gather(2, safe).masked_fill(~within, EMPTY)
        self._token_state = {
            n: t.gather(2, safe).masked_fill(~within, 0) for n, t in self._token_state.items()
        }
        self._width = list(most)
        self._kv = {}
        self.compacted.update(self.ids)

    # ------------------------------------------------------------ rows come and go
    def rows_copy(self, rows: torch.Tensor) -> PagedRowsStorage:
        """Rows `rows` [R'] only, sharing this storage's access to the engine's cache and its
        record of the requests compacted."""
        self._join()
        picked = rows.tolist()
        out = PagedRowsStorage.__new__(PagedRowsStorage)
        out.__dict__.update(self.__dict__)
        out.ids = [self.ids[r] for r in picked]
        out._width, out._next = [self._width[r] for r in picked], [self._next[r] for r in picked]
        out._token_index, out._token_state = self._token_index, dict(self._token_state)
        out._select_tensors(rows)
        width = out._token_index.shape[-1]  # what was read this step, as wide as these rows
        out._kv = {
            n: None if t is None else t.index_select(0, rows)[:, :, :width] for n, t in self._kv.items()
        }
        return out

    def put_rows(self, rows: list[int], other: PagedRowsStorage, at: torch.Tensor) -> None:
        """Take `other`, a `rows_copy` of rows `rows` (`at` on the device) that compacted apart,
        back in their places."""
        if other.ids != [self.ids[r] for r in rows]:
            raise ValueError("rows return only to the places they were copied from")
        self._join()
        other._join()
        for r, width, nxt in zip(rows, other._width, other._next, strict=True):
            self._width[r], self._next[r] = width, nxt
        # A compaction only shrinks rows: the copy fits the pool's width, which may shrink too.
        full, width = self._token_index.shape[-1], max(self._width)
        index = self._token_index.index_copy(0, at, padded(other._token_index, full, EMPTY))
        self._token_index = index[..., :width]
        self._token_state = {
            n: t.index_copy(0, at, padded(other._token_state[n], full, 0))[..., :width]
            for n, t in self._token_state.items()
        }
        self._kv = {}
        self.compacted |= other.compacted

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` [R'] (in that order): a request that leaves, or a new order."""
        self._join()
        picked = rows.tolist()
        self.ids = [self.ids[r] for r in picked]
        self._width, self._next = [self._width[r] for r in picked], [self._next[r] for r in picked]
        self._kv = {}
        self._select_tensors(rows)

    def _select_tensors(self, rows: torch.Tensor) -> None:
        width = max(self._width, default=0)  # a longest row that left leaves only padding past this
        rows = rows.to(self.device)
        self._token_index = self._token_index.index_select(0, rows)[..., :width]
        self._token_state = {n: t.index_select(0, rows)[..., :width] for n, t in self._token_state.items()}

    def join_rows(self, other: PagedRowsStorage) -> None:
        """Append `other`'s rows after these (a request whose prompt is complete)."""
        self._join()
        other._join()
        width = max(self._width + other._width, default=0)
        self._token_index = torch.cat(
            [padded(self._token_index, width, EMPTY), padded(other._token_index, width, EMPTY)]
        )
        self._token_state = {
            n: torch.cat([padded(t, width, 0), padded(other._token_state[n], width, 0)])
            for n, t in self._token_state.items()
        }
        self.ids += other.ids
        self._width += other._width
        self._next += other._next
        self._kv = {}
        self.compacted |= other.compacted

    def _join(self) -> None:
        """Give the counted tokens their slots: their sequence indices, and zero scorer states."""
        q = self._waiting
        if q == 0:
            return
        rows, heads, device = len(self.ids), self.n_heads, self.device
        steps = torch.arange(q, device=device)
        if rows == 1:
            seq = (self._next[0] + steps)[None]
        else:
            seq = torch.tensor(self._next, device=device)[:, None] + steps  # [R, q]
        seq = seq[:, None].expand(rows, heads, q)
        if len(set(self._width)) == 1 and self._token_index.shape[-1] == self._width[0]:
            # Every row as long (one request; a pool in lock-step): the new slots follow.
            self._token_index = torch.cat([self._token_index, seq], dim=-1)
        else:
            width = max(self._width) + q
            slot = torch.tensor(self._width, device=device)[:, None] + steps  # [R, q]
            index = padded(self._token_index, width, EMPTY)
            self._token_index = index.scatter(2, slot[:, None].expand(rows, heads, q), seq)
        width = self._token_index.shape[-1]
        self._token_state = {n: padded(t, width, 0) for n, t in self._token_state.items()}
        self._width = [w + q for w in self._width]
        self._next = [n + q for n in self._next]
        self._waiting = 0
