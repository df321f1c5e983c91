"""The per-layer cache with sequence state (kv_cache.py, models/state.py): states are counted once
per row (not per token) in the cache and the memory plan, zeroed on reset, read as zeros by a row
that starts a new sequence, and a short causal conv continued chunk by chunk equals the plain
zero-padded conv (reference: F.conv1d with padding K-1). Which positions sit in which row comes
from AttnBatch, as the hot path builds it (rows at different positions in one forward)."""
import math

import pytest
import torch
import torch.nn.functional as F

from lynx_edge.config import ModelConfig
from lynx_edge.kv_cache import KVCache
from lynx_edge.models.layers import AttnBatch
from lynx_edge.models.state import State, causal_conv, read_state

TINY = {"model_type": "qwen3_next", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 6,
        "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 8}


def test_state_bytes_are_per_row_not_per_token():
    cfg = ModelConfig.from_dict(TINY)  # layers 0-2 linear attention, layer 3 full attention
    C = 2 * 2 * 8 + 4 * 6  # q, k, v conv channels
    state_row = 3 * (C * 3 * 2 + 4 * 8 * 6 * 4)  # conv state bf16 (K-1 inputs), recurrent state fp32
    kv_tok = 1 * 2 * 2 * 8 * 2  # one attention layer: K and V, Hkv × hd, bf16
    for B, ctx in ((1, 16), (3, 100), (8, 4096)):
        assert KVCache.bytes_needed(cfg, B, ctx, torch.bfloat16) == B * (state_row + ctx * kv_tok)
    assert KVCache.state_bytes(cfg, torch.bfloat16) == state_row
    kv = KVCache(cfg, 2, 16, torch.bfloat16, torch.device("cpu"))
    held = sum(t.numel() * t.element_size() for layer in kv.layers for t in layer)
    assert held == KVCache.bytes_needed(cfg, 2, 16, torch.bfloat16) and kv.stateful
    assert kv.layers[0][1].dtype == torch.float32 and kv.layers[0][0].dtype == torch.bfloat16


def test_memory_plan_counts_the_state_once():
    from lynx_edge.offload import OffloadOptions
    from lynx_edge.offload.memory import plan_memory

    cfg = ModelConfig.from_dict(TINY)
    kv = {}
    for ctx in (64, 128):
        plan = plan_memory(cfg, device="cpu", dtype=torch.bfloat16, offload=False, int4=False, quant=None, ctx=ctx,
                           batch=2, opts=OffloadOptions(device="cpu", ctx=ctx, batch=2), file_bytes=None)
        kv[ctx] = next(v for r in plan.resources for k, v in r.parts.items() if k.startswith("KV cache"))
    assert kv[64] == KVCache.bytes_needed(cfg, 2, 64, torch.bfloat16)
    assert kv[128] - kv[64] == 2 * 64 * (2 * 2 * 8 * 2)  # only attention grows with the context


def test_reset_zeroes_state_rows_only():
    cfg = ModelConfig.from_dict(TINY)
    kv = KVCache(cfg, 3, 8, torch.float32, torch.device("cpu"))
    for layer in kv.layers:
        for t in layer:
            t.fill_(1.0)
    kv.reset(range(1, 2))
    conv, rec = kv.layers[0]
    assert conv[1].abs().sum() == 0 and rec[1].abs().sum() == 0
    assert conv[0].min() == 1 and rec[2].min() == 1
    assert kv.layers[3][0].min() == 1  # K/V past a row's length is never read: left as is


def test_state_marker_keeps_its_dtype_through_copies():
    import copy
    import pickle

    s = State((3, 4), torch.float32)
    for t in (copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        assert t == (3, 4) and t.dtype == torch.float32 and isinstance(t, State)
    assert math.prod(s) == 12 and torch.zeros((2, *s)).shape == (2, 3, 4)


def _ab(rows, positions):
    pos = torch.tensor(positions)
    same = all(p[0] == positions[0][0] for p in positions)
    return AttnBatch(positions=pos, rows=torch.tensor(rows), kv_len=int(pos.max()) + 1,
                     start=positions[0][0] if same else None)


def test_fresh_rows_read_zero_state():
    cache = torch.ones(4, 2, 3)
    s = read_state(cache, _ab([2, 0], [[0], [5]]))  # row 2 starts a sequence, row 0 continues at 5
    assert s[0].abs().sum() == 0 and s[1].min() == 1
    s = read_state(cache, AttnBatch(positions=torch.tensor([[0, 1]]), rows=slice(1, 2), kv_len=2, start=0))
    assert s.abs().sum() == 0


@pytest.mark.parametrize("K", [1, 2, 4])
def test_causal_conv_chunked_with_mixed_rows_equals_plain_conv(K):
    """Two sequences through one conv cache: prefill chunks of uneven size, then decode steps with
    both rows in one batch at different positions, a stale state in a reused row."""
    torch.manual_seed(0)
    C, L = 5, 13
    w = torch.randn(C, 1, K)
    xs = [torch.randn(1, C, L), torch.randn(1, C, L)]
    want = [F.conv1d(x, w, padding=K - 1, groups=C)[..., :L] for x in xs]
    cache = torch.randn(3, C, K - 1)  # garbage: rows 1 and 2 were used by earlier sequences
    got = [[], []]
    rows, starts = [2, 1], [0, 0]
    for b, cut in ((0, [3, 4]), (1, [6])):  # row 2: chunks of 3 and 4; row 1: one of 6
        for n in cut:
            s = starts[b]
            ab = AttnBatch(positions=torch.arange(s, s + n)[None], rows=slice(rows[b], rows[b] + 1),
                           kv_len=s + n, start=s)
            got[b].append(causal_conv(xs[b][..., s:s + n], w, cache, ab))
            starts[b] += n
    while min(starts) < L:  # decode: both rows in one forward, at their own positions
        live = [b for b in (0, 1) if starts[b] < L]
        ab = _ab([rows[b] for b in live], [[starts[b]] for b in live])
        out = causal_conv(torch.cat([xs[b][..., starts[b]:starts[b] + 1] for b in live]), w, cache, ab)
        for j, b in enumerate(live):
            got[b].append(out[j:j + 1])
            starts[b] += 1
    for b in (0, 1):
        torch.testing.assert_close(torch.cat(got[b], -1), want[b], rtol=1e-5, atol=1e-5)


def test_causal_conv_bf16_sums_in_fp32_and_rounds_once():
    """A bf16 conv on a CPU: each output is the fp64 sum of the bf16 inputs' products (with the
    bias), rounded once to bf16 — equal to that but for double-rounding ties (none here), and
    within one bf16 step of torch's own bf16 conv1d; the state keeps the inputs as given."""
    g = torch.Generator().manual_seed(1)
    C, K, T = 64, 4, 9
    w, bias = torch.randn(C, 1, K, generator=g).bfloat16(), torch.randn(C, generator=g).bfloat16()
    x = torch.randn(2, C, T, generator=g).bfloat16()
    cache = torch.zeros(2, C, K - 1, dtype=torch.bfloat16)
    ab = AttnBatch(positions=torch.arange(T)[None].expand(2, T), rows=slice(0, 2), kv_len=T, start=0)
    got = causal_conv(x, w, cache, ab, bias)
    full = F.pad(x.double(), (K - 1, 0))
    want = sum(full[..., k:k + T] * w[:, 0, k].double()[:, None] for k in range(K)) + bias.double()[:, None]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
    torch_bf16 = F.conv1d(F.pad(x, (K - 1, 0)), w, bias, groups=C)
    assert ((got.float() - torch_bf16.float()).abs() <= got.float().abs() * 2 ** -7).all()
    assert torch.equal(cache, x[..., T - (K - 1):])


def test_memory_plan_names_the_sequence_state():
    """The plan's cache line says how much of it is per-row state (Qwen3-Next: 73.7 MiB per
    sequence on the published config) and keeps the plain name for attention-only models."""
    from pathlib import Path

    from lynx_edge.offload.memory import plan_memory

    fx = Path(__file__).parent / "fixtures"
    nxt = ModelConfig.from_file(fx / "qwen3-next-80b-a3b" / "config.json")
    plan = plan_memory(nxt, device="cpu", dtype=torch.bfloat16, offload=False, int4=True, ctx=4096, batch=2)
    state = 2 * KVCache.state_bytes(nxt, torch.bfloat16)
    assert state == 2 * 77_266_944
    assert "KV cache + sequence state (B=2, ctx=4096; state 147.4 MiB)" in plan.to_text()
    mix = ModelConfig.from_file(fx / "real" / "mixtral-8x7b-instruct-v0.1" / "config.json")
    text = plan_memory(mix, device="cpu", dtype=torch.bfloat16, offload=False, int4=True, ctx=4096).to_text()
    assert "KV cache (B=1, ctx=4096)" in text and "sequence state" not in text
