"""The native CPU kernels (lynx_edge/kernels/cpu_native.c): dense fp32/bf16 MoE layers and
projections against fp32 torch references, thread-count invariance, and the build's fallbacks.

Bounds: products and sums are fp32 with reassociated lanes, so results are not bit-equal to
torch's; observed max |Δ| / output scale 6.3e-7 (MoE, up to D=1024, I=768) and 3.4e-7 (linear, Kin ≤ 4096) over these
cases, bounds ~3× that. bf16 weights widen exactly, so bf16 cases compare against fp32 math on
the same bf16 values; a bf16 output adds one bf16 rounding (2^-8 relative). The INT4 kernel is
tested in tests/test_cpu_lowbit.py (both native and numba).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import q8_emulate as _q8
from conftest import q16_emulate as _q16
from lynx_edge.cpuflags import cpu_flags
from lynx_edge.kernels import native
from lynx_edge.kernels.moe_gemm import moe_ref_loop

pytestmark = [pytest.mark.skipif(native.lib() is None, reason="native kernels not built (no C compiler)"),
              pytest.mark.usefixtures("exact_int4")]  # fp32 references: the exact rows (conftest)

TOL_MOE, TOL_LIN = 2e-6, 1.2e-6


def _rel(y, ref):
    return (y.float() - ref.float()).abs().max().item() / max(1.0, ref.abs().max().item())


def _moe_problem(T, K, E, D, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    gu = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dtype)
    dn = (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).reshape(T, K)
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, ids, w, gu, dn


# T=1 (one-token pass), 9 and 23 slots per expert (8-token blocks and every remainder), D not a
# multiple of 16 (the scalar tail), one token's slots on the same expert
@pytest.mark.parametrize("T,K,E,D,I", [(1, 2, 8, 64, 32), (9, 1, 1, 128, 64), (23, 3, 4, 72, 40),
                                       (6, 4, 16, 256, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_dense_matches_reference(T, K, E, D, I, dtype):
    x, ids, w, gu, dn = _moe_problem(T, K, E, D, I, dtype)
    ref = moe_ref_loop(x, ids, w, gu.float(), dn.float())  # fp32 math on the same weight values
    y = native.moe_dense(x, ids, w, gu, dn)
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert _rel(y, ref) < TOL_MOE, _rel(y, ref)


def test_moe_dense_bugs_are_caught():
    x, ids, w, gu, dn = _moe_problem(5, 2, 4, 64, 32, torch.float32)
    ref = moe_ref_loop(x, ids, w, gu, dn)
    bad = gu.clone()
    bad[int(ids[0, 0]), 3, 5] += 0.5  # one weight of an active expert
    assert _rel(native.moe_dense(x, ids, w, bad, dn), ref) > 100 * TOL_MOE
    assert _rel(native.moe_dense(x, ids, w.flip(1), gu, dn), ref) > 100 * TOL_MOE
    assert _rel(native.moe_dense(x, ids.flip(1), w, gu, dn), ref) > 100 * TOL_MOE


@pytest.mark.parametrize("T,gated", [(1, True), (5, True), (3, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_expert_matches_reference(T, gated, dtype):
    """lynx_shared_expert against fp64: sigmoid(sg·x) · down(silu(gate x) · up x) (Qwen2-MoE), or
    without the scale (DeepSeek); a wrong scale, a missing silu and swapped gate/up must show."""
    g = torch.Generator().manual_seed(T)
    D, I = 96, 160
    x = torch.randn(T, D, generator=g)
    ws = [(torch.randn(n, k, generator=g) / k**0.5).to(dtype) for n, k in ((I, D), (I, D), (D, I), (1, D))]
    lin = [native.dense_lin(w, None) for w in ws]

    def ref(gw, uw, dw, sw, act=F.silu):
        xd = x.double()
        y = (act(xd @ gw.double().T) * (xd @ uw.double().T)) @ dw.double().T
        return y * torch.sigmoid(xd @ sw.double().T) if gated else y

    def run(lins):
        return native.shared_expert(native.SharedExpert(*lins[:3], lins[3] if gated else native.Lin()), x)

    want = ref(*ws)
    got = run(lin)
    assert got.shape == (T, D) and got.dtype == torch.float32
    assert _rel(got, want) < TOL_LIN, _rel(got, want)  # seen ~2e-7
    if gated:  # the scale's sign
        flipped = -ws[3]  # kept alive: the Lin points into it
        assert _rel(run(lin[:3] + [native.dense_lin(flipped, None)]), want) > 100 * TOL_LIN
    assert _rel(run([lin[1], lin[0], *lin[2:]]), want) > 100 * TOL_LIN  # gate and up swapped
    assert _rel(got, ref(*ws, act=lambda z: z)) > 100 * TOL_LIN  # silu left out


@pytest.mark.parametrize("T,Kin,N,bias", [(1, 64, 48, False), (3, 200, 17, True), (8, 1024, 64, False), (1, 1000, 24, True),
                                          (19, 128, 33, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_reference(T, Kin, N, bias, dtype):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, Kin, generator=g)  # leading dims are kept
    W = (torch.randn(N, Kin, generator=g) / Kin**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    ref = F.linear(x, W.float(), None if b is None else b.float())
    y = native.linear(x, W, b)
    assert y.shape == ref.shape and _rel(y, ref) < TOL_LIN, _rel(y, ref)
    assert _rel(native.linear(x[0, :1], W, b), ref[0, :1]) < TOL_LIN  # one token: its own tile shape
    yb = native.linear(x.to(dtype), W, b)  # bf16 activations: fp32 math on them, one rounding out
    refb = F.linear(x.to(dtype).float(), W.float(), None if b is None else b.float())
    assert yb.dtype == dtype and _rel(yb, refb) <= (TOL_LIN if dtype == torch.float32 else 2**-8)
    W2 = W.clone()
    W2[N // 2, Kin // 3] += 1.0
    assert _rel(native.linear(x, W2, b), ref) > 100 * TOL_LIN


def test_thread_count_does_not_change_results():
    """Work items are computed identically on any thread: 1 and 2 threads agree bit for bit."""
    x, ids, w, gu, dn = _moe_problem(16, 4, 16, 128, 64, torch.bfloat16)
    W = torch.randn(96, 128)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append((native.moe_dense(x, ids, w, gu, dn), native.linear(x[:5], W)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_expected_answers_without_building(monkeypatch):
    """native.expected() (the CPU default dtype asks it: `lynx-edge info` must not wait for the first
    build) says whether the kernels will run without compiling them; once lib() has run, its answer."""
    import functools
    import platform

    calls = []

    @functools.lru_cache(maxsize=None)
    def fresh_lib():
        calls.append(1)
        return None  # as if the build failed

    monkeypatch.setattr(native, "lib", fresh_lib)
    monkeypatch.setattr(native, "_compiler", lambda: "cc")
    monkeypatch.delenv("LYNX_EDGE_NATIVE", raising=False)
    assert native.expected() == (platform.system() != "Windows") and not calls  # answered, nothing built
    monkeypatch.setenv("LYNX_EDGE_NATIVE", "0")
    assert not native.expected()
    monkeypatch.delenv("LYNX_EDGE_NATIVE")
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert not native.expected() and not calls
    monkeypatch.setattr(native, "_compiler", lambda: "cc")
    fresh_lib()  # it ran (and failed): its answer from now on
    assert not native.expected()


def test_model_paths_use_the_kernels(monkeypatch):
    """Decode-sized CPU calls take the native kernels; prefill-sized ones torch's."""
    from lynx_edge.models import layers

    calls = []
    monkeypatch.setattr(native, "moe_dense", lambda *a, act=None: calls.append("moe") or moe_ref_loop(*a[:5]))
    monkeypatch.setattr(native, "linear", lambda x, w, b=None, act=None: calls.append("linear") or F.linear(x, w, b))
    x, ids, w, gu, dn = _moe_problem(4, 2, 4, 64, 32, torch.bfloat16)
    layers.cpu_moe(x.bfloat16(), ids, w, gu, dn)
    layers.linear(x[:1].bfloat16(), gu[0])
    layers.linear(x[:1], gu[0].float())  # fp32 at one row: native too (one kernel for every decode batch)
    layers.linear(torch.randn(200, 64).bfloat16(), gu[0])  # prefill-sized: torch (fp32 GEMM, widened)
    layers.linear(torch.randn(64, 64), gu[0].float())  # fp32 past 32 rows: torch's GEMM
    assert calls == ["moe", "linear", "linear"]


