"""Triton MoE GEMM kernels (kernels/moe_gemm.py) against the torch references moe_ref and
int4_moe_ref.

Kernel tests named test_interp_* run only under TRITON_INTERPRET=1, which must be set before
triton is imported: test_interpreter_suite re-runs this file in a subprocess with it set, so
the main pytest process stays uninterpreted. test_aot_compile_* compile the launches the runtime
would make for sm_80/sm_90 without a GPU (compile errors, register spills). GPU tests (-m gpu)
compare bf16 on CUDA and check CUDA-graph capture (no host sync in the launch path).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import gpu_only, run_interpreter_suite

from lynx_edge.kernels import moe_gemm
from lynx_edge.kernels.moe_gemm import expert_table, fused_moe, fused_moe_int4, moe_ref, moe_ref_lazy
from lynx_edge.quant.int4 import dequantize_experts, int4_moe_ref, quantize_experts

ROOT = Path(__file__).resolve().parents[1]
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERP or moe_gemm.triton is None,
                            reason="runs in the TRITON_INTERPRET=1 subprocess of test_interpreter_suite")


def _problem(T, K, E, D, I, dtype, seed=0, device="cpu", ids=None):
    """x [T, D] ~ N(0, 1), weights scaled by 1/√fan-in (outputs O(1), fp16-safe), ids [T, K]
    distinct per token unless given, softmax routing weights [T, K]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    gu = torch.randn(E, 2 * I, D, generator=g) / D**0.5
    dn = torch.randn(E, D, I, generator=g) / I**0.5
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), ids.to(device), w.to(device), to(gu), to(dn)


# (max error / output scale, mean relative error) allowed, ~3 × the largest observed under the
# interpreter over this file's cases: fp32 5.4e-7 / 3.2e-7, fp16 1.0e-3 / 5.7e-4. bf16 runs only
# on CUDA: fp16's bounds × 8 (3 mantissa bits fewer; the reference rounds h and silu to bf16 too).
TOL = {torch.float32: (2e-6, 1e-6), torch.float16: (3e-3, 2e-3), torch.bfloat16: (2.4e-2, 1.6e-2)}


def _err(y, ref) -> tuple[float, float]:
    """(max |y − ref| / max(1, max |ref|), mean |y − ref| / mean |ref|)."""
    d, ref = (y.float() - ref.float()).abs(), ref.float()
    return d.max().item() / max(1.0, ref.abs().max().item()), (d.mean() / ref.abs().mean()).item()


def _close(y, ref, dtype):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    max_rel, mean_rel = _err(y, ref)
    assert max_rel < TOL[dtype][0] and mean_rel < TOL[dtype][1], (dtype, max_rel, mean_rel)


# ------------------------------------------------------------ main process: tables and fallbacks


@pytest.mark.parametrize("T,K,E", [(1, 1, 4), (3, 2, 8), (17, 4, 16), (8, 2, 64)])
def test_expert_table_matches_bruteforce(T, K, E):
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    tab = expert_table(ids, E)
    A = min(T * K, E)
    active = sorted(set(ids.flatten().tolist()))
    n = tab["num_act"].item()
    assert n == len(active) and tab["act_e"].shape == (A,) and tab["act_start"].shape == (A + 1,)
    assert tab["act_e"][:n].tolist() == active
    assert bool((tab["act_start"][n:] == T * K).all())  # padding: empty ranges
    for i, e in enumerate(active):
        lo, hi = tab["act_start"][i].item(), tab["act_start"][i + 1].item()
        slots = tab["slot"][lo:hi].tolist()
        assert slots == sorted(slots) and all(ids.flatten()[s].item() == e for s in slots)
        assert tab["tok"][lo:hi].tolist() == [s // K for s in slots]
    assert sorted(tab["slot"].tolist()) == list(range(T * K))


@pytest.mark.skipif(INTERP, reason="checks the torch fallback")
def test_cpu_dispatch_is_the_reference():
    x, ids, w, gu, dn = _problem(5, 2, 8, 64, 32, torch.float32)
    assert not moe_gemm.use_triton(x)
    assert torch.equal(fused_moe(x, ids, w, gu, dn), moe_ref(x, ids, w, gu, dn))
    p = quantize_experts(gu, dn, 32, sym=False)
    assert torch.equal(fused_moe_int4(x, ids, w, p), int4_moe_ref(x, ids, w, p))
    slots = torch.tensor([3, 1, 7, 0, 2, 6, 4, 5])  # expert → slot row
    gu_s, dn_s = torch.empty_like(gu), torch.empty_like(dn)
    gu_s[slots], dn_s[slots] = gu, dn
    assert torch.equal(fused_moe(x, ids, w, gu_s, dn_s, expert_slots=slots), moe_ref(x, ids, w, gu, dn))


def _perm_problem(T, K, E, D, I, dtype, group, seed=0):
    """INT4 experts quantised in a permuted column order (act-order) + x_perm [E, D] int32 and
    the explicit reference Σ_k w·expert_e(x[t, perm[e]]) on the dequantised experts."""
    from lynx_edge.kernels.moe_gemm import expert_mlp

    x, ids, w, gu, dn = _problem(T, K, E, D, I, torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(E)]).int()
    p = quantize_experts(gu, dn, group, sym=False)
    gq, dq = dequantize_experts(p, torch.float32)
    ref = torch.zeros(T, D)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            ref[t] += w[t, k] * expert_mlp(x[t, perm[e].long()][None], gq[e], dq[e])[0]
    return x.to(dtype), ids, w, p, perm, ref.to(dtype)


