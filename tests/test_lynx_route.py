"""Fused router + LYNX kernel (kernels/lynx_route.py) against the torch reference lynx_select.

test_interp_* run only under TRITON_INTERPRET=1 (set before triton is imported):
test_interpreter_suite re-runs this file in a subprocess with it set. The main process checks the
reference's output format, the CPU dispatch and an sm_90 ahead-of-time compile (no spills);
-m gpu checks CUDA results, CUDA-graph capture and reports the per-layer time.
Glossary: T tokens, E experts, K top-k.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import gpu_only, run_interpreter_suite

from lynx_edge.kernels import lynx_route as lr
from lynx_edge.kernels.lynx_route import gemm_table, lynx_route, lynx_route_ref
from lynx_edge.kernels.moe_gemm import expert_table
from lynx_edge.lynx import LynxConfig, lynx_select
from lynx_edge.routing import RouterSpec

ROOT = Path(__file__).resolve().parents[1]
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERP or lr.triton is None,
                            reason="runs in the TRITON_INTERPRET=1 subprocess of test_interpreter_suite")


def _logits(T: int, E: int, K: int, seed: int, device="cpu") -> torch.Tensor:
    """Random router logits [T, E]; every third row ×4 (a clear-cut router). Checks that no two
    of a row's K+1 best probabilities tie exactly (then torch.topk's order is defined)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, E, generator=g) * 1.5
    z[::3] *= 4
    top = torch.softmax(z, -1).topk(min(K + 1, E), -1).values
    assert bool((top[:, 1:] < top[:, :-1]).all()), "tied probabilities: pick another seed"
    return z.to(device)


def _mixed(T: int, device="cpu") -> torch.Tensor:
    """Decode mask with prefill tokens at 1, 5, 9, … (all decode when T = 1)."""
    return (torch.arange(T) % 4 != 1).to(device)


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
    ids, w, active, counts, table = out
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ref[0]), (ids, ref[0])
    torch.testing.assert_close(w, ref[1], atol=1e-6, rtol=0)
    for a, b in zip(out[2:], ref[2:]):
        assert torch.equal(a.cpu(), b.cpu())
    _check_table(ids.cpu(), active.cpu(), counts.cpu(), table.cpu(), E)


# ------------------------------------------------------------ main process


@pytest.mark.parametrize("mode", ["off", "lynx"])
def test_reference_format(mode):
    """lynx_route_ref = lynx_select's ids/weights + a table consistent with them, and
    gemm_table() is exactly moe_gemm.expert_table (the GEMM's input) up to act_e padding."""
    T, E, K = 9, 16, 4
    z, isd = _logits(T, E, K, 1), _mixed(T)
    spec = RouterSpec(E, K, True)
    out = lynx_route_ref(z, isd, spec, mode)
    r = lynx_select(z, isd, spec, LynxConfig.parse(mode))
    assert torch.equal(out[0], r.ids) and torch.equal(out[1], r.weights)
    _check_table(*[o for i, o in enumerate(out) if i != 1], E)
    got, want = gemm_table(*out[2:], K), expert_table(out[0], E)
    n = want["num_act"].item()
    assert torch.equal(got["act_e"][:n], want["act_e"][:n])
    for key in ("tok", "slot", "act_start", "num_act"):
        assert torch.equal(got[key], want[key]), key


@pytest.mark.skipif(INTERP, reason="checks the torch fallback")
def test_cpu_dispatch_is_the_reference():
    z, isd, spec = _logits(5, 8, 2, 2), _mixed(5), RouterSpec(8, 2, False)
    assert not lr.kernel_supported(z, spec, LynxConfig("lynx"))
    for a, b in zip(lynx_route(z, isd, spec, "lynx"), lynx_route_ref(z, isd, spec, "lynx")):
        assert torch.equal(a, b)


def test_kernel_size_limits():
    """Shapes the one-program kernel takes; others go to the torch reference."""
    cfg = LynxConfig("lynx")
    assert lr._fits(64, 256, RouterSpec(256, 8, True), cfg) and lr._fits(1, 8, RouterSpec(8, 8, True), cfg)
    assert not lr._fits(65, 64, RouterSpec(64, 8, True), cfg)  # T > 64
    assert not lr._fits(8, 512, RouterSpec(512, 8, True), cfg)  # E > 256
    assert not lr._fits(8, 64, RouterSpec(64, 17, True), cfg)  # K > 16
    assert not lr._fits(0, 64, RouterSpec(64, 8, True), cfg)  # no tokens
    assert not lr._fits(64, 64, RouterSpec(64, 8, True), LynxConfig.parse("lynx,beta=10"))  # > 2^62
    assert lr._fits(64, 64, RouterSpec(64, 8, True), LynxConfig.parse("off,beta=10"))


