"""Fused router + LYNX kernel (kernels/lynx_route.py) against the torch reference lynx_select
(lynx.lynx_route_ref), and LynxRouter's choice between them (lynx.py).

test_interp_* run only under TRITON_INTERPRET=1 (set before triton is imported):
test_interpreter_suite re-runs this file in a subprocess with it set. The main process checks the
reference's output format, the glue, the CPU dispatch and sm_90 ahead-of-time compiles
specialised as the JIT would (an int argument equal to 1 becomes a constexpr); -m gpu checks
CUDA results, CUDA-graph capture and reports the per-layer time. Glossary: T tokens, E experts,
K top-k.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import gpu_only, run_interpreter_suite

from lynx_edge.kernels import lynx_route as lr
from lynx_edge.kernels.lynx_route import gemm_table
from lynx_edge.kernels.moe_gemm import expert_table
from lynx_edge.lynx import LynxConfig, LynxRouter, kernel_args, lynx_route_ref, lynx_select
from lynx_edge.routing import RouterSpec, exact_route

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERP or lr.triton is None,
                            reason="runs in the TRITON_INTERPRET=1 subprocess of test_interpreter_suite")
# Weights: the kernel's exp/sum differ from torch's softmax by a few fp32 ulps of values ≤ 1; the
# largest |Δw| measured over this file's interpreter cases was 1.2e-7 (3 × → 4e-7).
W_ATOL = 4e-7


def _logits(T: int, E: int, K: int, seed: int, device="cpu") -> torch.Tensor:
    """Random router logits [T, E]; every third row ×4 (a clear-cut router)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, E, generator=g) * 1.5
    z[::3] *= 4
    return z.to(device)


def _mixed(T: int, device="cpu") -> torch.Tensor:
    """Decode mask with prefill tokens at 1, 5, 9, … (all decode when T = 1)."""
    return (torch.arange(T) % 4 != 1).to(device)


def _route(z, isd, spec, mode="lynx", layer=0):
    """The kernel, through the glue (what LynxRouter launches)."""
    return lr.lynx_route(z, isd, **kernel_args(spec, LynxConfig.parse(mode), layer))


def _check_table(ids, active, counts, table, E):
    """active/counts/token_table describe ids [T, K] exactly (brute force)."""
    T, K = ids.shape
    A, flat = min(T * K, E), ids.reshape(-1).tolist()
    used = sorted(set(flat))
    n = counts[0].item()
    assert active.shape == (A,) and counts.shape == (A + 2,) and table.shape == (T * K,)
    assert active.dtype == counts.dtype == table.dtype == torch.int32
    assert n == len(used) and active[:n].tolist() == used and bool((active[n:] == -1).all())
    starts = counts[1:].tolist()
    assert starts[n:] == [T * K] * (A + 1 - n) and starts[0] == 0
    for i, e in enumerate(used):
        rows = table[starts[i]:starts[i + 1]].tolist()
        assert rows == sorted(s for s in range(T * K) if flat[s] == e), e


def _assert_same(out, ref, E):
    """Same ids, active list and table; weights within W_ATOL; stats: counts exact, displaced
    mass within a few ulps of the batch's sum."""
    ids, w, active, counts, table, stats = out
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and stats.dtype == torch.float64
    assert torch.equal(ids, ref[0]), (ids, ref[0])
    torch.testing.assert_close(w, ref[1], atol=W_ATOL, rtol=0)
    for a, b in zip(out[2:5], ref[2:5]):
        assert torch.equal(a.cpu(), b.cpu())
    assert torch.equal(stats[:6].cpu(), ref[5][:6].cpu()), (stats, ref[5])
    torch.testing.assert_close(stats[6].cpu(), ref[5][6].cpu(), atol=1e-6, rtol=0)
    _check_table(ids.cpu(), active.cpu(), counts.cpu(), table.cpu(), E)


# ------------------------------------------------------------ main process