@pytest.mark.skipif(INTERP, reason="checks the torch path")
def test_x_perm_torch_path():
    """fused_moe_int4(x_perm=…) on CPU: expert e's gate-up reads x[:, perm[e]]."""
    x, ids, w, p, perm, ref = _perm_problem(5, 2, 4, 64, 32, torch.float32, 32)
    _close(fused_moe_int4(x, ids, w, p, x_perm=perm), ref, torch.float32)
    assert _err(fused_moe_int4(x, ids, w, p), ref)[0] > 1e-2  # the permutation matters


def test_moe_ref_lazy_equals_moe_ref():
    x, ids, w, gu, dn = _problem(9, 2, 8, 32, 16, torch.float32)
    assert torch.equal(moe_ref_lazy(x, ids, w, 8, lambda e: (gu[e], dn[e])), moe_ref(x, ids, w, gu, dn))


@pytest.mark.skipif(INTERP, reason="this is the launcher")
def test_interpreter_suite():
    """Run the test_interp_* cases in a fresh process with TRITON_INTERPRET=1."""
    if moe_gemm.triton is None:
        pytest.skip("triton not installed")
    run_interpreter_suite(__file__, 15)


# ------------------------------------------------------------ TRITON_INTERPRET=1 subprocess

DENSE = [  # T, K, E, D, I, dtype — T ≤ 4 runs the GEMV path, larger T tl.dot
    (1, 2, 8, 64, 128, torch.float32),
    (3, 2, 8, 64, 128, torch.float16),
    (8, 4, 16, 64, 64, torch.float16),
    (17, 1, 4, 128, 64, torch.float32),
    (17, 2, 16, 64, 64, torch.float16),
]


@interp
@pytest.mark.parametrize("T,K,E,D,I,dtype", DENSE)
def test_interp_dense(T, K, E, D, I, dtype):
    x, ids, w, gu, dn = _problem(T, K, E, D, I, dtype, seed=T)
    _close(fused_moe(x, ids, w, gu, dn), moe_ref(x, ids, w, gu, dn), dtype)


@interp
def test_interp_empty_and_hot_experts():
    """Experts 1 and 5 get no token; expert 2 takes every token (its slot k varies)."""
    T, K, E = 17, 2, 8
    ids = torch.stack([torch.tensor([2, [0, 3, 4, 6, 7][t % 5]])[torch.randperm(2)] for t in range(T)])
    x, ids, w, gu, dn = _problem(T, K, E, 64, 64, torch.float16, ids=ids)
    _close(fused_moe(x, ids, w, gu, dn), moe_ref(x, ids, w, gu, dn), torch.float16)
    one = torch.full((3, 1), 5)  # GEMV path, one active expert out of 8
    x, one, w, gu, dn = _problem(3, 1, E, 64, 64, torch.float32, ids=one)
    _close(fused_moe(x, one, w, gu, dn), moe_ref(x, one, w, gu, dn), torch.float32)


@interp
def test_interp_split_k_slots_and_table():
    x, ids, w, gu, dn = _problem(8, 2, 8, 64, 128, torch.float32, seed=3)
    ref = moe_ref(x, ids, w, gu, dn)
    _close(fused_moe(x, ids, w, gu, dn, split_k=4), ref, torch.float32)
    slots = torch.tensor([5, 0, 7, 1, 6, 2, 4, 3])
    gu_s, dn_s = torch.empty_like(gu), torch.empty_like(dn)
    gu_s[slots], dn_s[slots] = gu, dn
    _close(fused_moe(x, ids, w, gu_s, dn_s, expert_slots=slots), ref, torch.float32)
    # a table made elsewhere (the routing kernel): slots past num_act may hold -1
    tab = expert_table(ids, 8)
    tab["act_e"] = torch.where(torch.arange(tab["act_e"].numel()) < tab["num_act"], tab["act_e"], -1).int()
    _close(fused_moe(x, ids, w, gu, dn, table=tab), ref, torch.float32)


