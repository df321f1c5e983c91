"""The compiled INT4 CPU kernels — native (lynx_edge/kernels/cpu_native.c) and numba
(lynx_edge/quant/cpu_kernels.py), each test run on both — against the torch reference:
int4_moe_ref = dequantise the active experts, then fp32 F.linear (moe_ref_lazy's slot-order sum).

Each kernel sums s·Σ(q − z)·x per group with vectorised (reassociated) fp32 partial sums, so it is
not bit-equal: the bound is ~3× the largest error observed over these cases (max |Δ| / output
scale 5.7e-7, mean relative 3.8e-7, incl. D=2048, I=768 at 16 tokens). The K slots are weighted and summed in slot order as in the
reference. Bug cases (a flipped code, swapped routing weights, the wrong zero point) must exceed it.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lynx_edge.kernels import native
from lynx_edge.quant import cpu_kernels
from lynx_edge.quant.experts import Int4MoEExperts
from lynx_edge.quant.int4 import Int4Experts, int4_moe_ref, quantize_experts

pytestmark = [pytest.mark.skipif(not cpu_kernels.available(), reason="no compiled INT4 kernel (numba, C compiler)"),
              pytest.mark.usefixtures("exact_int4")]  # fp32 references: the exact rows (conftest)


_KERNEL = ["native"]  # the kernel the running test is pinned to (for its bound)


@pytest.fixture(params=["native", "numba"])
def kernel(request, monkeypatch):
    """Runs the test on one kernel: moe_int4_blocks' default (what the module and the offload
    store call) is pinned to it."""
    if request.param == "native" and native.lib() is None:
        pytest.skip("native kernels not built (no C compiler)")
    if request.param == "numba" and cpu_kernels._moe_nb is None:
        pytest.skip("numba not installed")
    real = cpu_kernels.moe_int4_blocks
    _KERNEL[0] = request.param
    monkeypatch.setattr(cpu_kernels, "moe_int4_blocks",
                        lambda *a, kernel=None, **k: real(*a, kernel=request.param, **k))
    return request.param

# (max |Δ| / max(1, max |ref|), mean |Δ| / mean |ref|), ~3× the largest observed over these cases
# plus D=2048, I=768 at 16 tokens: numba 5.7e-7 / 3.7e-7; native 2.0e-6 / 1.1e-6 (it takes the zero
# point out of the inner loop, s·(Σq·x − z·Σx): one cancellation more, 10% more speed)
TOLS = {"numba": (1.7e-6, 1.2e-6), "native": (6e-6, 3.3e-6)}
TOL = TOLS["native"]  # the looser one, for the bug cases that run on both


def _problem(T, K, E, D, I, G=32, sym=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    gu = torch.randn(E, 2 * I, D, generator=g) / D**0.5
    dn = torch.randn(E, D, I, generator=g) / I**0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).reshape(T, K)
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, ids, w, quantize_experts(gu, dn, G, sym)


def _err(y, ref):
    d = (y.float() - ref.float()).abs()
    return d.max().item() / max(1.0, ref.abs().max().item()), (d.mean() / ref.abs().mean()).item()


def _close(y, ref):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    m, a = _err(y, ref)
    tol = TOLS[_KERNEL[0]]
    assert m < tol[0] and a < tol[1], (m, a)


# T=1: the one-token pass; 5, 17 tokens on few experts: the 4-token blocks and their remainder
@pytest.mark.parametrize("T,K,E,D,I,G,sym", [
    (1, 1, 4, 64, 32, 32, True), (1, 4, 8, 128, 64, 64, False), (5, 2, 4, 64, 96, 32, True),
    (17, 3, 4, 128, 64, 32, False), (9, 4, 16, 256, 128, 128, True), (3, 2, 6, 192, 64, 64, True),
    (16, 4, 8, 1024, 256, 128, False),
])
def test_kernel_matches_reference(T, K, E, D, I, G, sym, kernel):
    x, ids, w, p = _problem(T, K, E, D, I, G, sym)
    _close(cpu_kernels.moe_int4_cpu(x, ids, w, p), int4_moe_ref(x, ids, w, p))


def test_bugs_are_caught(kernel):
    """Each injected fault lands far outside the bound the kernel meets."""
    x, ids, w, p = _problem(6, 2, 4, 64, 64, 32, False)
    ref = int4_moe_ref(x, ids, w, p)
    bad = Int4Experts(p.data.clone(), p.layout)
    e = int(ids[0, 0])
    bad.gu_q[e, 3, 5] ^= 0x11  # one code byte of an active expert (both nibbles)
    assert _err(cpu_kernels.moe_int4_cpu(x, ids, w, bad), ref)[0] > 10 * TOL[0]
    assert _err(cpu_kernels.moe_int4_cpu(x, ids, w.flip(1), p), ref)[0] > 10 * TOL[0]
    z_off = Int4Experts(p.data.clone(), p.layout)
    z_off.gu_z.add_(1)  # zero points one off: what a wrong implicit zero would do
    assert _err(cpu_kernels.moe_int4_cpu(x, ids, w, z_off), ref)[1] > 10 * TOL[1]


def test_repeated_expert_and_act_order(kernel):
    """Slots of one token on the same expert; act-order inputs: gate/up read x[:, perm[e]]."""
    x, _, w, p = _problem(4, 2, 4, 64, 32, 32, True)
    ids = torch.tensor([[1, 1], [0, 1], [3, 3], [1, 0]])
    _close(cpu_kernels.moe_int4_cpu(x, ids, w, p), int4_moe_ref(x, ids, w, p))
    g = torch.Generator().manual_seed(1)
    perm = torch.stack([torch.randperm(64, generator=g) for _ in range(4)]).to(torch.int32)
    mod = Int4MoEExperts(p)
    mod.x_perm = perm
    # reference: expert e's codes take column j from x[:, perm[e, j]] = the weights scattered back
    ref = torch.zeros(4, 64)
    for t in range(4):
        for k in range(2):
            e = int(ids[t, k])
            gu, dn = p.dequant_expert(e)
            gate, up = (gu @ x[t, perm[e].long()]).chunk(2)
            ref[t] += w[t, k] * (dn @ (torch.nn.functional.silu(gate) * up))
    _close(mod(x, ids, w), ref)


def test_bf16_activations_and_empty_batch(kernel):
    x, ids, w, p = _problem(3, 2, 4, 64, 32, 32, True)
    y = cpu_kernels.moe_int4_cpu(x.bfloat16(), ids, w, p)
    ref = int4_moe_ref(x.bfloat16().float(), ids, w, p)  # fp32 math on the bf16 inputs, then one rounding
    assert y.dtype == torch.bfloat16 and _err(y.float(), ref)[0] <= 2**-8  # one bf16 rounding of the output
    assert cpu_kernels.moe_int4_cpu(x[:0], ids[:0], w[:0], p).shape == (0, 64)


def test_module_and_offload_store_use_the_kernel(kernel):
    """Int4MoEExperts.forward on a CPU and the offload store's INT4 CPU experts run the kernel."""
    from lynx_edge.offload.store import Int4Format

    x, ids, w, p = _problem(5, 2, 4, 64, 32, 32, True)
    assert torch.equal(Int4MoEExperts(p)(x, ids, w), cpu_kernels.moe_int4_cpu(x, ids, w, p))
    fmt = Int4Format(64, 32, 32, True)
    ref = int4_moe_ref(x, torch.full((5, 1), 2), torch.ones(5, 1), p)
    _close(fmt.compute(p.data[2], x), ref)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_op_count_does_not_grow_with_active_experts(kernel):
    x, _, w, p = _problem(8, 2, 16, 64, 32, 32, True)
    mod = Int4MoEExperts(p)
    counts = []
    for ids in (torch.zeros(8, 2, dtype=torch.long) + torch.tensor([0, 1]),  # 2 active experts
                torch.arange(16).reshape(8, 2)):  # 16 active experts
        with _Count() as c:
            mod(x, ids, w)
        counts.append(c.n)
    assert counts[0] == counts[1] and counts[0] <= 12, counts
