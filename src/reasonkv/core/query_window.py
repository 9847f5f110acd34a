"""One layer's recent queries: what scorers read, kept across decode steps.

Queries are post-RoPE `[B, Hq, W, D]`, oldest first, with their sequence indices (-1 for
padding) and RoPE positions `[B, W]`. The first forward is the prompt: it fixes `prompt_end`.
"""

from __future__ import annotations

import torch


class QueryWindow:
    def __init__(self) -> None:
        self.queries: torch.Tensor | None = None  # [B, Hq, W, D]
        self.query_index: torch.Tensor | None = None  # [B, W]
        self.query_positions: torch.Tensor | None = None  # [B, W]
        self.prompt_end: torch.Tensor | None = None  # [B] sequence index where generation starts

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
        if self.queries is None or query.shape[2] >= size:
            # Copies: a slice of a long prefill would keep all its queries alive.
            self.queries = query[:, :, -size:].detach().clone()
            self.query_index = index[:, -size:].clone()
            self.query_positions = positions[:, -size:].clone()
        else:
            # The oldest go before the join, so the new tensors hold exactly what is kept (a
            # slice of the joined ones would keep a query more alive).
            drop = max(self.queries.shape[2] + query.shape[2] - size, 0)
            self.queries = torch.cat([self.queries[:, :, drop:], query.detach()], dim=2)
            self.query_index = torch.cat([self.query_index[:, drop:], index], dim=1)
            self.query_positions = torch.cat([self.query_positions[:, drop:], positions], dim=1)

    def last(self, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The newest `n` kept queries with their indices and positions."""
        if self.queries is None or self.queries.shape[2] <= n:
            return self.queries, self.query_index, self.query_positions
        return self.queries[:, :, -n:], self.query_index[:, -n:], self.query_positions[:, -n:]

    def select_rows(self, rows: torch.Tensor) -> None:
        for name in ("queries", "query_index", "query_positions", "prompt_end"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))

    def tensors(self) -> list[torch.Tensor]:
        return self.query_tensors() + ([] if self.prompt_end is None else [self.prompt_end])

    def query_tensors(self) -> list[torch.Tensor]:
        """The kept queries with their sequence indices and positions."""
        return [t for t in (self.queries, self.query_index, self.query_positions) if t is not None]
