"""The hot path: prefill() one sequence into its cache row, decode_step() for a batch of rows.

Both build an AttnBatch (where each token sits in the cache) and call the model once; the
caller does the single host sync per token (reading the chosen ids back).
"""
from __future__ import annotations

import torch

from .kv_cache import KVCache
from .models.layers import AttnBatch


def _rows(rows: list[int], device) -> torch.Tensor | slice:
    # Contiguous rows are sliced (a view); others gathered.
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows).to(device, non_blocking=True)  # a blocking H2D copy would sync the stream


def prefill(model, kv: KVCache, row: int, ids: list[int], start: int = 0, logits_for: str = "last") -> torch.Tensor:
    """Run prompt tokens ids (positions start.. of row) exactly. → logits [1, V] or [1, T, V]."""
    dev = model.device
    T = len(ids)
    if start + T > kv.ctx:
        raise ValueError(f"sequence of {start + T} tokens exceeds the context of {kv.ctx}")
    input_ids = torch.tensor([ids], device=dev)
    positions = torch.arange(start, start + T, device=dev)[None]
    ab = AttnBatch(positions=positions, rows=slice(row, row + 1), kv_len=start + T, start=start)
    model.routing.begin_step(False)
    logits = model(input_ids, ab, kv.layers, torch.zeros(T, dtype=torch.bool, device=dev), logits_for)
    kv.lengths[row] = start + T
    return logits


def decode_step(model, kv: KVCache, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """One token for each of the B rows. tokens [B] → logits [B, V]."""
    dev = model.device
    lengths = [kv.lengths[r] for r in rows]
    if max(lengths) >= kv.ctx:
        raise ValueError(f"context of {kv.ctx} tokens is full")
    positions = torch.tensor(lengths).to(dev, non_blocking=True)[:, None]  # [B, 1]; no stream sync
    same = min(lengths) == max(lengths)  # equal lengths (e.g. a batch of equal prompts): no mask
    ab = AttnBatch(positions=positions, rows=_rows(rows, dev), kv_len=max(lengths) + 1,
                   start=lengths[0] if same else None)
    model.routing.begin_step(True)
    logits = model(tokens.view(-1, 1), ab, kv.layers, torch.ones(len(rows), dtype=torch.bool, device=dev))
    for r in rows:
        kv.lengths[r] += 1
    return logits