def test_disabled_or_no_compiler_falls_back(tmp_path):
    """LYNX_EDGE_NATIVE=0 → no library (the torch / numba paths run); a compiler that fails →
    None with a warning, nothing cached."""
    code = "from lynx_edge.kernels import native; print(native.lib() is None)"
    r = subprocess.run([sys.executable, "-c", code], env={"LYNX_EDGE_NATIVE": "0", "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "True"
    code = ("import os; from lynx_edge.kernels import native; p = native.build('false'); "
            "print(p is None, os.listdir(native.cache_dir()))")
    r = subprocess.run([sys.executable, "-c", code], env={"XDG_CACHE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "True []", r.stdout + r.stderr


def test_unwritable_cache_falls_back(tmp_path, monkeypatch):
    """A cache directory that cannot be created: no library, no exception (torch / numba run)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where the directory should go
    assert native.build() is None


def test_cache_key_follows_the_source(tmp_path, monkeypatch):
    """A changed source (or CPU) builds a new library instead of loading a stale one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # unoptimised builds: the key, not the code, is under test (two -O3 builds took ~55 s on 2 cores)
    monkeypatch.setattr(native, "FLAGS", ["-O0" if f == "-O3" else f for f in native.FLAGS])
    a = native.build()
    src = tmp_path / "k.c"
    src.write_text(native.SRC.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "SRC", src)
    b = native.build()
    assert a is not None and b is not None and a != b and a.exists() and b.exists()


def test_bf16_prefill_widens_in_chunks(monkeypatch):
    """Past the native rows, a bf16 projection runs torch's fp32 GEMM on row chunks of the widened
    weight: equal to fp32 math on the bf16 values, one bf16 rounding out."""
    from lynx_edge.models import layers

    monkeypatch.setattr(layers, "WIDEN_BYTES", 16 * 64 * 4)  # 40 rows of W: chunks 16, 16, 8
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 200, 64, generator=g).bfloat16()
    W, b = torch.randn(40, 64, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16()
    y = layers.linear(x, W, b)
    ref = F.linear(x.float(), W.float(), b.float())
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape and _rel(y, ref) <= 2**-8
    assert torch.equal(y, ref.bfloat16())


def _attn(model_type, dtype, window=None, **extra):
    from lynx_edge.config import ModelConfig
    from lynx_edge.models.layers import Attention, Rope

    c = dict(model_type=model_type, vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=32, moe_intermediate_size=32, num_experts=4,
             num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0, max_position_embeddings=64,
             sliding_window=window, use_sliding_window=window is not None)
    c.update(extra)
    cfg = ModelConfig.from_dict(c)
    torch.manual_seed(0)
    att = Attention(cfg, 0, dtype, "cpu")
    for p in att.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return att, Rope(cfg, "cpu")


def _decode_native_and_torch(att, rope, caches, x, rows, pos, kv_len):
    """One decode step of `att` through the native kernel, then through its torch path, each on its
    own copy of the caches → ((out, caches) native, (out, caches) torch)."""
    from lynx_edge.models.layers import AttnBatch

    outs = {}
    for native_on in (True, False):
        att._native_decode = None if native_on else False
        kv = tuple(c.clone() for c in caches)
        ab = AttnBatch(positions=pos, rows=rows, kv_len=kv_len)
        ab.cos, ab.sin = rope.cos_sin(pos, x.dtype)
        outs[native_on] = (att(x, ab, kv), kv)
        assert att._native_decode is native_on  # the first pass chose the native kernel
    return outs[True], outs[False]


# qk-norm (Qwen3) and none (Mixtral); a sliding window; partial rotary; bf16 weights and cache
@pytest.mark.parametrize("model_type,dtype,window,extra", [
    ("qwen3_moe", torch.float32, None, {}), ("mixtral", torch.float32, 5, {}),
    ("qwen3_moe", torch.bfloat16, 6, {}), ("mixtral", torch.float32, None, {"partial_rotary_factor": 0.5}),
])
def test_attention_decode_matches_torch_path(model_type, dtype, window, extra):
    """The native decode step (norm, RoPE, cache write, attention) against the module's own torch
    path on the same inputs: rows at different positions, a non-contiguous set of cache rows."""
    from lynx_edge.models.layers import AttnBatch

    att, rope = _attn(model_type, dtype, window, **extra)
    g = torch.Generator().manual_seed(1)
    caches = tuple((torch.randn(5, 2, 12, 16, generator=g)).to(dtype) for _ in range(2))  # [Bmax, Hkv, S, hd]
    x = torch.randn(3, 1, 64, generator=g).to(dtype)
    rows, pos = torch.tensor([3, 0, 4]), torch.tensor([[9], [2], [11]])
    (y, kv), (ref, kv_ref) = _decode_native_and_torch(att, rope, caches, x, rows, pos, 12)
    assert y.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1.5e-2  # observed 2.1e-7, 4.3e-3 (bf16: torch rounds every op)
    assert _rel(y, ref) < tol, _rel(y, ref)
    for c, r in zip(kv, kv_ref):
        assert _rel(c, r) < tol and torch.equal(c[1], r[1]) and torch.equal(c[2], r[2])  # other rows untouched
    bad = caches[0].clone()
    bad[3, 0, 8] += 5.0  # one cached key the first row attends to (inside every window here)
    ab = AttnBatch(positions=pos, rows=rows, kv_len=12)
    ab.cos, ab.sin = rope.cos_sin(pos, dtype)
    att._native_decode = None
    assert _rel(att(x, ab, (bad, caches[1].clone())), ref) > 10 * tol


# published models' attention shapes: Qwen3-30B-A3B (32 q heads of 128 on 4 kv heads, qk-norm),
# Mixtral-8x7B (32 on 8, no qk-norm), OLMoE-like (16 of 64 on 16: no grouping); a few hundred cached
# positions, so the four-position passes, their tails and the softmax's vector tails all run
@pytest.mark.parametrize("model_type,hq,hkv,hd,dtype", [
    ("qwen3_moe", 32, 4, 128, torch.float32), ("mixtral", 32, 8, 128, torch.float32),
    ("qwen3_moe", 16, 16, 64, torch.float32), ("qwen3_moe", 32, 4, 128, torch.bfloat16),
    # the value pass's odd tiles: 3 heads per group over 96 dims, 5 heads over 80 (bf16 cache); 40
    # dims, not a multiple of 16: the generic loop on AVX-512, 8-wide tiles on AVX2
    ("qwen3_moe", 6, 2, 96, torch.float32), ("qwen3_moe", 10, 2, 80, torch.bfloat16),
    ("qwen3_moe", 8, 2, 40, torch.float32),
])
def test_attention_decode_at_published_head_shapes(model_type, hq, hkv, hd, dtype):
    att, rope = _attn(model_type, dtype, hidden_size=256, num_attention_heads=hq, num_key_value_heads=hkv,
                      head_dim=hd, max_position_embeddings=512)
    g = torch.Generator().manual_seed(2)
    S = 320
    caches = tuple((torch.randn(4, hkv, S, hd, generator=g)).to(dtype) for _ in range(2))  # [Bmax, Hkv, S, hd]
    x = torch.randn(3, 1, 256, generator=g).to(dtype)
    rows, pos = torch.tensor([2, 0, 3]), torch.tensor([[299], [37], [150]])
    (y, kv), (ref, kv_ref) = _decode_native_and_torch(att, rope, caches, x, rows, pos, 300)
    tol = 1e-6 if dtype == torch.float32 else 1.5e-2  # observed 2.0-4.0e-7; bf16 5.8e-3 (torch rounds every op)
    assert _rel(y, ref) < tol, _rel(y, ref)  # a softmax summed over only 64 positions fails it (the 12-position test passes)
    for c, r in zip(kv, kv_ref):
        assert _rel(c, r) < tol and torch.equal(c[1], r[1])  # the row not in the batch untouched


def _exp_and_silu(x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' vector exp and SwiGLU (silu(x) * u) over x, u fp32 [n]."""
    e, h = torch.empty_like(x), x.clone()
    native.lib().lynx_exp(x.data_ptr(), x.numel(), e.data_ptr())
    native.lib().lynx_silu_mul(h.data_ptr(), u.data_ptr(), x.numel())
    return e, h


def test_vector_exp_and_silu_within_two_ulp_and_position_free():
    """The exp behind the experts' SwiGLU and the attention softmax (Cephes' polynomial, 16 lanes):
    within 2 ulp of e^x in fp64 over the range it serves, NaN kept; SwiGLU within 4 ulp; and an
    element's value never depends on its place in the call (masked tails: batch invariance)."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.linspace(-87.0, 88.0, 20001), torch.randn(4003, generator=g) * 6,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    u = torch.randn(x.numel(), generator=g)
    e, h = _exp_and_silu(x, u)
    ref = torch.exp(x.double())
    ulp = (torch.nextafter(ref.float(), torch.tensor(float("inf"))) - ref.float()).double()
    assert ((e.double() - ref).abs() / ulp).max() <= 2.0  # observed 1.01 (AVX-512 / AVX2), 0.97 (portable)
    sref = x.double() * torch.sigmoid(x.double()) * u.double()
    sulp = (torch.nextafter(sref.float().abs(), torch.tensor(float("inf"))) - sref.float().abs()).double()
    assert ((h.double() - sref).abs() / sulp.clamp_min(1e-45)).max() <= 4.0
    assert torch.isnan(_exp_and_silu(torch.tensor([float("nan")]), torch.ones(1))[0]).all()
    for start, n in [(0, 1), (5, 11), (7, 16), (3, 37), (1000, 333)]:  # sub-slices: other lane positions, tails
        e2, h2 = _exp_and_silu(x[start:start + n].clone(), u[start:start + n].clone())
        assert torch.equal(e2, e[start:start + n]) and torch.equal(h2, h[start:start + n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_torch_path(dtype):
    """Native RMSNorm vs the module's torch ops: fp32 within a few ulps (sum order); bf16 the same
    two roundings (normalised row, then the weight product), so at most one bf16 ulp apart."""
    from lynx_edge.models.layers import RMSNorm

    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(200, 1e-6, dtype, "cpu")
    norm.weight.data.copy_(torch.randn(200, generator=g) * 0.5 + 1)
    x = (torch.randn(3, 7, 200, generator=g) * 3).to(dtype)
    h = x.float()
    ref = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    y = norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    if dtype == torch.float32:
        assert _rel(y, ref) < 1e-6, _rel(y, ref)
    else:
        ulp = (ref.float().abs() * 2**-7).clamp_min(1e-30)
        assert ((y.float() - ref.float()).abs() <= ulp).all() and (y == ref).float().mean() > 0.99
    w2 = norm.weight.data.clone()
    norm.weight.data[17] += 0.25
    assert _rel(norm(x), ref) > 1e-2
    norm.weight.data.copy_(w2)


def test_offload_store_dense_expert_reads_block_in_place():
    """A Fiddler-style CPU expert from a bf16 host block: the native kernel on the block's bytes
    equals fp32 math on the same bf16 weights (no widened copy)."""
    from lynx_edge.kernels.moe_gemm import expert_mlp
    from lynx_edge.offload.store import DenseFormat

    g = torch.Generator().manual_seed(6)
    fmt = DenseFormat("bf16", 64, 32)
    buf = torch.zeros(2, fmt.nbytes, dtype=torch.uint8)
    fmt.pack_into(buf, torch.randn(2, 64, 64, generator=g) * 0.1, torch.randn(2, 64, 32, generator=g) * 0.1)
    x = torch.randn(3, 64, generator=g)
    gu, dn = fmt.weights(buf[1], torch.float32)
    assert _rel(fmt.compute(buf[1], x), expert_mlp(x, gu, dn)) < TOL_MOE


@pytest.mark.parametrize("T,K,E,D,I", [(1, 2, 4, 64, 32), (7, 4, 8, 96, 64), (20, 2, 3, 64, 96)])
@pytest.mark.parametrize("kind", ["mxfp4", "float32", "bfloat16"])
def test_gpt_oss_experts_match_reference(T, K, E, D, I, kind):
    """gpt-oss's layer (biases, the clamped SwiGLU) on MXFP4 codes or 16-bit weights against
    oss_moe_ref on the same values in fp32; bug cases (a flipped code, a scale one off, a clamp
    dropped) land far outside the bound."""
    from lynx_edge.kernels.moe_mxfp4 import mxfp4_dequant, mxfp4_quantize, oss_moe_ref

    g = torch.Generator().manual_seed(T * 7 + E)
    x = torch.randn(T, D, generator=g)
    gu, dn = torch.randn(E, 2 * I, D, generator=g) * 0.3, torch.randn(E, D, I, generator=g) * 0.3
    gb, db = torch.randn(E, 2 * I, generator=g) * 0.2, torch.randn(E, D, generator=g) * 0.2
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    limit, alpha = 1.5, 1.702  # a low limit so the clamps bite on these inputs
    if kind == "mxfp4":
        (gq, gs), (dq, ds) = mxfp4_quantize(gu), mxfp4_quantize(dn)
        gs[0, 0, 0] = 0  # an e8m0 of 0: the subnormal scale 2^-127
        args = (gq.flatten(-2).contiguous(), dq.flatten(-2).contiguous())
        gu_v, dn_v = mxfp4_dequant(gq, gs, torch.float32), mxfp4_dequant(dq, ds, torch.float32)
        run = lambda a, b, s1=gs, s2=ds, lim=limit: native.moe_oss(x, ids, w, a, b, gb, db, lim, alpha, s1, s2,
                                                                   act="f32")  # exact: int16 activations below
    else:
        dt = getattr(torch, kind)
        args = (gu.to(dt), dn.to(dt))
        gu_v, dn_v = args[0].float(), args[1].float()
        run = lambda a, b, lim=limit: native.moe_oss(x, ids, w, a, b, gb, db, lim, alpha)
    ref = oss_moe_ref(x, ids, w, E, lambda e: (gu_v[e], gb[e], dn_v[e], db[e]), limit, alpha)
    y = run(*args)
    assert y.shape == ref.shape and _rel(y, ref) < TOL_MOE, _rel(y, ref)
    assert _rel(run(*args, lim=100.0), ref) > 100 * TOL_MOE  # the clamp matters here
    bad = args[1].clone()  # the down projection (nothing clamps after it)
    if kind == "mxfp4":
        bad[int(ids[0, 0]), 1, 3] ^= 0x11
    else:
        bad[int(ids[0, 0]), 1, 3] += 0.5
    assert _rel(run(args[0], bad), ref) > 100 * TOL_MOE
    if kind == "mxfp4":
        ds2 = ds.clone()
        ds2[int(ids[0, 0]), 5, 0] += 1
        assert _rel(run(*args, s2=ds2), ref) > 100 * TOL_MOE


def _oss_mx_problem(T, K, E, D, I, seed):
    """A gpt-oss MXFP4 layer → (moe_oss's arguments, the dequantised fp32 weights, limit, alpha)."""
    from lynx_edge.kernels.moe_mxfp4 import mxfp4_dequant, mxfp4_quantize

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    (gq, gs), (dq, ds) = mxfp4_quantize(torch.randn(E, 2 * I, D, generator=g) * 0.3), \
        mxfp4_quantize(torch.randn(E, D, I, generator=g) * 0.3)
    gs[0, 0, 0], gs[0, 1, 0], ds[-1, 0, -1] = 0, 1, 1  # e8m0 0 and 1: the subnormal scales 2^-127, 2^-126
    gb, db = torch.randn(E, 2 * I, generator=g) * 0.2, torch.randn(E, D, generator=g) * 0.2
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    args = [x, ids, w, gq.flatten(-2).contiguous(), dq.flatten(-2).contiguous(), gb, db, 1.5, 1.702, gs, ds]
    return args, (mxfp4_dequant(gq, gs, torch.float32), mxfp4_dequant(dq, ds, torch.float32))


def _oss_q16_reference(args, weights, quant):
    """fp64 sums of gpt-oss's layer whose expert inputs, x and h, pass through quant(v) first."""
    from lynx_edge.kernels.moe_mxfp4 import oss_act

    x, ids, w, _, _, gb, db, limit, alpha = args[:9]
    gu, dn = weights
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            hg = (gu[e].double() @ quant(x[t]).double() + gb[e].double()).float()
            h = oss_act(hg[None], limit, alpha)[0]
            ref[t] += float(w[t, k]) * (dn[e].double() @ quant(h).double() + db[e].double())
    return ref.float()


# vs the emulation of the same int16 activations: h's codes come from the kernel's fp32 h, the
# reference's from fp64, so a code one step (2^-16 of its block's largest input) apart flips now and
# then, as in test_int4_q16_moe_matches_emulation (observed max |Δ| / output scale 4.9e-6 over 18
# problems; 1e-7 without a flip)
TOL_MX16 = 2e-5
TOL_MX8 = 2e-6  # int8 codes a step apart (2^-7 of the block's largest input) flip far more rarely: observed 5.6e-7


@pytest.mark.parametrize("T,K,E,D,I", [(1, 2, 4, 64, 32), (5, 4, 8, 96, 288), (9, 2, 3, 512, 64), (70, 2, 2, 64, 96)])
def test_gpt_oss_mxfp4_integer_activations_match_emulation(T, K, E, D, I):
    """MXFP4 rows against int16 activations (act="q16", the default on AVX2): equal to fp64 sums
    over the same dequantised weights with x and h rounded as the kernel rounds them (blocks of 32,
    32767 levels) — 1, 3, 9 (a chunk of eight and one more) and 16 blocks a row, subnormal scales;
    a prompt's 70 tokens an expert (a chunk of 64 and a partial tile of 4 after it) —
    and on int8 ones (act="q8", 127 levels) to the emulation of those. A token's result does
    not depend on the batch around it. Bug cases: a code flipped, a scale one off."""
    args, weights = _oss_mx_problem(T, K, E, D, I, seed=T + D)
    args[0][:, 0::64] *= 300  # one large input in every other block: its neighbours round coarsely,
    args[7] = 100.0  # and no clamp hides that
    ref = _oss_q16_reference(args, weights, lambda v: _q16(v, 32))
    y = native.moe_oss(*args, act="q16")
    assert _rel(y, ref) < TOL_MX16, _rel(y, ref)
    y8 = native.moe_oss(*args, act="q8")  # int8 activations (mx8_rows), the same blocks of 32
    ref8 = _oss_q16_reference(args, weights, lambda v: _q8(v, 32))
    assert _rel(y8, ref8) < TOL_MX8, _rel(y8, ref8)
    assert _rel(y8, ref) > 10 * TOL_MX8  # not the int16 rows
    assert 2e-5 < _rel(y, native.moe_oss(*args, act="f32")) < 1e-3  # the int16 rows ran (observed 4e-5 to 2e-4)
    for t in range(T):  # alone = in the batch, bit for bit
        for act, full in (("q16", y), ("q8", y8)):
            one = native.moe_oss(args[0][t:t + 1], args[1][t:t + 1], args[2][t:t + 1], *args[3:], act=act)
            assert torch.equal(one, full[t:t + 1])
    bad = [a.clone() if i in (4, 10) else a for i, a in enumerate(args)]
    e = int(args[1][0, 0])
    bad[4][e, 1, 3] ^= 0x11  # two codes of the down projection
    assert _rel(native.moe_oss(*bad, act="q16"), ref) > 100 * TOL_MX16
    assert _rel(native.moe_oss(*bad, act="q8"), ref8) > 100 * TOL_MX16
    bad[4][e, 1, 3] ^= 0x11
    bad[10][e, 5, 0] += 1  # a down block's scale doubled
    assert _rel(native.moe_oss(*bad, act="q16"), ref) > 100 * TOL_MX16
    assert _rel(native.moe_oss(*bad, act="q8"), ref8) > 100 * TOL_MX16


@pytest.mark.parametrize("arch", ["haswell", "x86-64"])
def test_other_isa_paths(arch, tmp_path):
    """The AVX2/FMA (haswell) and portable (x86-64) code paths, which an AVX-512 machine never
    takes, built for that -march and run through this file's kernel tests in a subprocess."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("x86 -march targets")
    from lynx_edge.cpuflags import cpu_flags

    flags = cpu_flags()
    if (arch == "haswell" and os.environ.get("LYNX_EDGE_NATIVE_ARCH", "native") == "native"
            and {"avx2", "fma"} <= flags and "avx512f" not in flags):
        pytest.skip("this AVX2/FMA host's own build already runs the haswell paths in every kernel test")
    env = {**os.environ, "LYNX_EDGE_NATIVE_ARCH": arch, "XDG_CACHE_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "tests/test_cpu_lowbit.py",
                        "-k", "matches or gpt_oss or rmsnorm or thread_count or fp8 or (lowbit and native) or tiles or alone or exp_and_silu"],
                       env=env, capture_output=True, text=True, cwd=str(Path(__file__).parents[1]))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert list(tmp_path.glob("lynx-edge/native/cpu_native-*.so")), "the test built no library for " + arch


def test_bad_ids_and_rows_raise_without_writing():
    """An expert id outside [0, E) is one clear error (the C kernel checks before it writes); a
    cache row or position outside the cache leaves the caches untouched (torch's path decides)."""
    x, ids, w, gu, dn = _moe_problem(3, 2, 4, 64, 32, torch.float32)
    bad = ids.clone()
    bad[1, 0] = 4
    with pytest.raises(IndexError, match="expert id 4 out of range for 4 experts"):
        native.moe_dense(x, bad, w, gu, dn)
    kc, vc = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    qkv, cs = torch.randn(1, 8 * 16), torch.ones(1, 16)
    for rows, pos in ((torch.tensor([2]), torch.tensor([0])), (torch.tensor([0]), torch.tensor([8]))):
        assert native.attn_decode(qkv, 4, 2, 16, None, None, 0.0, cs, cs, pos, rows, kc, vc, None) is None
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize("hd", [16, 12])  # vector rows (hd % 8 == 0) and the scalar loop
@pytest.mark.parametrize("cdt", [torch.float32, torch.bfloat16])
def test_attn_ring_matches_full_cache(hd, cdt):
    """A window layer's ring (kv_cache.py: R positions, each at slots p % R and p % R + R) gives the
    full cache's outputs bit for bit: three rows that start at different steps run 40 positions past
    a window of 5 in a ring of 7 (its slots wrap five times), with sinks and q/k norms — and the ring
    slot of the position that just left the window is poisoned (NaN) each step, so a read past the
    window shows. Bug cases: the window's oldest slot poisoned, a window past the ring refused."""
    if native.lib() is None:
        pytest.skip("native kernels not built")
    g = torch.Generator().manual_seed(hd)
    H, Hkv, W, R, steps, starts = 4, 2, 5, 7, 40, (0, 3, 11)
    qn, kn = torch.rand(hd, generator=g) + 0.5, torch.rand(hd, generator=g) + 0.5
    sinks = torch.randn(H, generator=g)
    full = [torch.zeros(3, Hkv, steps, hd, dtype=cdt) for _ in range(2)]
    ring = [torch.zeros(3, Hkv, 2 * R, hd, dtype=cdt) for _ in range(2)]
    for t in range(steps):
        live = [b for b in range(3) if t >= starts[b]]
        rows = torch.tensor(live)
        pos = torch.tensor([t - starts[b] for b in live])
        qkv = torch.randn(len(live), (H + 2 * Hkv) * hd, generator=g)
        cs, sn = torch.rand(len(live), hd, generator=g), torch.rand(len(live), hd, generator=g)
        args = (qkv, H, Hkv, hd, qn, kn, 1e-6, cs, sn, pos, rows)
        want = native.attn_decode(*args, *full, W, sinks)
        got = native.attn_decode(*args, *ring, W, sinks, R)
        assert want is not None and torch.equal(got, want), t
        for b, p in zip(live, pos.tolist()):
            if p >= W - 1:  # position p - W + 1 is not in the next step's window: poison its slots
                for c in ring:
                    c[b, :, (p - W + 1) % R] = float("nan")
                    c[b, :, (p - W + 1) % R + R] = float("nan")
    bad = [c.clone() for c in ring]
    p = int(pos[-1])
    for c in bad:  # the oldest position of this step's window
        c[live[-1], :, (p - W + 1) % R] = 7.0
    assert not torch.equal(native.attn_decode(*args, *bad, W, sinks, R), got)
    assert native.attn_decode(*args, *ring, R + 1, sinks, R) is None  # a window the ring cannot hold


def _attn_ref(qkv, kc, vc, rows, pos, H, Hkv, hd, window, sinks):
    """fp64 decode attention straight from the caches (after the call wrote this step's keys), no
    q/k norm, RoPE the identity (cos 1, sin 0): out [B, H * hd]."""
    G, out = H // Hkv, []
    for b in range(len(rows)):
        p = int(pos[b])
        lo = max(0, p - window + 1) if window else 0
        q = qkv[b, : H * hd].double().view(H, hd) * hd ** -0.5
        heads = []
        for h in range(H):
            k = kc[int(rows[b]), h // G, lo : p + 1].double()
            v = vc[int(rows[b]), h // G, lo : p + 1].double()
            s = k @ q[h]
            if sinks is not None:
                s = torch.cat([s, sinks[h : h + 1].double()])
                v = torch.cat([v, torch.zeros(1, hd, dtype=v.dtype)])
            heads.append(torch.softmax(s, 0) @ v)
        out.append(torch.cat(heads))
    return torch.stack(out)


@pytest.mark.parametrize("G", [1, 2, 3, 8, 16])
def test_attention_every_group_width(G):
    """The score and value passes tile by the q heads a kv head serves (keys x 4 heads from 3, else
    keys x G; the value pass 1-4 heads x vectors of dims): each width against fp64 attention, bf16
    caches, two rows of different lengths (a key count no tile divides)."""
    if native.lib() is None:
        pytest.skip("native kernels not built")
    g = torch.Generator().manual_seed(11)
    Hkv, hd, S = 2, 32, 160
    H = G * Hkv
    kc = torch.randn(2, Hkv, S, hd, generator=g).to(torch.bfloat16)
    vc = torch.randn(2, Hkv, S, hd, generator=g).to(torch.bfloat16)
    qkv = torch.randn(2, (H + 2 * Hkv) * hd, generator=g) * 2
    cs, sn = torch.ones(2, hd), torch.zeros(2, hd)
    rows, pos = torch.arange(2), torch.tensor([150, 37])
    got = native.attn_decode(qkv, H, Hkv, hd, None, None, 0.0, cs, sn, pos, rows, kc, vc, None)
    ref = _attn_ref(qkv, kc, vc, rows, pos, H, Hkv, hd, None, None)
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-6, err  # seen ~1e-7


@pytest.mark.parametrize("cdt", [torch.float32, torch.bfloat16])
def test_long_windows_attend_in_chunks(cdt):
    """Rows past ATTN_CHUNK (2048) positions attend in chunks, one work item each, merged in order
    (flash-decoding): against fp64 attention with sinks, for rows of 101 positions (whole), exactly
    2048 (whole), 2049 and 5001 (two and three chunks), and a 3000-wide window; a long row alone
    equals its row in the batch bit for bit, and so do one thread and two."""
    if native.lib() is None:
        pytest.skip("native kernels not built")
    g = torch.Generator().manual_seed(5)
    H, Hkv, hd, S = 8, 2, 16, 5200
    kc = torch.randn(4, Hkv, S, hd, generator=g).to(cdt)
    vc = torch.randn(4, Hkv, S, hd, generator=g).to(cdt)
    qkv = torch.randn(4, (H + 2 * Hkv) * hd, generator=g) * 3
    cs, sn = torch.ones(4, hd), torch.zeros(4, hd)
    sinks = torch.randn(H, generator=g)
    rows, pos = torch.arange(4), torch.tensor([100, 2047, 2048, 5000])
    for window in (None, 3000):
        caches = [kc.clone(), vc.clone()]
        got = native.attn_decode(qkv, H, Hkv, hd, None, None, 0.0, cs, sn, pos, rows, *caches, window, sinks)
        ref = _attn_ref(qkv, *caches, rows, pos, H, Hkv, hd, window, sinks)
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-6, (window, err)  # seen ~2e-7
        alone = native.attn_decode(qkv[3:], H, Hkv, hd, None, None, 0.0, cs[3:], sn[3:], pos[3:], rows[3:],
                                   kc.clone(), vc.clone(), window, sinks)
        assert torch.equal(alone[0], got[3])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.attn_decode(qkv, H, Hkv, hd, None, None, 0.0, cs, sn, pos, rows, kc.clone(), vc.clone(), None, sinks)
        torch.set_num_threads(2)
        two = native.attn_decode(qkv, H, Hkv, hd, None, None, 0.0, cs, sn, pos, rows, kc.clone(), vc.clone(), None, sinks)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_long_batches_run_in_bounded_chunks(monkeypatch):
    """Past MAX_SLOTS token-expert slots the layer runs in token chunks (bounded scratch): the same
    result as one call, to fp32 rounding."""
    x, ids, w, gu, dn = _moe_problem(23, 3, 4, 72, 40, torch.float32)
    whole = native.moe_dense(x, ids, w, gu, dn)
    monkeypatch.setattr(native, "MAX_SLOTS", 9)  # 3 tokens per call: 8 calls, the last short
    assert _rel(native.moe_dense(x, ids, w, gu, dn), whole) < TOL_MOE


# --- INT4 linear (GPTQ / AWQ attention kept packed: quant/linear.py) ---------------------------

TOL_Q4 = 3.5e-6  # observed max |Δ| / output scale 9.2e-7 over these cases × 5 seeds


def _q4_problem(T, N, Kin, G, sym, act_order, bias, seed=0):
    from lynx_edge.quant.formats import QuantLinear
    from lynx_edge.quant.int4 import quantize_rtn

    g = torch.Generator().manual_seed(seed)
    codes, s, z = quantize_rtn(torch.randn(N, Kin, generator=g), G, sym)
    perm = torch.randperm(Kin, generator=g) if act_order else None
    ql = QuantLinear(codes, s, z, perm, sym=sym)
    x = torch.randn(T, Kin, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    ref = F.linear(x.double(), ql.dequant().double(), None if b is None else b.double()).float()
    return ql, x, b, ref


@pytest.mark.parametrize("T,N,Kin,G,sym,act_order,bias", [
    (1, 48, 64, 32, False, False, False), (1, 512, 2048, 128, True, False, True), (3, 40, 256, 64, False, True, True),
    (7, 96, 128, 32, True, True, False), (70, 24, 128, 128, False, False, True)])
def test_int4_linear_matches_reference(T, N, Kin, G, sym, act_order, bias):
    ql, x, b, ref = _q4_problem(T, N, Kin, G, sym, act_order, bias)
    p = None if ql.perm is None else ql.perm.to(torch.int32)
    y = native.linear_int4(x, ql.packed, ql.scales, None if sym else ql.zeros, p, b)
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert _rel(y, ref) < TOL_Q4, _rel(y, ref)
    assert torch.equal(native.dequant_int4(ql.packed, ql.scales, None if sym else ql.zeros),
                       _dequant_code_order(ql))


def _dequant_code_order(ql) -> torch.Tensor:
    from lynx_edge.quant.int4 import dequant

    return dequant(ql.packed, ql.scales, None if ql.sym else ql.zeros, ql.group_size)


def test_int4_linear_bugs_are_caught():
    ql, x, b, ref = _q4_problem(2, 64, 256, 64, False, True, True)
    p = ql.perm.to(torch.int32)
    bad_s = ql.scales.clone()
    bad_s[1, 7] *= 1.01  # one group's scale of one row, 1% off
    assert _rel(native.linear_int4(x, ql.packed, bad_s, ql.zeros, p, b), ref) > 10 * TOL_Q4
    rev = p.flip(0).contiguous()  # the act-order permutation ignored / applied wrongly
    assert _rel(native.linear_int4(x, ql.packed, ql.scales, ql.zeros, rev, b), ref) > 10 * TOL_Q4
    bad_z = ql.zeros.clone()
    bad_z[0, 0] ^= 1  # one zero point
    assert _rel(native.linear_int4(x, ql.packed, ql.scales, bad_z, p, b), ref) > 10 * TOL_Q4


@pytest.mark.parametrize("rows", [1, 5, 40])  # the kernel (≤ NATIVE_MAX_ROWS) and the widened prefill path
def test_int4_linear_module_and_fused_qkv(rows):
    from lynx_edge.quant.linear import NATIVE_MAX_ROWS, Int4Linear

    assert (rows <= NATIVE_MAX_ROWS) == (rows < 40)
    mods, refs = [], []
    x = torch.randn(1, rows, 128, generator=torch.Generator().manual_seed(4))
    for i, n in enumerate((64, 32, 32)):  # q, k, v sharing one act-order permutation
        ql, _, b, _ = _q4_problem(1, n, 128, 32, False, False, True, seed=i)
        ql.perm = torch.randperm(128, generator=torch.Generator().manual_seed(9))
        m = Int4Linear(n, 128, True, torch.float32, "cpu")
        m.load_quant(ql)
        m.bias.data.copy_(b)
        mods.append(m)
        refs.append(F.linear(x.double(), ql.dequant().double(), b.double()).float())
    for m, ref in zip(mods, refs):
        assert _rel(m(x), ref) < TOL_Q4
    fused = Int4Linear.fuse(mods)
    y = fused(x)
    assert y.shape == (1, rows, 128)
    assert _rel(y, torch.cat(refs, -1)) < TOL_Q4
    assert mods[1].packed.data_ptr() == fused.packed[64:].data_ptr()  # views: the copies are freed
    for m, ref in zip(mods, refs):  # the separate modules still compute on their views
        assert _rel(m(x), ref) < TOL_Q4
    mods[2].perm = mods[2].perm.flip(0)
    assert Int4Linear.fuse(mods) is None  # different permutations do not fuse


# --- INT4 against int8 activations (act="q8": Q8 blocks of 32, integer dot products) ----------

TOL_Q8 = 3e-6  # vs the torch emulation of the same quantisation: observed max |Δ| / output scale 6.6e-7


@pytest.mark.parametrize("T,N,Kin,G,sym,act_order", [(1, 48, 128, 32, False, False), (1, 512, 2048, 128, True, False),
                                                     (3, 40, 256, 64, False, True), (6, 24, 384, 128, False, True)])
def test_int4_q8_linear_matches_emulation(T, N, Kin, G, sym, act_order):
    ql, x, b, exact = _q4_problem(T, N, Kin, G, sym, act_order, True)
    p = None if ql.perm is None else ql.perm.to(torch.int32)
    xc = x if p is None else x[:, p.long()]  # code order, as the kernel quantises it
    w_code = _dequant_code_order(ql)
    ref = F.linear(_q8(xc).double(), w_code.double(), b.double()).float()
    y = native.linear_int4(x, ql.packed, ql.scales, None if sym else ql.zeros, p, b, act="q8")
    assert _rel(y, ref) < TOL_Q8, _rel(y, ref)
    assert 1e-4 < _rel(y, exact) < 2e-2  # really quantised, and only by ~2^-8 per input
    x2 = x.clone()
    x2[0, 5] += 0.3  # one input moved: a wrong block scale / layout would miss or smear it
    ref2 = F.linear(_q8(x2 if p is None else x2[:, p.long()]).double(), w_code.double(), b.double()).float()
    assert _rel(native.linear_int4(x2, ql.packed, ql.scales, None if sym else ql.zeros, p, b, act="q8"), ref2) < TOL_Q8


def _int4_moe_emulated(quant):
    """An INT4 MoE problem (6 experts, D 256, I 128, G 64, top-2 of 5 tokens) → (moe_int4's arguments,
    the fp64 reference whose expert inputs, x and h, pass through quant(v, G) first: the activation
    quantisation under test, emulated)."""
    from lynx_edge.quant.int4 import quantize_experts

    g = torch.Generator().manual_seed(2)
    E, D, I, T, K, G = 6, 256, 128, 5, 2, 64
    packed = quantize_experts(torch.randn(E, 2 * I, D, generator=g) / D**0.5,
                              torch.randn(E, D, I, generator=g) / I**0.5, G, False)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    ref = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            gue, dne = packed.dequant_expert(int(ids[t, k]))
            hgu = gue.double() @ quant(x[t], G).double()
            h = (F.silu(hgu[:I]) * hgu[I:]).float()
            ref[t] += float(w[t, k]) * (dne.double() @ quant(h, G).double())
    return (x, ids, w, packed.data, packed.layout.part_offsets, False, G, D, I), ref.float()


def test_int4_q8_moe_matches_emulation():
    args, ref = _int4_moe_emulated(lambda v, G: _q8(v))
    y = native.moe_int4(*args, act="q8")
    # h is rounded to int8 after fp32 sums in another order: a rare tie can move one step of one
    # input, hence a bound above TOL_Q8 (observed 8.9e-7)
    assert _rel(y, ref) < 3 * TOL_Q8, _rel(y, ref)
    exact = native.moe_int4(*args, act="f32")
    assert 1e-4 < _rel(y, exact) < 2e-2


# --- INT4 against int16 activations (act="q16": a scale per weight group, integer dot products) -

TOL_Q16 = 1e-6  # vs the torch emulation of the same quantisation: observed max |Δ| / output scale 3.5e-7


@pytest.mark.parametrize("T,N,Kin,G,sym,act_order", [(1, 48, 128, 32, False, False), (1, 512, 2048, 128, True, False),
                                                     (3, 40, 256, 64, False, True), (6, 24, 384, 128, False, True),
                                                     (5, 20, 512, 128, True, False),
                                                     (7, 31, 256, 32, False, False)])  # AVX-512 row pairs + a lone row
def test_int4_q16_linear_matches_emulation(T, N, Kin, G, sym, act_order):
    ql, x, b, exact = _q4_problem(T, N, Kin, G, sym, act_order, True)
    p = None if ql.perm is None else ql.perm.to(torch.int32)
    xc = x if p is None else x[:, p.long()]  # code order, as the kernel quantises it
    w_code = _dequant_code_order(ql)
    ref = F.linear(_q16(xc, G).double(), w_code.double(), b.double()).float()
    y = native.linear_int4(x, ql.packed, ql.scales, None if sym else ql.zeros, p, b, act="q16")
    assert _rel(y, ref) < TOL_Q16, _rel(y, ref)
    # really quantised, and only by ~2^-16 of a block's largest input: 256x closer than q8's
    assert 1e-7 < _rel(y, exact) < 1e-4, _rel(y, exact)
    x2 = x.clone()
    x2[0, 5] += 0.3  # one input moved: a wrong block scale / layout would miss or smear it
    ref2 = F.linear(_q16(x2 if p is None else x2[:, p.long()], G).double(), w_code.double(), b.double()).float()
    y2 = native.linear_int4(x2, ql.packed, ql.scales, None if sym else ql.zeros, p, b, act="q16")
    assert _rel(y2, ref2) < TOL_Q16


def test_int4_default_act_matches_the_build(monkeypatch):
    """q16 is the default only where it was measured faster than the f32 rows: AVX2 without AVX-512
    (run for the AVX2 and portable builds by test_other_isa_paths), and AVX-512 on an AMD CPU (a
    Zen4); an Intel CPU's AVX-512 build and the portable build keep f32."""
    monkeypatch.setattr(native, "INT4_ACT", None)
    vec = bool(native.lib().lynx_q16_pays())
    arch = os.environ.get("LYNX_EDGE_NATIVE_ARCH")
    if arch in ("x86-64", "haswell"):
        assert vec == (arch == "haswell")
    elif arch is None and "avx512f" in cpu_flags():  # this machine's AVX-512 build: by vendor
        assert vec == ("AuthenticAMD" in Path("/proc/cpuinfo").read_text(encoding="utf-8"))
    assert native.default_int4_act() == ("q16" if vec else "f32")


def test_int4_q16_bugs_are_caught():
    """The emulation's bound is far below what a kernel with other activation blocks, or one group's
    scale off by 0.2%, would give."""
    ql, x, b, _ = _q4_problem(2, 64, 512, 128, False, False, True)
    w_code = _dequant_code_order(ql)
    ref = F.linear(_q16(x, 128).double(), w_code.double(), b.double()).float()
    assert _rel(native.linear_int4(x, ql.packed, ql.scales, ql.zeros, None, b, act="q16"), ref) < TOL_Q16
    wrong = F.linear(_q16(x, 32).double(), w_code.double(), b.double()).float()  # blocks of 32, not the group
    assert _rel(wrong, ref) > 10 * TOL_Q16  # (2.4e-5)
    bad_s = ql.scales.clone()
    bad_s[1, 7] *= 1.002  # one group's scale of one row, 0.2% off (a few fp16 steps)
    assert _rel(native.linear_int4(x, ql.packed, bad_s, ql.zeros, None, b, act="q16"), ref) > 10 * TOL_Q16


def test_int4_q16_moe_matches_emulation():
    args, ref = _int4_moe_emulated(_q16)
    y = native.moe_int4(*args, act="q16")
    # h's int16 codes come from the kernel's fp32 h, the reference's from fp64: a code ~2^-16 of its
    # block's largest input apart flips now and then (~1 in 250 inputs), hence 30x (observed 1.3e-5)
    assert _rel(y, ref) < 30 * TOL_Q16, _rel(y, ref)
    exact = native.moe_int4(*args, act="f32")
    assert 1e-7 < _rel(y, exact) < 1e-4, _rel(y, exact)


def test_attention_tokens_of_one_row_in_one_call_see_each_other():
    """A mixed step packs a prompt chunk as one token per attention row, several in the same cache
    row: every key is written before any token attends, so the later ones see the earlier ones
    whichever thread runs them (the torch path's order), at any thread count."""
    from lynx_edge.models.layers import AttnBatch

    att, rope = _attn("qwen3_moe", torch.float32)
    g = torch.Generator().manual_seed(2)
    caches = tuple(torch.randn(2, 2, 12, 16, generator=g) for _ in range(2))
    x = torch.randn(4, 1, 64, generator=g)
    rows, pos = torch.tensor([1, 1, 1, 0]), torch.tensor([[3], [4], [5], [7]])  # a 3-token chunk of row 1
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs = {}
            for native_on in (True, False):
                att._native_decode = None if native_on else False
                kv = tuple(c.clone() for c in caches)
                ab = AttnBatch(positions=pos, rows=rows, kv_len=8)
                ab.cos, ab.sin = rope.cos_sin(pos, torch.float32)
                outs[native_on] = att(x, ab, kv)
            assert _rel(outs[True], outs[False]) < 1e-6, (threads, _rel(outs[True], outs[False]))
    finally:
        torch.set_num_threads(before)


# --- FP8 (block-scaled e4m3) experts ---------------------------------------------------------------
def _fp8_problem(T, K, E, D, I, block, seed=0):
    """Experts whose codes are drawn from every finite e4m3 byte (normals, subnormals, ±0) with
    random positive block scales, as Fp8MoEExperts holds them."""
    from lynx_edge.quant.fp8 import Fp8MoEExperts

    g = torch.Generator().manual_seed(seed)
    valid = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)  # no NaN codes
    m = Fp8MoEExperts(E, D, I, block)
    m.gate_up.view(torch.uint8).copy_(valid[torch.randint(len(valid), (E, 2 * I, D), generator=g)])
    m.down.view(torch.uint8).copy_(valid[torch.randint(len(valid), (E, D, I), generator=g)])
    m.gate_up_scale.copy_(torch.rand(m.gate_up_scale.shape, generator=g) * 0.01 / D**0.5 + 1e-4)
    m.down_scale.copy_(torch.rand(m.down_scale.shape, generator=g) * 0.01 / I**0.5 + 1e-4)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).reshape(T, K)
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return m, x, ids, w


# one token, 9 tokens on 4 experts (groups of four and remainders), non-square blocks (bn 64 over
# rows, bk 32 over inputs), the published 128 × 128
@pytest.mark.parametrize("T,K,E,D,I,block", [(1, 2, 8, 256, 128, (128, 128)), (9, 3, 4, 256, 128, (64, 32)),
                                             (23, 4, 16, 512, 256, (128, 128)), (4, 1, 2, 128, 128, (128, 64))])
def test_fp8_moe_matches_reference(T, K, E, D, I, block):
    """native.moe_fp8 against fp32 math on the exactly decoded weights (torch's e4m3 → fp32 times
    the block scale); each row alone equals itself inside the batch (batch-invariant). Observed
    max |Δ| / output scale ≤ 4.8e-7."""
    m, x, ids, w = _fp8_problem(T, K, E, D, I, block)
    gu, dn = m.dequantized()
    ref = moe_ref_loop(x, ids, w, gu, dn)
    y = m(x, ids, w)
    assert y.dtype == torch.float32 and _rel(y, ref) < TOL_MOE, _rel(y, ref)
    alone = torch.cat([m(x[t:t + 1], ids[t:t + 1], w[t:t + 1]) for t in range(T)])
    assert torch.equal(alone, y)


def test_fp8_moe_bugs_are_caught():
    """A code one step off, a scale read from the neighbouring block, a sign dropped: each moves
    the result far past the bound."""
    m, x, ids, w = _fp8_problem(5, 2, 4, 256, 128, (64, 32))
    gu, dn = m.dequantized()
    ref = moe_ref_loop(x, ids, w, gu, dn)
    e = int(ids[0, 0])
    for mutate in (lambda: m.gate_up.view(torch.uint8)[e, 3, :64].add_(1),
                   lambda: m.down_scale[e, 0].copy_(m.down_scale[e, 1].flip(0) * 3),
                   lambda: m.gate_up.view(torch.uint8)[e, 0:8].bitwise_xor_(0x80)):
        keep = (m.gate_up.clone(), m.down_scale.clone())
        mutate()
        assert _rel(m(x, ids, w), ref) > 100 * TOL_MOE
        m.gate_up.copy_(keep[0])
        m.down_scale.copy_(keep[1])
    assert _rel(m(x, ids, w), ref) < TOL_MOE


@pytest.mark.parametrize("T,N,Kin,block,bias", [(1, 72, 256, (64, 32), False), (5, 130, 128, (128, 128), True),
                                               (32, 64, 512, (16, 64), True)])
def test_fp8_linear_matches_reference(T, N, Kin, block, bias):
    """native.linear_fp8 (rows not a multiple of bn: the last scale row is partial) against the
    widened fp32 path on the same decoded weight; a scale off by one block row is caught."""
    from lynx_edge.quant.fp8 import Fp8Linear, quantize

    g = torch.Generator().manual_seed(1)
    lin = Fp8Linear(N, Kin, bias, torch.float32, "cpu", block)
    lin.load_fp8(*quantize(torch.randn(N, Kin, generator=g) / Kin**0.5, block))
    if bias:
        lin.bias.data.normal_(generator=g)
    x = torch.randn(T, Kin, generator=g)
    from lynx_edge.quant.fp8 import dequant_ref

    assert torch.equal(native.dequant_fp8(lin.weight, lin.weight_scale_inv, block),
                       dequant_ref(lin.weight, lin.weight_scale_inv, block))  # exact, as torch decodes e4m3
    ref = lin.widened(x)
    y = lin.native(x)
    assert _rel(y, ref) < TOL_LIN, _rel(y, ref)
    assert torch.equal(torch.cat([lin.native(x[t:t + 1]) for t in range(T)]), y)  # batch-invariant
    lin.weight_scale_inv[0].mul_(1.01)
    assert _rel(lin.native(x), ref) > 100 * TOL_LIN


@pytest.mark.parametrize("arch", ["icelake-server", "sapphirerapids"])
def test_avx512_paths_compile(arch):
    """The AVX-512 / VNNI / AMX-era paths, which an AVX2 machine can neither run nor build for its own
    -march: compiled (not run) for such a target, so an error in them fails here and not on a user's box."""
    import platform

    cc = native._compiler()
    if cc is None or platform.machine() != "x86_64":
        pytest.skip("x86 target flags need an x86 compiler")
    r = subprocess.run([cc, "-O1", f"-march={arch}", "-Wall", "-Werror=implicit-function-declaration", "-c", "-o",
                        os.devnull, str(native.SRC)], capture_output=True, text=True)
    if r.returncode and "bad value" in r.stderr:
        pytest.skip(f"{cc} does not know -march={arch}")
    assert r.returncode == 0, r.stderr[-3000:]


# --- row tiles: every row x token sums the same way alone or in any tile ------------------------

@pytest.mark.parametrize("kind,Kin", [("f32", 100), ("f32", 256), ("f32", 1024), ("bf16", 256), ("bf16", 1024), ("int8", 256),
                                      ("int8-q8", 256), ("int4", 256), ("int4-q8", 256),
                                      ("int4-q16", 256), ("int4-q16", 512)])  # 512: groups of 128
def test_row_tiles_are_batch_and_row_invariant(kind, Kin):
    """The kernels run several adjacent rows and up to four tokens per tile. The 16-bit and int8
    rows (dense_tile): one token over 4 rows (K = 100: a scalar tail; the experts' whole-row reads
    on AVX2 are checked by test_dense_moe_tokens_alone_equal_their_batch); two over 8 (AVX-512; 4 on
    AVX2) or, for rows of 1024+ inputs, 4; three or more over 4 rows (AVX-512; 2 on AVX2) or 2 for long rows, each tile's rows
    serving every group of four tokens in turn (on AVX2 a lone last token joins the group before it:
    2 x 5 tiles). INT4: up to four rows x four tokens. Each output
    must be bit-equal whether its row and token run alone or inside any tile: decode is
    batch-invariant, and a projection's rows do not depend on their neighbours. N = 19 is a 16-row
    work item and a 3-row one; T = 1, 2, 3, 5, 6, 7, 9 take every tile shape (6: a group of 4, then
    2; 7: 4, then 3; 5 and 9: the last 5 in one tile)."""
    N, T = 19, 9
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, Kin, generator=g)
    if kind in ("f32", "bf16"):
        W = (torch.randn(N, Kin, generator=g) / Kin**0.5).to(torch.float32 if kind == "f32" else torch.bfloat16)

        def run(xs, rows):
            return native.linear(xs, W[rows].contiguous())
    elif kind.startswith("int8"):
        from lynx_edge.quant.int8 import quantize_rows

        if kind == "int8-q8" and not native.i8_q8():
            pytest.skip("int8 activations for int8 rows need AVX512-VNNI or AVX2")
        q, s = quantize_rows(torch.randn(N, Kin, generator=g))

        def run(xs, rows):
            return native.linear_int8(xs, q[rows].contiguous(), s[rows].contiguous(), act=kind[5:] or None)
    else:
        ql, _, _, _ = _q4_problem(1, N, Kin, 64 if Kin <= 256 else 128, False, False, False)

        def run(xs, rows):
            z = ql.zeros[:, rows].contiguous()
            return native.linear_int4(xs, ql.packed[rows].contiguous(), ql.scales[:, rows].contiguous(), z,
                                      act=kind[5:] or "f32")
    for n_tok in (1, 2, 3, 5, 6, 7, T):
        full = run(x[:n_tok], slice(0, N))
        for t in range(n_tok):
            for n in range(N):
                assert torch.equal(run(x[t:t + 1], slice(n, n + 1)), full[t:t + 1, n:n + 1]), (kind, n_tok, t, n)
        assert torch.equal(run(x[:n_tok], slice(2, 6)), full[:, 2:6])  # a tile that starts mid-way


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_moe_tokens_alone_equal_their_batch(dtype, stream):
    """The dense experts' rows: a token alone (one slot per expert: the one-token tiles) equals
    itself inside a batch where its experts are shared with 1-5 other tokens (interleaved multi-token
    tiles: 5 slots are AVX2's 2 x 5 tile, 6 a group of 4 and one of 2), bit for bit; and experts read
    as streamed from DRAM (fp32 rows of <= 512 inputs whole at one token, AVX2 and AVX-512; bf16 ones
    too, on AVX2 at 1-3 tokens, on AVX-512 at one token) give the same bits as read from cache. Gate/up rows of 256 inputs, down rows of 100 (a
    scalar tail after 96)."""
    g = torch.Generator().manual_seed(6)
    E, D, I, T, K = 5, 256, 100, 10, 2
    gu = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dtype)
    dn = (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)
    x = torch.randn(T, D, generator=g)
    ids = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1], [0, 2], [0, 2], [1, 2], [3, 2], [3, 4], [3, 4]])  # 6, 5, 4, 3, 2 slots
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    full = native.moe_dense(x, ids, w, gu, dn, stream)
    assert _rel(full, moe_ref_loop(x, ids, w, gu.float(), dn.float())) < TOL_MOE
    assert torch.equal(full, native.moe_dense(x, ids, w, gu, dn, not stream))
    for t in range(T):
        assert torch.equal(native.moe_dense(x[t:t + 1], ids[t:t + 1], w[t:t + 1], gu, dn, stream), full[t:t + 1]), t


@pytest.mark.parametrize("act", ["f32", "q8", "q16"])
def test_int4_moe_tokens_alone_equal_their_batch(act):
    """A token's MoE output alone equals it inside a batch where its experts are shared with 0-3
    other tokens (the one-, two- and four-token tiles), bit for bit."""
    from lynx_edge.quant.int4 import quantize_experts

    g = torch.Generator().manual_seed(5)
    E, D, I, T, K, G = 5, 256, 128, 7, 2, 64
    packed = quantize_experts(torch.randn(E, 2 * I, D, generator=g) / D**0.5,
                              torch.randn(E, D, I, generator=g) / I**0.5, G, False)
    x = torch.randn(T, D, generator=g)
    ids = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 2], [1, 2], [1, 3], [3, 4]])  # 4, 4, 3, 2, 1 slots
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    args = (packed.data, packed.layout.part_offsets, False, G, D, I)
    full = native.moe_int4(x, ids, w, *args, act=act)
    for t in range(T):
        assert torch.equal(native.moe_int4(x[t:t + 1], ids[t:t + 1], w[t:t + 1], *args, act=act), full[t:t + 1]), t