INT4 = [  # T, K, E, D, I, dtype, group, sym
    (1, 2, 8, 64, 64, torch.float16, 32, False),
    (3, 2, 8, 128, 128, torch.float32, 64, True),
    (8, 4, 16, 64, 64, torch.float16, 32, True),
    (17, 4, 16, 128, 128, torch.float16, 128, False),
]


@interp
@pytest.mark.parametrize("T,K,E,D,I,dtype,group,sym", INT4)
def test_interp_int4(T, K, E, D, I, dtype, group, sym):
    x, ids, w, gu, dn = _problem(T, K, E, D, I, torch.float32, seed=T)
    p = quantize_experts(gu, dn, group, sym)
    x = x.to(dtype)
    _close(fused_moe_int4(x, ids, w, p), int4_moe_ref(x, ids, w, p), dtype)


@interp
@pytest.mark.parametrize("T,dtype", [(3, torch.float32), (17, torch.float16)])
def test_interp_int4_x_perm(T, dtype):
    """Act-order INT4 (x_perm) in the Triton gate-up kernel: GEMV (T=3) and tl.dot (T=17)."""
    x, ids, w, p, perm, ref = _perm_problem(T, 2, 8, 64, 64, dtype, 32, seed=T)
    _close(fused_moe_int4(x, ids, w, p, x_perm=perm), ref, dtype)


@interp
def test_interp_comparison_catches_bugs():
    """Bug injection against a correct kernel output: a reference with one expert's weights
    perturbed by 1%, or with two expert ids of one token swapped, must fail _close."""
    T, K, E, D, I = 8, 2, 8, 64, 64
    for dtype in (torch.float32, torch.float16):
        x, ids, w, gu, dn = _problem(T, K, E, D, I, dtype, seed=2)
        y = fused_moe(x, ids, w, gu, dn)
        _close(y, moe_ref(x, ids, w, gu, dn), dtype)
        gu_bad = gu.clone()
        gu_bad[ids[0, 0]] *= 1.01
        swapped = ids.clone()
        swapped[1] = swapped[1].flip(0)
        for bad in (moe_ref(x, ids, w, gu_bad, dn), moe_ref(x, swapped, w, gu, dn)):
            with pytest.raises(AssertionError):
                _close(y, bad, dtype)


@interp
def test_interp_int4_hot_expert_split_k():
    T, K, E = 17, 2, 8
    ids = torch.stack([torch.tensor([4, t % 4]) for t in range(T)])
    x, ids, w, gu, dn = _problem(T, K, E, 64, 128, torch.float32, ids=ids)
    p = quantize_experts(gu, dn, 32, sym=False)
    _close(fused_moe_int4(x, ids, w, p, split_k=2), int4_moe_ref(x, ids, w, p), torch.float32)


@interp
def test_interp_int4_gptqmodel_fixture():
    """The experts gptqmodel quantised (tests/fixtures/gptq_tiny) through the INT4 kernels."""
    from lynx_edge.quant.formats import read_gptq_experts

    p = read_gptq_experts(ROOT / "tests" / "fixtures" / "gptq_tiny", 0)
    x, ids, w, _, _ = _problem(5, 2, 4, 64, 64, torch.float16, seed=11)
    gu, dn = dequantize_experts(p, torch.float16)
    _close(fused_moe_int4(x, ids, w, p), moe_ref(x, ids, w, gu, dn), torch.float16)


# ------------------------------------------------------------ ahead-of-time compile for sm_80/sm_90

MIXTRAL, QWEN3 = (4096, 14336, 8, 2), (2048, 768, 128, 8)  # D, I, E, K


SMEM = {80: 163 << 10, 89: 99 << 10, 90: 227 << 10}  # max dynamic shared memory per block


def _aot_compile(launches, arch: int) -> list[int]:
    """Compile plan_launches' kernels for a CUDA target without a GPU, specialised as the runtime
    JIT would (tests/kernel_aot.py); → stack bytes per kernel (> 0 means spills). Also checks that
    shared memory fits the arch (A100 / RTX 4090 / H100-H200)."""
    from kernel_aot import aot_compile

    stacks = []
    for kernel, _grid, args, meta in launches:
        stack, shared = aot_compile(kernel, args, meta, arch, num_warps=4)
        assert shared <= SMEM[arch], (kernel, meta, shared)
        stacks.append(stack)
    return stacks