@pytest.mark.parametrize("mode", ["off", "lynx"])
def test_reference_format(mode):
    """lynx_route_ref = lynx_select's ids/weights/stats + a table consistent with them, and
    gemm_table() is exactly moe_gemm.expert_table (the GEMM's input) up to act_e padding."""
    T, E, K = 9, 16, 4
    z, isd = _logits(T, E, K, 1), _mixed(T)
    spec = RouterSpec(E, K, True)
    out = lynx_route_ref(z, isd, spec, mode)
    r = lynx_select(z, isd, spec, LynxConfig.parse(mode))
    assert torch.equal(out[0], r.ids) and torch.equal(out[1], r.weights) and torch.equal(out[5], r.vec)
    _check_table(out[0], out[2], out[3], out[4], E)
    got, want = gemm_table(*out[2:5], K), expert_table(out[0], E)
    n = want["num_act"].item()
    assert torch.equal(got["act_e"][:n], want["act_e"][:n])
    for key in ("tok", "slot", "act_start", "num_act"):
        assert torch.equal(got[key], want[key]), key


def test_kernel_args_glue():
    """RouterSpec + LynxConfig → the kernel's plain scalars."""
    spec = RouterSpec(64, 8, False)
    a = kernel_args(spec, LynxConfig.parse("lynx,j=2,beta=3,protect_top1=false,min_batch=4"))
    assert a == dict(top_k=8, norm=False, mode=lr.LYNX, alpha=pytest.approx(3 / math.log(8)), beta=3,
                     j=2, tau=1.0, m=0, protect=False, min_batch=4)
    assert kernel_args(spec, LynxConfig.parse("budget:100"))["m"] == 64  # capped at E
    assert kernel_args(spec, LynxConfig.parse("lynx-mass:0.3"))["tau"] == 0.3
    assert kernel_args(spec, LynxConfig.parse("lynx,skip_layers=2"), layer=2)["mode"] == lr.OFF
    assert kernel_args(RouterSpec(8, 8, True), LynxConfig.parse("lynx"))["mode"] == lr.OFF  # E ≤ K


@pytest.mark.skipif(INTERP, reason="checks the torch fallback")
def test_router_on_cpu_is_the_reference():
    """Without CUDA (and without the interpreter) LynxRouter decides once to use lynx_select."""
    z, isd, spec = _logits(5, 8, 2, 2), torch.ones(5, dtype=torch.bool), RouterSpec(8, 2, False)
    router = LynxRouter(spec, "lynx", device="cpu")
    assert router.use_triton is False and not lr.available("cpu")
    router.begin_step(True)
    ids, w = router(z, isd, 0)
    r = lynx_select(z, isd, spec, LynxConfig("lynx"))
    assert torch.equal(ids, r.ids) and router.last.table is None
    # with the native kernels the softmax is lynx_route's own (tests/test_native_route.py): a few ulp
    torch.testing.assert_close(w, r.weights, rtol=6e-7, atol=0)


def test_kernel_size_limits():
    """Shapes the one-program kernel takes; others go to the torch reference."""
    assert lr.fits(64, 256, 8, lr.LYNX) and lr.fits(1, 8, 8, lr.LYNX)
    assert not lr.fits(65, 64, 8, lr.LYNX)  # T > 64
    assert not lr.fits(8, 512, 8, lr.LYNX)  # E > 256
    assert not lr.fits(8, 64, 17, lr.LYNX)  # K > 16
    assert not lr.fits(0, 64, 8, lr.LYNX)  # no tokens
    assert not lr.fits(64, 64, 8, lr.LYNX, beta=10)  # 64^11 > 2^62
    assert lr.fits(64, 64, 8, lr.OFF, beta=10)
    with pytest.raises(ValueError, match="outside the kernel's limits"):
        lr.lynx_route(torch.zeros(65, 8), torch.ones(65, dtype=torch.bool), 2, norm=True)


@pytest.mark.skipif(INTERP, reason="this is the launcher")
def test_interpreter_suite():
    """Run the test_interp_* cases in a fresh process with TRITON_INTERPRET=1."""
    if lr.triton is None:
        pytest.skip("triton not installed")
    run_interpreter_suite(__file__, 18)