def _packed_problem(dtype, seed=8):
    """E=4 experts of D=136, I=40 (ROW_BLOCK blocks of 16 and a last of 8 rows: whole groups of 4);
    12 tokens, top-2, putting 9, 7, 5 and 3 tokens on the experts (every tile the packed rows take)."""
    g = torch.Generator().manual_seed(seed)
    E, D, I, T = 4, 136, 40, 12
    gu = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dtype)
    dn = (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)
    x = torch.randn(T, D, generator=g)
    ids = torch.tensor([[0 if t < 9 else 3, 1 if t < 7 else 2] for t in range(T)])
    w = torch.softmax(torch.randn(T, 2, generator=g), -1)
    return x, ids, w, gu, dn


@pytest.mark.skipif(native.pack_group() == 0, reason="this build reads no packed rows (the AVX-512 path)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_equal_row_major_alone_and_in_batches(dtype):
    """Experts in packed rows (native.pack_rows: gate_up, down or both) give the row-major kernel's
    bits with 1-9 tokens on an expert (4-row tiles of 1-3 tokens; three at a time past that), and a
    token alone equals itself in the batch (the same sums in the same order, only the addresses
    change); the portable build reads the same layout through its scalar loop (test_other_isa_paths)."""
    x, ids, w, gu, dn = _packed_problem(dtype)
    ref = native.moe_dense(x, ids, w, gu, dn, True)
    assert _rel(ref, moe_ref_loop(x, ids, w, gu.float(), dn.float())) < TOL_MOE
    pgu, pdn = native.pack_rows(gu), native.pack_rows(dn)
    for lay in ((True, True), (True, False), (False, True)):
        args = (pgu if lay[0] else gu, pdn if lay[1] else dn, True, lay)
        assert torch.equal(native.moe_dense(x, ids, w, *args), ref), lay
    for t in (0, 8, 11):
        assert torch.equal(native.moe_dense(x[t:t + 1], ids[t:t + 1], w[t:t + 1], pgu, pdn, True, (True, True)),
                           ref[t:t + 1]), t


@pytest.mark.skipif(native.pack_group() == 0, reason="this build reads no packed rows (the AVX-512 path)")
def test_packed_rows_layout_and_bugs_are_caught():
    """pack_rows's layout as documented (groups of 4 rows, inputs 8 at a time), unpack_rows its
    inverse; row-major weights read as packed, or a layout with the group's rows in another order,
    give other results; shapes the kernel does not take fail with one line."""
    w = torch.arange(8 * 16, dtype=torch.float32).view(8, 16)  # value = 16 * row + input
    p = native.pack_rows(w).reshape(-1)
    assert p[:8].tolist() == list(range(8)) and p[8:16].tolist() == list(range(16, 24))  # row 0, then row 1
    assert p[32:40].tolist() == list(range(8, 16)) and p[64].item() == 64  # row 0's 8.., then group 2
    assert torch.equal(native.unpack_rows(native.pack_rows(w)), w)
    for src in (w.bfloat16(), w.t().contiguous().t().bfloat16()):  # the native copy; a strided source: torch's
        dst = torch.empty(8, 16, dtype=torch.bfloat16)
        native.pack_into(dst, src)
        assert torch.equal(dst, native.pack_rows(w.bfloat16()))
    big = torch.randn(512, 1024).bfloat16()  # 1 MB: the native copy splits its groups over two threads
    dst, threads = torch.empty_like(big), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native.pack_into(dst, big)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(dst, native.pack_rows(big))
    x, ids, w, gu, dn = _packed_problem(torch.bfloat16)
    ref = native.moe_dense(x, ids, w, gu, dn, True)
    assert not torch.equal(native.moe_dense(x, ids, w, gu, dn, True, (True, True)), ref)
    E, R, K = gu.shape
    swapped = gu.reshape(E, R // 4, 4, K // 8, 8).transpose(-3, -2).flip(-2).reshape(gu.shape)  # rows of a group reversed
    assert not torch.equal(native.moe_dense(x, ids, w, swapped, dn, True, (True, False)), ref)
    with pytest.raises(ValueError, match="packed expert rows"):
        native.moe_dense(x[:, :132], ids, w, gu[:, :, :132], dn[:, :132], True, (True, True))  # D % 8 != 0
    # each matrix is checked on its own: gate/up packed where I % 8 != 0 (down, whose inputs are I, not)
    gu12 = torch.cat([gu[:, :12], gu[:, 40:52]], 1).contiguous()
    dn12 = dn[:, :, :12].contiguous()
    assert native.packable(12, 136) and not native.packable(136, 12)
    assert torch.equal(native.moe_dense(x, ids, w, native.pack_rows(gu12), dn12, True, (True, False)),
                       native.moe_dense(x, ids, w, gu12, dn12, True))


@pytest.mark.skipif(native.pack_group() == 0, reason="this build reads no packed rows (the AVX-512 path)")
def test_stacked_experts_keep_streamed_bf16_in_packed_rows():
    """StackedExperts built with pack=True and streamed: short bf16 rows load straight into packed
    rows (load_part), read back row-major by weights(), and its forward at any batch (past
    NATIVE_SLOTS too: only the native kernel reads packed rows) equals the row-major module's, bit
    for bit; fp32 stays row-major (measured slower packed); setting streamed re-lays out in place."""
    from lynx_edge.models import layers

    x, ids, w, gu, dn = _packed_problem(torch.bfloat16)
    E, two_i, D = gu.shape
    I = two_i // 2
    mods = {}
    for pack in (True, False):
        m = layers.StackedExperts(E, D, I, torch.bfloat16, "cpu", streamed=True, pack=pack)
        for e in range(E):
            m.load_part(e, "gate", gu[e, :I])
            m.load_part(e, "up", gu[e, I:])
            m.load_part(e, "down", dn[e])
        mods[pack] = m
    assert mods[True].packed_rows == (True, True) and mods[False].packed_rows == (False, False)
    assert torch.equal(mods[True].gate_up.data, native.pack_rows(gu)) and torch.equal(mods[True].down.data, native.pack_rows(dn))
    assert all(torch.equal(a, b) for a, b in zip(mods[True].weights(), (gu, dn)))
    big = torch.arange(layers.NATIVE_SLOTS + 8) % E  # past NATIVE_SLOTS one-route slots
    xb = torch.randn(big.numel(), D).bfloat16()
    for xx, ii, ww in ((x.bfloat16(), ids, w), (xb, big.view(-1, 1), torch.ones(big.numel(), 1))):
        assert torch.equal(mods[True](xx, ii, ww), mods[False](xx, ii, ww))
    mods[True].streamed = False  # from cache: row-major again, same weights
    assert mods[True].packed_rows == (False, False) and torch.equal(mods[True].gate_up.data, gu)
    f32 = layers.StackedExperts(E, D, I, torch.float32, "cpu", streamed=True, pack=True)
    assert f32.packed_rows == (False, False)


@pytest.mark.parametrize("kind", ["mxfp4-q16", "mxfp4-q8", "mxfp4-f32", "int4-q16", "bf16"])
def test_kept_scratch_reused_dirty_equals_fresh(kind):
    """A prompt's MoE call keeps its scratch block (≥ 1 MiB) for the next call instead of faulting
    fresh pages in every time; the next call gets it back dirty. Its result must be the one the same
    call gives on fresh memory, bit for bit, after a call on other inputs and experts filled it;
    kept bytes are counted and release_scratch gives them back."""
    from lynx_edge.quant import cpu_kernels
    from lynx_edge.quant.int4 import quantize_experts

    T, K, E, D, I = 256, 2, 4, 256, 256  # 512 slots: ~2 MB of scratch
    g = torch.Generator().manual_seed(3)
    if kind.startswith("mxfp4"):
        args, _ = _oss_mx_problem(T, K, E, D, I, seed=5)
        act = kind.split("-")[1]
        run = lambda x, ids: native.moe_oss(x, ids, *args[2:], act=act)  # noqa: E731
    elif kind == "int4-q16":
        p = quantize_experts(torch.randn(E, 2 * I, D, generator=g) * 0.1, torch.randn(E, D, I, generator=g) * 0.1, 128, True)
        w = torch.softmax(torch.randn(T, K, generator=g), -1)
        run = lambda x, ids: cpu_kernels.moe_int4_cpu(x, ids, w, p, act="q16")  # noqa: E731
    else:
        gu, dn = (torch.randn(E, 2 * I, D, generator=g) * 0.1).bfloat16(), (torch.randn(E, D, I, generator=g) * 0.1).bfloat16()
        w = torch.softmax(torch.randn(T, K, generator=g), -1)
        run = lambda x, ids: native.moe_dense(x, ids, w, gu, dn)  # noqa: E731
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    other_x = torch.randn(T, D, generator=g) * 50
    other_ids = torch.zeros_like(ids)  # every slot on expert 0: other counts, other slot order
    other_ids[:, 1] = E - 1
    native.release_scratch()
    assert native.scratch_kept() == 0
    fresh = run(x, ids)
    kept = native.scratch_kept()
    assert (1 << 20) <= kept <= (256 << 20)
    run(other_x, other_ids)
    assert native.scratch_kept() == kept  # the same block, reused
    assert torch.equal(run(x, ids), fresh)
    assert native.release_scratch() == kept and native.scratch_kept() == 0


def test_kept_scratch_attention_scores():
    """The decode attention's scores of a long context (5 rows x 16 heads x 4096 positions: 1.3 MB) come
    from the kept scratch too: reused dirty after a call at other positions, the same outputs."""
    g = torch.Generator().manual_seed(9)
    B, H, Hkv, hd, S = 5, 16, 4, 16, 4096
    kv = [torch.randn(B, Hkv, S, hd, generator=g) for _ in range(2)]
    qkv = torch.randn(B, (H + 2 * Hkv) * hd, generator=g)
    cs, sn = torch.rand(B, hd, generator=g), torch.rand(B, hd, generator=g)
    rows, pos = torch.arange(B), torch.full((B,), S - 1)
    call = lambda q, p, c: native.attn_decode(q, H, Hkv, hd, None, None, 0.0, cs, sn, p, rows, *c, None)  # noqa: E731
    native.release_scratch()
    fresh = call(qkv, pos, [c.clone() for c in kv])
    kept = native.scratch_kept()
    assert kept >= B * H * S * 4
    call(qkv * 30, pos - torch.arange(B) * 7, [c.clone() for c in kv])
    assert torch.equal(call(qkv, pos, [c.clone() for c in kv]), fresh)
    assert native.release_scratch() == kept


@pytest.fixture
def amx_tiles():
    """The AMX bf16 tiles on for the test (opt-in: LYNX_EDGE_AMX=1), off after; skips where this
    build or CPU has none."""
    so = native.lib()
    if not hasattr(so, "lynx_amx_enable") or not so.lynx_amx_enable(1):
        pytest.skip("no AMX-BF16 tiles on this CPU / build")
    yield so
    so.lynx_amx_enable(int(os.environ.get("LYNX_EDGE_AMX", "0") == "1"))


# 16-row blocks of 32-input steps (the tiles' shapes: D=72 runs the row kernels), one token to
# 40 on an expert (tiles of 16 tokens and a remainder), fp32 inputs (three bf16 parts) and bf16 ones (one)
@pytest.mark.parametrize("T,K,E,D,I", [(1, 2, 8, 64, 32), (16, 4, 32, 256, 128), (40, 2, 2, 64, 64), (3, 2, 4, 128, 1024),
                                       (23, 3, 4, 72, 40)])
def test_amx_tiles_match_reference_and_are_batch_invariant(amx_tiles, T, K, E, D, I):
    """bf16 experts on AMX tiles against fp32 math on the same values (observed ≤ 7.7e-7 of the
    output scale up to I=8192), a token alone equal to itself in the batch, a wrong weight caught."""
    x, ids, w, gu, dn = _moe_problem(T, K, E, D, I, torch.bfloat16)
    ref = moe_ref_loop(x, ids, w, gu.float(), dn.float())
    for xx in (x, x.bfloat16().float()):
        r = ref if xx is x else moe_ref_loop(xx, ids, w, gu.float(), dn.float())
        y = native.moe_dense(xx, ids, w, gu, dn)
        assert _rel(y, r) < TOL_MOE, _rel(y, r)
        alone = torch.cat([native.moe_dense(xx[t:t + 1], ids[t:t + 1], w[t:t + 1], gu, dn) for t in range(T)])
        assert torch.equal(alone, y)
    bad = dn.clone()
    bad[int(ids[0, 0]), 5, 7] += 0.5
    assert _rel(native.moe_dense(x, ids, w, gu, bad), ref) > 100 * TOL_MOE
    # the three parts of an fp32 input all count: one part alone (x rounded to bf16) is ~2^-9 off
    assert _rel(native.moe_dense(x.bfloat16().float(), ids, w, gu, dn), ref) > 10 * TOL_MOE


# --- bf16 rows on bf16 activations (act "bf16": vdpbf16ps where the build has AVX512-BF16) ----------

dp_only = pytest.mark.skipif(not native.bf16_dp(), reason="this build has no bf16 rows on bf16 inputs (AVX512-BF16)")
TOL_DP = 1e-6  # fp32 sums of exact bf16 x bf16 products, reassociated (seen ~2e-7 of the output scale)


def _bf16_act_ref(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """act "bf16" emulated: x rounded to bf16 (nearest even), then fp64 products and sums."""
    return F.linear(x.to(torch.bfloat16).double(), W.double(), None if b is None else b.double()).float()


@dp_only
@pytest.mark.parametrize("T,Kin,N,bias", [(1, 256, 37, False), (3, 100, 20, True), (4, 48, 33, False), (7, 512, 17, True),
                                          (16, 1000, 24, False), (2, 31, 5, False)])
def test_bf16_act_linear_matches_emulation(T, Kin, N, bias):
    """Every tile shape (1-4 tokens x 1-4 rows, groups of four tokens after), inputs a multiple of 32
    or with a masked tail (100, 48, 1000, 31), against the rounding emulated in fp64; and a token
    alone equals itself in the batch, bit for bit."""
    g = torch.Generator().manual_seed(T + Kin)
    x = torch.randn(T, Kin, generator=g)
    W = (torch.randn(N, Kin, generator=g) / Kin**0.5).bfloat16()
    b = torch.randn(N, generator=g) if bias else None
    ref = _bf16_act_ref(x, W, b)
    y = native.linear(x, W, b, act="bf16")
    assert _rel(y, ref) < TOL_DP, _rel(y, ref)
    assert torch.equal(native.linear(x, W, b, act="bf16-stream"), y)  # rows from DRAM: a prefetch more, the same sums
    assert _rel(native.linear(x, W, b), ref) > 100 * TOL_DP  # the fp32 rows are not what ran
    for t in range(T):
        assert torch.equal(native.linear(x[t:t + 1], W, b, act="bf16"), y[t:t + 1]), t
    W2 = W.clone()  # a weight past the last whole 32-input step
    W2[N - 1, Kin - 1] += 1.0
    assert _rel(native.linear(x, W2, b, act="bf16"), ref) > 100 * TOL_DP
    lin = native.dense_lin(W, b)  # the Lin the layer calls run: fp32 unless asked
    assert lin.act == 0 and native.dense_lin(W, b, "bf16").act == native.ACT_BF16
    assert native.dense_lin(W, b, "bf16-stream").act == native.ACT_BF16S
    assert native.dense_lin(W.float(), b, "bf16").act == 0  # fp32 weights: no rounding


@dp_only
@pytest.mark.parametrize("stream", [True, False])
def test_bf16_act_moe_matches_emulation(stream):
    """The MoE call with act "bf16" on experts read from cache: x rounded once, h = silu(gate)·up in
    fp32 rounded once for the down rows, against that emulated in fp64; tokens alone equal their batch
    (the demo's widths: gate/up rows of 256 inputs, down rows of 100: a masked tail). Streamed experts
    run the fp32 rows on the same rounded inputs."""
    g = torch.Generator().manual_seed(9)
    E, D, I, T, K = 5, 256, 100, 10, 2
    gu = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).bfloat16()
    dn = (torch.randn(E, D, I, generator=g) / I**0.5).bfloat16()
    x = torch.randn(T, D, generator=g)
    ids = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1], [0, 2], [0, 2], [1, 2], [3, 2], [3, 4], [3, 4]])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    ref = torch.zeros(T, D, dtype=torch.float64)
    xb = x.bfloat16().double()
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            gate, up = gu[e, :I].double() @ xb[t], gu[e, I:].double() @ xb[t]
            h = (F.silu(gate) * up).float().bfloat16().double()
            ref[t] += w[t, k].double() * (dn[e].double() @ h)
    full = native.moe_dense(x, ids, w, gu, dn, stream, act="bf16")
    assert _rel(full, ref) < TOL_DP, _rel(full, ref)  # streamed: the fp32 rows on the rounded inputs
    assert _rel(native.moe_dense(x, ids, w, gu, dn, stream), ref) > 100 * TOL_DP
    for t in range(T):
        assert torch.equal(native.moe_dense(x[t:t + 1], ids[t:t + 1], w[t:t + 1], gu, dn, stream, act="bf16"),
                           full[t:t + 1]), t
    assert torch.equal(native.moe_dense(x, ids, w, gu.float(), dn.float(), stream, act="bf16"),
                       native.moe_dense(x, ids, w, gu.float(), dn.float(), stream))  # fp32 experts: exact either way


def test_bf16_act_default_follows_the_build(monkeypatch):
    """No name, no environment: bf16 where the build has the rows and they measured faster (AMD
    AVX512-BF16, a model that stays in the last-level cache), else f32; the environment's value
    wins; a bad value is a one-line ConfigError."""
    from lynx_edge.build import bf16_act
    from lynx_edge.config import ConfigError

    monkeypatch.setattr(native, "BF16_ACT", None)
    pays = bool(native.lib().lynx_bf16_pays())
    assert native.default_bf16_act() == ("bf16" if pays else "f32")
    monkeypatch.setattr(native, "llc_bytes", lambda: 32 << 20)
    assert native.default_bf16_act(30 << 20) == ("bf16" if pays else "f32")  # stays in the cache
    assert native.default_bf16_act(40 << 20) == "f32"  # streams from DRAM: measured no faster there
    assert not pays or native.bf16_dp()
    monkeypatch.setattr(native, "BF16_ACT", "f32")
    assert bf16_act(None) == "f32" and bf16_act("bf16") == "bf16"
    with pytest.raises(ConfigError, match="bf16 activations 'q8' not supported"):
        bf16_act("q8")