@pytest.mark.skipif(INTERP, reason="this is the launcher")
def test_interpreter_suite():
    """Run the test_interp_* cases in a fresh process with TRITON_INTERPRET=1."""
    if lr.triton is None:
        pytest.skip("triton not installed")
    run_interpreter_suite(__file__, 9)


# ------------------------------------------------------------ ahead-of-time compile (no GPU)


def _aot_stack(T, E, K, mode, arch=90) -> int:
    """Compile plan_route's launch for a CUDA target as the JIT would specialise it → stack bytes
    (> 0 means register spills)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    z = torch.empty(T, E, device="meta")
    isd = torch.empty(T, dtype=torch.bool, device="meta")
    p = lr.plan_route(z, isd, RouterSpec(E, K, True), LynxConfig.parse(mode))
    types = {torch.float32: "*fp32", torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}
    names, sig, attrs = p.kernel.arg_names, {}, {}
    for i, (n, a) in enumerate(zip(names, p.args)):
        sig[n] = types[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float) else "i32"
        if isinstance(a, torch.Tensor) or (isinstance(a, int) and a % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    sig.update({n: "constexpr" for n in p.meta})
    src = ASTSource(p.kernel, sig, {(names.index(n),): v for n, v in p.meta.items()}, attrs)
    ck = lr.triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": p.num_warps})
    bin_dir = Path(lr.triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"lynx_route_aot_{os.getpid()}.cubin"
    cubin.write_bytes(ck.asm["cubin"])
    usage = subprocess.run([str(bin_dir / "cuobjdump"), "-res-usage", str(cubin)],
                           capture_output=True, text=True).stdout
    cubin.unlink()
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def _need_aot():
    if INTERP or lr.triton is None:
        pytest.skip("needs compiled (non-interpreted) triton")
    if not (Path(lr.triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")


def test_aot_compile_sm90_decode():
    """The kernel compiles for sm_90 at a Qwen3-30B-A3B decode step (T=16, E=128, K=8) with
    LYNX, and spills no registers."""
    _need_aot()
    assert _aot_stack(16, 128, 8, "lynx") == 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_aot_compile_all_modes(arch):
    """Every mode compiles; no spills up to T·E = 4096 (bigger tiles spill a little)."""
    _need_aot()
    for T, E, K in ((1, 8, 2), (16, 64, 8), (16, 256, 8), (32, 128, 8)):
        for mode in ("off", "lynx", "budget:8", "lynx-mass:0.2", "lynx,beta=8"):
            assert _aot_stack(T, E, K, mode, arch) == 0, (T, E, K, mode)
    _aot_stack(64, 256, 8, "lynx", arch)  # the largest supported tile still compiles


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
    weights within 1e-6, same active list and token table."""
    z, spec = _logits(T, E, K, seed=T * E + K), RouterSpec(E, K, norm)
    for isd in (torch.ones(T, dtype=torch.bool), _mixed(T)):
        for mode in ("off", "lynx"):
            _assert_same(lynx_route(z, isd, spec, mode), lynx_route_ref(z, isd, spec, mode), E)
    if T >= 8 and K > 1:  # the case is a real test of the remap
        isd = torch.ones(T, dtype=torch.bool)
        lynx_ids, exact_ids = (lynx_route_ref(z, isd, spec, m)[0] for m in ("lynx", "off"))
        assert not torch.equal(lynx_ids, exact_ids)


@interp
@pytest.mark.parametrize("mode", ["budget:5", "lynx-mass:0.3", "lynx,j=2,protect_top1=false",
                                  "lynx,min_batch=4,alpha=1.5", "lynx,beta=8,j=3", "lynx-mass:1"])
def test_interp_other_modes_and_knobs(mode):
    """budget:m, lynx-mass:τ and knobs (int64 scores at beta=8 with T=16)."""
    T, E, K = 16, 64, 4
    z, spec = _logits(T, E, K, seed=7), RouterSpec(E, K, False)
    for isd in (torch.ones(T, dtype=torch.bool), _mixed(T)):
        _assert_same(lynx_route(z, isd, spec, mode), lynx_route_ref(z, isd, spec, mode), E)