# ------------------------------------------------------------ ahead-of-time compile (no GPU)


def _aot(T, E, K, mode, arch=90):
    """(stack bytes, JIT-specialised int constexprs) of plan_route's launch for sm_<arch>."""
    from kernel_aot import aot_compile, specialised_constexprs

    z = torch.empty(T, E, device="meta")
    isd = torch.empty(T, dtype=torch.bool, device="meta")
    p = lr.plan_route(z, isd, **kernel_args(RouterSpec(E, K, True), LynxConfig.parse(mode)))
    stack, _ = aot_compile(p.kernel, p.args, p.meta, arch, p.num_warps)
    return stack, specialised_constexprs(p.kernel, p.args, p.meta)


def _need_aot():
    from kernel_aot import have_ptxas

    if INTERP or lr.triton is None:
        pytest.skip("needs compiled (non-interpreted) triton")
    if not have_ptxas():
        pytest.skip("triton's bundled ptxas is missing")


def test_aot_compile_sm90_decode():
    """The kernel compiles for sm_90 at a Qwen3-30B-A3B decode step (T=16, E=128, K=8) with
    LYNX, and spills no registers."""
    _need_aot()
    assert _aot(16, 128, 8, "lynx")[0] == 0


def test_aot_compile_beta_one():
    """beta = 1 and T = 1: the JIT passes ints equal to 1 as constexprs (they once broke the
    kernel: `beta.to(...)` on a Python int); the AOT compile specialises them the same way."""
    _need_aot()
    stack, consts = _aot(1, 16, 4, "lynx,beta=1")
    assert consts == {"T": 1, "beta": 1} and stack == 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_aot_compile_all_modes(arch):
    """Every mode compiles; no spills up to T·E = 4096 (bigger tiles spill a little)."""
    _need_aot()
    for T, E, K in ((1, 8, 2), (16, 64, 8), (16, 256, 8), (32, 128, 8)):
        for mode in ("off", "lynx", "budget:8", "lynx-mass:0.2", "lynx,beta=8", "budget:1",
                     "lynx,beta=3,j=2"):
            assert _aot(T, E, K, mode, arch)[0] == 0, (T, E, K, mode)
    _aot(64, 256, 8, "lynx", arch)  # the largest supported tile still compiles


# ------------------------------------------------------------ TRITON_INTERPRET=1 subprocess

SHAPES = [  # T, E, K, norm_topk_prob
    (1, 8, 2, True),
    (3, 16, 4, False),
    (8, 64, 8, True),
    (16, 32, 2, False),
    (16, 64, 4, True),
    (8, 8, 1, False),
]


@interp
@pytest.mark.parametrize("T,E,K,norm", SHAPES)
def test_interp_matches_reference(T, E, K, norm):
    """Modes off and lynx, all-decode and mixed prefill/decode: same ids as lynx_select,
    weights within W_ATOL, same active list, token table and stats."""
    z, spec = _logits(T, E, K, seed=T * E + K), RouterSpec(E, K, norm)
    for isd in (torch.ones(T, dtype=torch.bool), _mixed(T)):
        for mode in ("off", "lynx"):
            _assert_same(_route(z, isd, spec, mode), lynx_route_ref(z, isd, spec, mode), E)
    if T >= 8 and K > 1:  # the case is a real test of the remap
        isd = torch.ones(T, dtype=torch.bool)
        lynx_ids, exact_ids = (lynx_route_ref(z, isd, spec, m)[0] for m in ("lynx", "off"))
        assert not torch.equal(lynx_ids, exact_ids)


@interp
@pytest.mark.parametrize("mode", ["budget:5", "lynx-mass:0.3", "lynx,j=2,protect_top1=false",
                                  "lynx,min_batch=4,alpha=1.5", "lynx,beta=8,j=3", "lynx-mass:1",
                                  "lynx,beta=1", "budget:1", "lynx,beta=3,j=2"])
