"""One layer's recent queries: what scorers read, kept across decode steps.

Queries are post-RoPE `[B, Hq, W, D]`, oldest first, with their sequence indices (-1 for
padding) and RoPE positions `[B, W]`. The first forward is the prompt: it fixes `prompt_end`.
With `bits=8` the queries are held as int8 codes with a scale a query (core/policy/vector_codes)
and decoded, in the model's dtype, when read.
"""

from __future__ import annotations

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
        self.query_index: torch.Tensor | None = None  # [B, W]
        self.query_positions: torch.Tensor | None = None  # [B, W]
        self.prompt_end: torch.Tensor | None = None  # [B] sequence index where generation starts

    @property
    def queries(self) -> torch.Tensor | None:
        """[B, Hq, W, D] the kept queries (decoded, when held as codes)."""
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
        return 0 if self._held is None else self._held.shape[2]

    def label(
        self,
        query: torch.Tensor,
        first_index: int,
        new_valid: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence indices [B, q] (-1 for padding) and RoPE positions [B, q] of a forward's
        queries (positions = indices when the model passes no position_ids)."""
        b, q = query.shape[0], query.shape[2]
        index = torch.arange(first_index, first_index + q, device=query.device).expand(b, q)
        if new_valid is not None:
            index = index.masked_fill(~new_valid, -1)
        positions = index if positions is None else positions.expand(b, -1).to(index.dtype)
        if self.prompt_end is None:
            self.prompt_end = torch.full((b,), first_index + q, dtype=torch.long, device=query.device)
        return index, positions

    def keep(self, query: torch.Tensor, index: torch.Tensor, positions: torch.Tensor, size: int) -> None:
        """Keep the last `size` queries of (the window, this forward's queries)."""
        if size <= 0:
            return
        if self._held is None or query.shape[2] >= size:
            # Copies: a slice of a long prefill would keep all its queries alive.
            self.queries = query[:, :, -size:].detach().clone()
            self.query_index = index[:, -size:].clone()
            self.query_positions = positions[:, -size:].clone()
            return
        # The oldest go before the join, so the new tensors hold exactly what is kept (a slice
        # of the joined ones would keep a query more alive); codes join as codes.
        drop = max(self.size + query.shape[2] - size, 0)
        if self._scale is None:
            self._held = torch.cat([self._held[:, :, drop:], query.detach()], dim=2)
        else:
            codes, scale = encode_vectors(query.detach())
            self._held = torch.cat([self._held[:, :, drop:], codes], dim=2)
            self._scale = torch.cat([self._scale[:, :, drop:], scale], dim=2)
        self.query_index = torch.cat([self.query_index[:, drop:], index], dim=1)
        self.query_positions = torch.cat([self.query_positions[:, drop:], positions], dim=1)

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kept queries [start, end) with their indices and positions (only those decoded)."""
        if self._scale is None:
            queries = self._held[:, :, start:end]
        else:
            queries = decode_vectors(self._held[:, :, start:end], self._scale[:, :, start:end]).to(
                self._dtype
            )
        return queries, self.query_index[:, start:end], self.query_positions[:, start:end]

    def last(self, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The newest `n` kept queries with their indices and positions."""
        if self._held is None or self.size <= n:
            return self.queries, self.query_index, self.query_positions
        return self.span(self.size - n, self.size)

    def select_rows(self, rows: torch.Tensor) -> None:
        for name in ("_held", "_scale", "query_index", "query_positions", "prompt_end"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))

    def tensors(self) -> list[torch.Tensor]:
        return self.query_tensors() + ([] if self.prompt_end is None else [self.prompt_end])

    def query_tensors(self) -> list[torch.Tensor]:
        """The kept queries with their sequence indices and positions."""
        ts = (self._held, self._scale, self.query_index, self.query_positions)
        return [t for t in ts if t is not None]
