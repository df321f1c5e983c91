"""The hot path: prefill() one sequence into its cache row, prefill_rows() chunks of several rows in
one forward, decode_step() for a batch of rows.

Both build an AttnBatch (where each token sits in the cache) and call the model once; the
caller does the single host sync per token (reading the chosen ids back).
"""
from __future__ import annotations

import functools

import torch

from .kv_cache import KVCache
from .models import native_layer
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


def prefill_rows(model, kv: KVCache, rows: list[int], chunks: list[list[int]], starts: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt chunks of B rows (chunk b at positions starts[b].. of cache row rows[b]) in one exact
    forward. → (logits [B, V] of each row's last chunk token, keep [N_real] flat indices of the real
    tokens in the forward's B·T tokens, or None when there is no padding).

    Rows of equal chunk length and start run as one plain block (no mask). Otherwise each row is
    padded to the longest chunk at its FRONT, and every pad token is given a position past its
    row's chunk (clamped to ctx - 1; prompts are < ctx, so no real token sits there): its K/V lands
    where the row's decode later overwrites it, the position mask hides it from every real token
    (they sit at lower positions), and x[:, -1] is each row's last real token, the only logits
    read. Pads still pass through the MoE with exact routing (their own tokens only, so no real
    token's routing changes); the caller drops them from the routing stats with `keep`."""
    dev, ctx = model.device, kv.ctx
    B, lens = len(rows), [len(c) for c in chunks]
    T = max(lens)
    if max(s + n for s, n in zip(starts, lens)) > ctx:
        raise ValueError(f"a chunk exceeds the context of {ctx}")
    if min(lens) == T and min(starts) == max(starts):
        s0 = starts[0]
        positions = torch.arange(s0, s0 + T, device=dev)[None].expand(B, T)  # [B, T]
        ab = AttnBatch(positions=positions, rows=_rows(rows, dev), kv_len=s0 + T, start=s0)
        input_ids, keep = torch.tensor(chunks, device=dev), None
    else:
        ids, pos, keep_l = [], [], []
        for b, (c, s, n) in enumerate(zip(chunks, starts, lens)):
            pad = T - n
            ids.append([c[-1]] * pad + c)
            pos.append([min(s + n + j, ctx - 1) for j in range(pad)] + list(range(s, s + n)))
            keep_l += range(b * T + pad, (b + 1) * T)
        positions = torch.tensor(pos, device=dev)  # [B, T]
        kv_len = max(max(p) for p in pos) + 1
        ends = torch.tensor([s + n for s, n in zip(starts, lens)], device=dev)  # a window layer's ring skips pads
        ab = AttnBatch(positions=positions, rows=_rows(rows, dev), kv_len=kv_len, ends=ends)
        input_ids, keep = torch.tensor(ids, device=dev), torch.tensor(keep_l, device=dev)
    model.routing.begin_step(False)
    logits = model(input_ids, ab, kv.layers, torch.zeros(B * T, dtype=torch.bool, device=dev))  # [B, V]
    for r, s, n in zip(rows, starts, lens):
        kv.lengths[r] = s + n
    return logits, keep


@functools.lru_cache(maxsize=64)
def _decode_flags(B: int, device) -> torch.Tensor:
    """bool [B] all True: every token of a decode step is a decode token (made once per size; read only)."""
    return torch.ones(B, dtype=torch.bool, device=device)


def _decode_batch(model, kv: KVCache, rows: list[int]) -> AttnBatch:
    """Where one new token of each of the B rows sits: the AttnBatch of a decode step."""
    dev = model.device
    lengths = [kv.lengths[r] for r in rows]
    hi = max(lengths)
    if hi >= kv.ctx:
        raise ValueError(f"context of {kv.ctx} tokens is full")
    positions = torch.tensor(lengths)
    if getattr(dev, "type", dev) != "cpu":
        positions = positions.to(dev, non_blocking=True)  # no stream sync
    same = min(lengths) == hi  # equal lengths (e.g. a batch of equal prompts): no mask
    return AttnBatch(positions=positions.view(-1, 1), rows=_rows(rows, dev), kv_len=hi + 1,
                     start=lengths[0] if same else None)


def _forward(model, tokens: torch.Tensor, ab: AttnBatch, kv: KVCache, B: int) -> torch.Tensor:
    # model.run: forward without the module call and the inference-mode entry (its docstring); a
    # forward set on the instance (a wrapper's or a test's) still runs
    fwd = model.__dict__.get("forward") or model.run
    return fwd(tokens.view(-1, 1), ab, kv.layers, _decode_flags(B, model.device))


def decode_step(model, kv: KVCache, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """One token for each of the B rows. tokens [B] → logits [B, V]."""
    ab = _decode_batch(model, kv, rows)
    model.routing.begin_step(True)
    logits = _forward(model, tokens, ab, kv, len(rows))
    for r in rows:
        kv.lengths[r] += 1
    return logits


def decode_greedy(model, kv: KVCache, rows: list[int], tokens: list[int], steps: int, stops=()) -> list[list[int]]:
    """Up to `steps` greedy decode steps of the B rows, each step's argmax the next step's input:
    what decode_step and an argmax would give step by step. Where the whole model runs in one native
    call on a CPU, all the steps run in one call (native_layer.greedy_burst: no Python between steps);
    otherwise one decode_step. Ends after a step where a row chose one of `stops` (ids).
    → the chosen tokens, one list of B per step run (≥ 1; the caller keeps steps within the context)."""
    ab = _decode_batch(model, kv, rows)
    model.routing.begin_step(True)
    got = native_layer.greedy_burst(model, kv, ab, tokens, steps, stops) if steps > 1 else None
    if got is None:
        got = [_forward(model, torch.tensor(tokens, device=model.device), ab, kv, len(rows)).argmax(-1).tolist()]
    for r in rows:
        kv.lengths[r] += len(got)
    return got