def test_interp_other_modes_and_knobs(mode):
    """budget:m, lynx-mass:τ and knobs (int64 scores at beta=8 with T=16; ints equal to 1)."""
    T, E, K = 16, 64, 4
    z, spec = _logits(T, E, K, seed=7), RouterSpec(E, K, False)
    for isd in (torch.ones(T, dtype=torch.bool), _mixed(T)):
        _assert_same(_route(z, isd, spec, mode), lynx_route_ref(z, isd, spec, mode), E)


@interp
def test_interp_small_batches_skipped_layers_and_strides():
    """B < 2 and skip_layers stay exact; a row-strided view of bigger logits works."""
    T, E, K = 4, 16, 2
    big = _logits(T, 2 * E, K, seed=3)
    z, spec = big[:, :E], RouterSpec(E, K, True)
    one = torch.tensor([False, True, False, False])
    _assert_same(_route(z, one, spec, "lynx"), lynx_route_ref(z, one, spec, "off"), E)
    isd = torch.ones(T, dtype=torch.bool)
    cfg = "lynx,skip_layers=2"
    _assert_same(_route(z, isd, spec, cfg, layer=2), lynx_route_ref(z, isd, spec, "off"), E)
    _assert_same(_route(z, isd, spec, "lynx"), lynx_route_ref(z, isd, spec, "lynx"), E)


@interp
@pytest.mark.parametrize("mode", ["off", "lynx", "budget:5", "lynx-mass:0.5"])
def test_interp_ties_one_rule(mode):
    """Exact ties everywhere (integer logits): top-k and remap targets follow routing.py's rule
    (equal logits → lower id), the same as exact_route and lynx_select."""
    T, E, K = 16, 16, 4
    z = torch.randint(-2, 3, (T, E), generator=torch.Generator().manual_seed(1)).float()
    z[0] = 0.0
    spec = RouterSpec(E, K, True)
    isd = torch.ones(T, dtype=torch.bool)
    out = _route(z, isd, spec, mode)
    _assert_same(out, lynx_route_ref(z, isd, spec, mode), E)
    exact = _route(z, ~isd, spec, mode)[0]  # all prefill: exact routing
    assert torch.equal(exact, exact_route(z, spec)[0])
    assert torch.equal(exact, torch.sort(z, dim=1, descending=True, stable=True).indices[:, :K])
    assert torch.equal(exact[0], torch.arange(K))


@interp
@pytest.mark.parametrize("mode", ["off", "lynx", "budget:3"])
def test_interp_masked_rows_get_distinct_ids(mode):
    """Rows with fewer than K finite logits (−inf masked): K distinct ids, the lowest −inf ones
    after the finite ones, as the reference; a remap never picks an id twice either."""
    T, E, K = 8, 16, 4
    z = _logits(T, E, K, seed=4)
    z[0, 2:] = -math.inf  # 2 finite
    z[1, :] = -math.inf
    z[1, 9] = 1.0  # 1 finite
    z[2, ::2] = -math.inf  # 8 finite
    spec = RouterSpec(E, K, False)
    for isd in (torch.ones(T, dtype=torch.bool), _mixed(T)):
        out = _route(z, isd, spec, mode)
        _assert_same(out, lynx_route_ref(z, isd, spec, mode), E)
        assert all(len(set(row)) == K for row in out[0].tolist())
    first = z[0, :2].argsort(descending=True).tolist()  # row 0's two finite experts, by logit
    assert _route(z, ~isd, spec, mode)[0][:2].tolist() == [first + [2, 3], [9, 0, 1, 2]]


@interp
def test_interp_comparison_catches_bugs():
    """The comparison is tight enough to fail on a swapped expert id or a weight off by 3 ×
    W_ATOL (bug injection on a correct kernel output)."""
    T, E, K = 8, 64, 8
    z, spec, isd = _logits(T, E, K, seed=9), RouterSpec(E, K, True), torch.ones(T, dtype=torch.bool)
    out, ref = _route(z, isd, spec, "lynx"), lynx_route_ref(z, isd, spec, "lynx")
    _assert_same(out, ref, E)
    swapped = out[0].clone()
    swapped[3, [0, 1]] = swapped[3, [1, 0]]
    with pytest.raises(AssertionError):
        _assert_same((swapped, *out[1:]), ref, E)
    w = out[1].clone()
    w[2, 1] += 3 * W_ATOL
    with pytest.raises(AssertionError):
        _assert_same((out[0], w, *out[2:]), ref, E)