def _aot_case(shape, T, int4, arch=90):
    from lynx_edge.quant.int4 import Int4Experts, Int4Layout

    D, I, E, K = shape
    meta = lambda *sh, dt=torch.bfloat16: torch.empty(*sh, dtype=dt, device="meta")  # noqa: E731
    x, ids, w = meta(T, D), meta(T, K, dt=torch.int64), meta(T, K, dt=torch.float32)
    if int4:
        p = Int4Experts.empty(E, Int4Layout(D, I, 128, sym=False), device="meta")
        gu, dn, group = (p.gu_q, p.gu_s, p.gu_z), (p.dn_q, p.dn_s, p.dn_z), 128
    else:
        gu, dn, group = (meta(E, 2 * I, D),) * 3, (meta(E, D, I),) * 3, None
    launches, _ = moe_gemm.plan_launches(x, ids, w, E, D, I, gu, dn, group, False, sms=132)
    return _aot_compile(launches, arch)


def _need_aot():
    from kernel_aot import have_ptxas

    if INTERP or moe_gemm.triton is None:
        pytest.skip("needs compiled (non-interpreted) triton")
    if not have_ptxas():
        pytest.skip("triton's bundled ptxas is missing")


def test_aot_compile_sm90_decode():
    """The INT4 and bf16 kernels the H200 would run at decode (GEMV, T=1) and T=16 (tl.dot)
    compile for sm_90 with the shipped block sizes and spill no registers."""
    _need_aot()
    for T, int4 in ((1, True), (16, True), (1, False)):
        assert _aot_case(QWEN3, T, int4) == [0, 0, 0], (T, int4)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 89, 90])
@pytest.mark.parametrize("shape", [MIXTRAL, QWEN3], ids=["mixtral", "qwen3"])
def test_aot_compile_all_configs(arch, shape):
    _need_aot()
    for T in (1, 4, 8, 16, 64):
        for int4 in (False, True):
            assert max(_aot_case(shape, T, int4, arch)) == 0, (T, int4)


# ------------------------------------------------------------ CUDA (-m gpu)


# Each case is ~6 JIT compiles (3 kernels × dense/INT4): the matrix is kept small for the lease.
@gpu_only
@pytest.mark.parametrize("T,D,I,E,K", [(1, 512, 1024, 8, 2), (16, 256, 128, 64, 8)])
def test_gpu_bf16_dense_and_int4(T, D, I, E, K, capsys):
    x, ids, w, gu, dn = _problem(T, K, E, D, I, torch.float32, seed=T)
    p = quantize_experts(gu, dn, 128, sym=False).to("cuda")
    x, ids, w = x.cuda().bfloat16(), ids.cuda(), w.cuda()
    gu, dn = gu.cuda().bfloat16(), dn.cuda().bfloat16()
    y, y4 = fused_moe(x, ids, w, gu, dn), fused_moe_int4(x, ids, w, p)
    ref, ref4 = moe_ref(x, ids, w, gu, dn), int4_moe_ref(x, ids, w, p)
    with capsys.disabled():  # the observed errors, to re-derive TOL[bfloat16] from
        print(f"\nbf16 T={T} E={E}: dense err {_err(y, ref)}, int4 err {_err(y4, ref4)}")
    _close(y, ref, torch.bfloat16)
    _close(y4, ref4, torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("int4", [False, True])
def test_gpu_cuda_graph_capture(int4):
    """No host sync in the launch path: the MoE call captures into a CUDA graph (capture fails
    on a sync) and replays correctly after the routing changes in place."""
    T, K, E, D, I = 4, 2, 16, 256, 256
    x, ids, w, gu, dn = _problem(T, K, E, D, I, torch.float32)
    p = quantize_experts(gu, dn, 64, sym=True).to("cuda")
    x, ids, w = x.cuda().bfloat16(), ids.cuda(), w.cuda()
    gu, dn = gu.cuda().bfloat16(), dn.cuda().bfloat16()
    run = (lambda: fused_moe_int4(x, ids, w, p)) if int4 else (lambda: fused_moe(x, ids, w, gu, dn))
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    ids.copy_(torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda())
    graph.replay()
    ref = int4_moe_ref(x, ids, w, p) if int4 else moe_ref(x, ids, w, gu, dn)
    _close(out, ref, torch.bfloat16)
