"""The eval against a reference: exact teacher-forced decode equals one full forward; LYNX off
changes nothing; LYNX on is scored on the same positions."""
import math

import torch

from lynx_edge import Engine
from lynx_edge.eval import evaluate, load_sequences
from lynx_edge.step import prefill

TEXT = "".join(f"def f{i}(a, b):\n    return a * {i % 7} + b - {i * i}\n" for i in range(300))


def test_exact_pass_equals_full_forward(tiny_models):
    eng = Engine.from_pretrained(tiny_models["qwen3_moe"])
    seqs = load_sequences(eng, text=TEXT, num_seqs=4, seq_len=24)
    res = evaluate(eng, batch_sizes=(1, 4), lynx="off", seqs=seqs, prefill_len=8)
    nll = []
    for s in seqs:  # reference: one prefill over the whole window, scored on the decode part
        logits = prefill(eng.model, eng._cache(1), 0, s, 0, logits_for="all")[0]
        lp = torch.log_softmax(logits[7:-1], -1)
        nll.append(-lp.gather(1, torch.tensor(s[8:])[:, None]))
    ref_ppl = math.exp(torch.cat(nll).mean().item())
    for row in res["results"]:
        assert abs(row["ppl_exact"] - ref_ppl) / ref_ppl < 1e-4
        assert row["ppl_change_pct"] == 0 and row["agreement_pct"] == 100 and row["reduction_pct"] == 0
        assert row["tokens"] == 4 * 16


def test_lynx_on_reduces_union(tmp_path):
    from conftest import make_tiny

    path = make_tiny(tmp_path / "m", "olmoe", num_experts=32, num_experts_per_tok=4, intermediate_size=16)
    eng = Engine.from_pretrained(path)
    seqs = load_sequences(eng, text=TEXT, num_seqs=8, seq_len=20)
    res = evaluate(eng, batch_sizes=(1, 8), lynx="lynx,j=0", seqs=seqs, prefill_len=8)
    b1, b8 = res["results"]
    assert b1["reduction_pct"] == 0 and b1["agreement_pct"] == 100  # B=1: nothing to pool
    assert b8["unique_lynx"] < b8["unique_exact"]
    assert b8["ppl_exact"] == b1["ppl_exact"] or abs(b8["ppl_exact"] / b1["ppl_exact"] - 1) < 1e-4
    assert eng.lynx is None  # evaluate restores the engine's routing


def test_windows_longer_than_context_are_a_clear_error(tiny_models):
    import pytest

    eng = Engine.from_pretrained(tiny_models["qwen3_moe"], ctx_size=16)
    seqs = load_sequences(eng, text=TEXT, num_seqs=2, seq_len=24)
    with pytest.raises(ValueError, match="exceed the context of 16"):
        evaluate(eng, batch_sizes=(1,), lynx="on", seqs=seqs, prefill_len=8)
