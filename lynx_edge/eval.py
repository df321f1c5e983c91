"""LYNX vs exact routing on held-out text: perplexity, greedy agreement, unique experts per layer.

Teacher-forced, as decode really runs: each sequence's first `prefill_len` tokens are prefilled
(exact routing), the rest are fed one token per step with B sequences batched together, so LYNX
sees the same batch-wide votes it sees in serving. Both routings get identical inputs; the
scores are compared position by position.

    from lynx_edge.eval import evaluate
    evaluate(engine, batch_sizes=(1, 4, 16), lynx="lynx")
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .step import decode_step, prefill


@dataclass
class _Pass:
    nll: torch.Tensor  # [N] negative log-likelihood of every decode-phase target
    argmax: torch.Tensor  # [N] greedy prediction at every decode-phase position
    unique: float  # mean distinct experts per MoE layer per decode step


def load_sequences(engine, text: str | None = None, file: str | Path | None = None,
                   num_seqs: int = 32, seq_len: int = 128) -> list[list[int]]:
    """Cut held-out text into `num_seqs` non-overlapping windows of `seq_len` tokens."""
    if text is None:
        path = Path(file) if file else engine.model_dir / "heldout.txt"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no held-out text to evaluate on (pass --file)")
        text = path.read_text(encoding="utf-8", errors="replace")
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    n = min(num_seqs, len(ids) // seq_len)
    if n < 1:
        raise ValueError(f"held-out text has {len(ids)} tokens, fewer than one window of {seq_len}")
    # spread the windows over the whole text rather than taking its first part
    stride = len(ids) // n
    return [ids[i * stride : i * stride + seq_len] for i in range(n)]


def _teacher_forced(engine, seqs: list[list[int]], prefill_len: int) -> _Pass:
    """Run B sequences together: exact prefill, then batched decode steps on the true tokens."""
    model, B = engine.model, len(seqs)
    kv = engine._cache(B)
    engine._session = []  # rows are overwritten: the chat session cache is gone
    stats = model.routing.stats
    stats.clear()
    logits = torch.cat([prefill(model, kv, b, s[:prefill_len]) for b, s in enumerate(seqs)])  # [B, V]
    tokens = torch.tensor(seqs, device=model.device)  # [B, L]
    rows = list(range(B))
    nll, argmax = [], []
    for t in range(prefill_len, tokens.shape[1]):
        target = tokens[:, t]
        nll.append(-torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0])
        argmax.append(logits.argmax(-1))
        if t + 1 < tokens.shape[1]:
            logits = decode_step(model, kv, rows, target)
    return _Pass(torch.stack(nll, 1).flatten().cpu(), torch.stack(argmax, 1).flatten().cpu(),
                 stats.unique_per_layer(decode_only=True))


def run_windows(engine, seqs, B, prefill_len) -> _Pass:
    """Teacher-forced passes over the windows, B at a time (an exact prefill of prefill_len tokens,
    then batched decode steps on the true tokens) in the engine's current routing → the pooled
    per-token NLL, greedy argmax and mean unique experts per layer (a part of evaluate; the
    benchmarks compare dtypes with it)."""
    parts = [_teacher_forced(engine, seqs[i : i + B], prefill_len) for i in range(0, len(seqs) - B + 1, B)]
    return _Pass(torch.cat([p.nll for p in parts]), torch.cat([p.argmax for p in parts]),
                 sum(p.unique for p in parts) / len(parts))


def evaluate(engine, batch_sizes=(1, 4, 8, 16, 32), lynx="lynx", seqs: list[list[int]] | None = None,
             prefill_len: int = 64, **load_kw) -> dict:
    """→ {"results": [per batch size (and per mode): unique experts, perplexity, agreement]}.

    `lynx` is one mode or a list of modes; the exact pass is run once per batch size and shared.
    """
    seqs = seqs if seqs is not None else load_sequences(engine, **load_kw)
    if len(seqs[0]) > engine.ctx:
        raise ValueError(f"eval windows of {len(seqs[0])} tokens exceed the context of {engine.ctx} (raise ctx_size)")
    if prefill_len >= len(seqs[0]):
        raise ValueError(f"prefill_len {prefill_len} leaves no decode steps in {len(seqs[0])}-token windows")
    modes = [lynx] if not isinstance(lynx, (list, tuple)) else list(lynx)
    recording, mode_before = engine.model.routing.stats.record, engine.lynx
    engine.model.routing.stats.record = True
    rows = []
    try:
        for B in batch_sizes:
            if B > len(seqs):
                continue
            engine.set_lynx("off")
            exact = run_windows(engine, seqs, B, prefill_len)
            for mode in modes:
                engine.set_lynx(mode)
                rows.append({"mode": str(getattr(mode, "mode", mode)), **_compare(B, exact, run_windows(engine, seqs, B, prefill_len))})
    finally:
        engine.model.routing.stats.record = recording
        engine.set_lynx(mode_before.cfg if mode_before is not None else "off")
    return {"lynx": [str(getattr(m, "mode", m)) for m in modes] if len(modes) > 1 else str(getattr(modes[0], "mode", modes[0])),
            "sequences": len(seqs), "seq_len": len(seqs[0]), "prefill_len": prefill_len, "results": rows}


def _compare(B: int, exact: _Pass, approx: _Pass) -> dict:
    ppl_e, ppl_l = math.exp(exact.nll.mean().item()), math.exp(approx.nll.mean().item())
    return {
        "batch": B,
        "tokens": int(exact.nll.numel()),
        "unique_exact": exact.unique,
        "unique_lynx": approx.unique,
        "reduction_pct": 100.0 * (1 - approx.unique / exact.unique) if exact.unique else 0.0,
        "ppl_exact": ppl_e,
        "ppl_lynx": ppl_l,
        "ppl_change_pct": 100.0 * (ppl_l / ppl_e - 1),
        "agreement_pct": 100.0 * (exact.argmax == approx.argmax).float().mean().item(),
    }