@interp
def test_interp_router_runs_the_kernel():
    """LynxRouter chooses the kernel once (use_triton) and passes its GEMM table along; shapes
    past the kernel's limits and prefill forwards go to lynx_select, with the same results."""
    T, E, K = 16, 32, 4
    spec = RouterSpec(E, K, True)
    router = LynxRouter(spec, "lynx", device="cpu")
    assert router.use_triton
    for phase, rows in ((True, T), (True, 70), (False, T)):
        z, isd = _logits(rows, E, K, seed=rows), torch.full((rows,), phase)
        router.begin_step(phase)
        ids, w = router(z, isd, 0)
        r = lynx_select(z, isd, spec, LynxConfig("lynx"))
        assert torch.equal(ids, r.ids) and (router.last.table is not None) == (phase and rows <= 64)
        torch.testing.assert_close(w, r.weights, atol=W_ATOL, rtol=0)
    assert router.telemetry.summary()["decode_layer_steps"] == 2


@interp
def test_interp_gemm_consumes_the_table():
    """fused_moe with table=gemm_table(lynx_route(...)) equals moe_ref on the LYNX ids."""
    from lynx_edge.kernels.moe_gemm import fused_moe, moe_ref

    T, E, K, D, I = 8, 16, 2, 64, 64
    z, spec = _logits(T, E, K, seed=5), RouterSpec(E, K, True)
    ids, w, active, counts, table, _ = _route(z, torch.ones(T, dtype=torch.bool), spec, "lynx")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g)
    gu, dn = torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5
    y = fused_moe(x, ids, w, gu, dn, table=gemm_table(active, counts, table, K))
    torch.testing.assert_close(y, moe_ref(x, ids, w, gu, dn), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------ CUDA (-m gpu)
# Each (shape, mode, norm) is one JIT compile (~5 s): the matrix is kept small for the device lease.


@gpu_only
@pytest.mark.parametrize("T,E,K,mode,norm", [
    (1, 8, 2, "off", True), (16, 128, 8, "lynx", True), (16, 128, 8, "budget:8", False),
    (16, 128, 8, "lynx-mass:0.2,j=0", True), (64, 256, 8, "lynx", False), (33, 160, 6, "lynx-mass:0.3", False),
])
def test_gpu_matches_reference(T, E, K, mode, norm):
    z, spec = _logits(T, E, K, 0, "cuda"), RouterSpec(E, K, norm)
    for isd in (torch.ones(T, dtype=torch.bool, device="cuda"), _mixed(T, "cuda")):
        _assert_same(_route(z, isd, spec, mode), lynx_route_ref(z, isd, spec, mode), E)


@gpu_only
def test_gpu_cuda_graph_capture():
    """No host sync in the launch path: lynx_route captures into a CUDA graph and replays
    correctly after the logits and the decode mask change in place."""
    T, E, K = 16, 128, 8
    spec = RouterSpec(E, K, True)
    z, isd = _logits(T, E, K, 0, "cuda"), torch.ones(T, dtype=torch.bool, device="cuda")
    _route(z, isd, spec, "lynx")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _route(z, isd, spec, "lynx")
    z.copy_(_logits(T, E, K, 1, "cuda"))
    isd.copy_(_mixed(T, "cuda"))
    graph.replay()
    _assert_same(out, lynx_route_ref(z, isd, spec, "lynx"), E)


@gpu_only
def test_gpu_bench_route(capsys):
    with capsys.disabled():
        for T, E, K in ((1, 64, 8), (16, 128, 8), (64, 256, 8)):
            print(f"\nlynx_route T={T} E={E} K={K}: {lr.bench_route(T, E, K):.1f} µs eager, "
                  f"{lr.bench_route(T, E, K, graph=True):.1f} µs graph")
