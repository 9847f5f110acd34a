"""One layer's recent queries: what scorers read, kept across decode steps.

Queries are post-RoPE `[B, Hq, W, D]`, oldest first, with their sequence indices (-1 for
padding) and RoPE positions `[B, W]`. The first forward is the prompt: it fixes `prompt_end`.
With `bits=8` the queries are held as int8 codes with a scale a query (core/policy/vector_codes)
and decoded, in the model's dtype, when read.

An engine that runs a layer's step once per request may let decode queries wait (`wait`): they
join the window in one step when enough wait or when anything reads it, which keeps exactly what
one `keep` a step would (the last `size` of the window and the queries, at once or one by one).
A scorer that observes every forward but only counts its queries (BeaconKV) sees them there, as
one forward (`on_join`, called before they are kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reasonkv.core.policy.vector_codes import decode_vectors, encode_vectors


class QueryWindow:
    def __init__(self, bits: int = 16) -> None:
        if bits not in (16, 8):
            raise ValueError(f"a query window holds queries at 16 or 8 bits, got {bits}")
        self.bits = bits
        self._held: torch.Tensor | None = None  # [B, Hq, W, D]: the queries, or their codes
        self._scale: torch.Tensor | None = None  # [B, Hq, W, 1] with codes
        self._dtype: torch.dtype | None = None
        self._index: torch.Tensor | None = None  # [B, W]
        self._positions: torch.Tensor | None = None  # [B, W]
        self.prompt_end: torch.Tensor | None = None  # [B] sequence index where generation starts
        self._waiting: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (query, positions)
        self._waiting_from = 0  # sequence index of the first waiting query
        self._waiting_size = 0  # the `size` they join with
        self.on_join: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        """Called with the waiting queries, their indices and positions as they join, before
        they are kept (the window then still holds what it held before them)."""

    @property
    def query_index(self) -> torch.Tensor | None:
        """[B, W] sequence index of each kept query (-1: padding)."""
        self._join()
        return self._index

    @property
    def query_positions(self) -> torch.Tensor | None:
        """[B, W] RoPE position of each kept query."""
        self._join()
        return self._positions

    @property
    def queries(self) -> torch.Tensor | None:
        """[B, Hq, W, D] the kept queries (decoded, when held as codes)."""
        self._join()
        if self._scale is None:
            return self._held
        return decode_vectors(self._held, self._scale).to(self._dtype)

    @queries.setter
    def queries(self, queries: torch.Tensor | None) -> None:
        self._dtype = None if queries is None else queries.dtype
        if queries is None or self.bits == 16:
            self._held, self._scale = queries, None
        else:
            self._held, self._scale = encode_vectors(queries)

    @property
    def size(self) -> int:
        """Queries kept (no decoding)."""
        self._join()
        return self.joined_size

    @property
    def joined_size(self) -> int:
        """Queries kept, not counting those still waiting (nothing joins)."""
        return 0 if self._held is None else self._held.shape[2]

    def join(self) -> None:
        """Join the waiting queries now."""
        self._join()

    def label(
        self,
        query: torch.Tensor,
        first_index: int | torch.Tensor,
        new_valid: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence indices [B, q] (-1 for padding) and RoPE positions [B, q] of a forward's
        queries (positions = indices when the model passes no position_ids). `first_index`: the
        first query's index, one for every row or [B] (rows at different positions)."""
        b, q = query.shape[0], query.shape[2]
        steps = torch.arange(q, device=query.device)
        if isinstance(first_index, torch.Tensor):
            index = first_index.to(query.device)[:, None] + steps
        else:
            index = (first_index + steps).expand(b, q)
        if new_valid is not None:
            index = index.masked_fill(~new_valid, -1)
        positions = index if positions is None else positions.expand(b, -1).to(index.dtype)
        if self.prompt_end is None:
            self.prompt_end = (
                (index[:, -1] + 1)
                if isinstance(first_index, torch.Tensor)
                else torch.full((b,), first_index + q, dtype=torch.long, device=query.device)
            )
        return index, positions

    def keep(self, query: torch.Tensor, index: torch.Tensor, positions: torch.Tensor, size: int) -> None:
        """Keep the last `size` queries of (the window, this forward's queries)."""
        if size <= 0:
            return
        self._join()
        if self._held is None or query.shape[2] >= size:
            # Copies: a slice of a long prefill would keep all its queries alive.
            self.queries = query[:, :, -size:].detach().clone()
            self._index = index[:, -size:].clone()
            self._positions = positions[:, -size:].clone()
            return
        # The oldest go before the join, so the new tensors hold exactly what is kept (a slice
        # of the joined ones would keep a query more alive); codes join as codes.
        drop = max(self._held.shape[2] + query.shape[2] - size, 0)
        if self._scale is None:
            self._held = torch.cat([self._held[:, :, drop:], query.detach()], dim=2)
        else:
            codes, scale = encode_vectors(query.detach())
            self._held = torch.cat([self._held[:, :, drop:], codes], dim=2)
            self._scale = torch.cat([self._scale[:, :, drop:], scale], dim=2)
        self._index = torch.cat([self._index[:, drop:], index], dim=1)
        self._positions = torch.cat([self._positions[:, drop:], positions], dim=1)

    def wait(
        self,
        query: torch.Tensor,
        first_index: int | torch.Tensor,
        positions: torch.Tensor | None,
        size: int,
        limit: int,
    ) -> None:
        """Set a forward's queries aside, to join as `label` + `keep(size)` would: when `limit`
        wait, when the forward has more than one query (a prompt chunk), or when read."""
        if not self._waiting:
            self._waiting_from, self._waiting_size = first_index, size
        if len(self._waiting) + 1 >= limit or query.shape[2] > 1 or self.prompt_end is None:
            self._waiting.append((query, positions))
            self._join()
            return
        # A copy: an engine reuses its tensors, and a view of one row of a step with a long
        # prefill chunk would keep the whole step's queries alive.
        self._waiting.append((query.detach().clone(), None if positions is None else positions.clone()))

    def _join(self) -> None:
        if not self._waiting:
            return
        waiting, self._waiting = self._waiting, []
        query = torch.cat([w[0] for w in waiting], dim=2) if len(waiting) > 1 else waiting[0][0]
        positions = None
        if waiting[0][1] is not None:
            positions = torch.cat([w[1] for w in waiting], dim=-1) if len(waiting) > 1 else waiting[0][1]
        index, positions = self.label(query, self._waiting_from, None, positions)
        if self.on_join is not None:
            self.on_join(query, index, positions)
        self.keep(query, index, positions, self._waiting_size)

    def span(
        self, start: int, end: int, *, join: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kept queries [start, end) with their indices and positions (only those decoded); with
        `join` False, of the joined queries, leaving any waiting ones waiting."""
        if join:
            self._join()
        if self._scale is None:
            queries = self._held[:, :, start:end]
        else:
            queries = decode_vectors(self._held[:, :, start:end], self._scale[:, :, start:end]).to(
                self._dtype
            )
        return queries, self._index[:, start:end], self._positions[:, start:end]

    def last(self, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The newest `n` kept queries with their indices and positions."""
        if self._held is None or self.size <= n:
            return self.queries, self.query_index, self.query_positions
        return self.span(self.size - n, self.size)

    ROW_TENSORS = ("_held", "_scale", "_index", "_positions", "prompt_end")

    def select_rows(self, rows: torch.Tensor) -> None:
        self._join()
        for name in self.ROW_TENSORS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))

    def rows_copy(self, rows: torch.Tensor) -> QueryWindow:
        """A window of rows `rows` [R'] only (copies): this one is unchanged."""
        self._join()
        out = QueryWindow(self.bits)
        out._dtype = self._dtype
        for name in self.ROW_TENSORS:
            t = getattr(self, name)
            setattr(out, name, None if t is None else t.index_select(0, rows.to(t.device)))
        return out

    def join_rows(self, other: QueryWindow) -> None:
        """Append `other`'s rows after these; the shorter window is padded at its oldest end
        with queries of index -1 (what a left-padded batch holds: never read as queries)."""
        self._join()
        other._join()
        if self._held is None or other._held is None:
            if self._held is not None or other._held is not None:
                raise ValueError("a query window that has kept queries joins only another that has")
            self.prompt_end = torch.cat([self.prompt_end, other.prompt_end])
            return
        width = max(self._held.shape[2], other._held.shape[2])

        def padded(t: torch.Tensor, dim: int, fill: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_full(shape, fill), t], dim=dim)

        for name, dim, fill in (("_held", 2, 0), ("_scale", 2, 1), ("_index", 1, -1), ("_positions", 1, -1)):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None:
                setattr(self, name, torch.cat([padded(mine, dim, fill), padded(theirs, dim, fill)]))
        self.prompt_end = torch.cat([self.prompt_end, other.prompt_end])

    def tensors(self) -> list[torch.Tensor]:
        return self.query_tensors() + ([] if self.prompt_end is None else [self.prompt_end])

    def query_tensors(self) -> list[torch.Tensor]:
        """The kept queries with their sequence indices and positions (and those waiting)."""
        ts = (self._held, self._scale, self._index, self._positions)
        waiting = [t for w in self._waiting for t in w if t is not None]
        return [t for t in ts if t is not None] + waiting