@interp
def test_interp_small_batches_skipped_layers_and_strides():
    """B < 2 and skip_layers stay exact; a row-strided view of bigger logits works."""
    T, E, K = 4, 16, 2
    big = _logits(T, 2 * E, K, seed=3)
    z, spec = big[:, :E], RouterSpec(E, K, True)
    one = torch.tensor([False, True, False, False])
    _assert_same(lynx_route(z, one, spec, "lynx"), lynx_route_ref(z, one, spec, "off"), E)
    isd = torch.ones(T, dtype=torch.bool)
    cfg = LynxConfig.parse("lynx,skip_layers=2")
    _assert_same(lynx_route(z, isd, spec, cfg, layer=2), lynx_route_ref(z, isd, spec, "off"), E)
    _assert_same(lynx_route(z, isd, spec, "lynx"), lynx_route_ref(z, isd, spec, "lynx"), E)


@interp
def test_interp_ties_lower_id_wins():
    """Exact ties: top-k and remap targets go to the lower expert id (stable sort order)."""
    T, E, K = 6, 16, 4
    z = torch.randint(-2, 3, (T, E)).float()  # many exact ties
    z[0] = 0.0
    ids, w, *_ = lynx_route(z, torch.zeros(T, dtype=torch.bool), RouterSpec(E, K, True), "lynx")
    assert torch.equal(ids, torch.sort(z, dim=1, descending=True, stable=True).indices[:, :K])
    assert torch.equal(ids[0], torch.arange(K)) and bool((w[0] == 0.25).all())


@interp
def test_interp_gemm_consumes_the_table():
    """fused_moe with table=gemm_table(lynx_route(...)) equals moe_ref on the LYNX ids."""
    from lynx_edge.kernels.moe_gemm import fused_moe, moe_ref

    T, E, K, D, I = 8, 16, 2, 64, 64
    z, spec = _logits(T, E, K, seed=5), RouterSpec(E, K, True)
    ids, w, active, counts, table = lynx_route(z, torch.ones(T, dtype=torch.bool), spec, "lynx")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g)
    gu, dn = torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5
    y = fused_moe(x, ids, w, gu, dn, table=gemm_table(active, counts, table, K))
    torch.testing.assert_close(y, moe_ref(x, ids, w, gu, dn), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------ CUDA (-m gpu)


@gpu_only
@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (16, 64, 8), (16, 128, 8), (64, 256, 8), (33, 160, 6)])
@pytest.mark.parametrize("mode", ["off", "lynx", "budget:8", "lynx-mass:0.3"])
def test_gpu_matches_reference(T, E, K, mode):
    for seed, norm in ((0, True), (1, False)):
        z, spec = _logits(T, E, K, seed, "cuda"), RouterSpec(E, K, norm)
        for isd in (torch.ones(T, dtype=torch.bool, device="cuda"), _mixed(T, "cuda")):
            _assert_same(lynx_route(z, isd, spec, mode), lynx_route_ref(z, isd, spec, mode), E)


@gpu_only
def test_gpu_cuda_graph_capture():
    """No host sync in the launch path: lynx_route captures into a CUDA graph and replays
    correctly after the logits and the decode mask change in place."""
    T, E, K = 16, 128, 8
    spec = RouterSpec(E, K, True)
    z, isd = _logits(T, E, K, 0, "cuda"), torch.ones(T, dtype=torch.bool, device="cuda")
    lynx_route(z, isd, spec, "lynx")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lynx_route(z, isd, spec, "lynx")
    z.copy_(_logits(T, E, K, 1, "cuda"))
    isd.copy_(_mixed(T, "cuda"))
    graph.replay()
    _assert_same(out, lynx_route_ref(z, isd, spec, "lynx"), E)


@gpu_only
def test_gpu_bench_route(capsys):
    with capsys.disabled():
        for T, E, K in ((1, 64, 8), (16, 64, 8), (16, 128, 8), (64, 256, 8)):
            print(f"\nlynx_route T={T} E={E} K={K}: {lr.bench_route(T, E, K):.1f} µs eager, "
                  f"{lr.bench_route(T, E, K, graph=True):.1f} µs graph")
