"""`int8_head` (`--int8-head`): the output head as int8 rows with one fp32 scale each (quant/int8.py),
read by the native kernel (kernels/native.linear_int8) on a CPU.

References: the kernel against fp64 math on the dequantised rows; the model against the same
checkpoint with its lm_head replaced by that dequantisation, loaded as a plain float model — the
logits must agree to the kernels' fp32 rounding. The one-call decode stack (its head plan) must
equal the module path bit for bit.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import decode_logits, q8_emulate, tiny_with_reference
from lynx_edge.kernels import native
from lynx_edge.quant.int8 import dequant, linear_int8_torch, quantize_rows

pytestmark = pytest.mark.skipif(native.lib() is None, reason="native kernels not built (no C compiler)")
PROMPT = [5, 17, 42, 99, 3, 125, 7, 8, 120, 64, 33, 2]
TOL = 1.5e-6  # max |Δ| / output scale; observed 3.5e-7 over these cases


def _rel(y, ref):
    return (y.double() - ref.double()).abs().max().item() / max(1.0, ref.abs().max().item())


def test_quantize_rows_rounds_each_row_to_its_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 90, generator=g) * torch.rand(37, 1, generator=g)
    w[5] = 0.0  # an all-zero row: scale 0, codes 0 (no division by zero)
    q, s = quantize_rows(w.bfloat16())
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (37,)
    wb = w.bfloat16().float()
    assert torch.allclose(s, wb.abs().amax(1) / 127)
    assert q.abs().max() == 127 and not q[5].any() and s[5] == 0
    err = (dequant(q, s) - wb).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-5) + 1e-12).all()  # round to nearest: half a step at most


@pytest.mark.parametrize("T,N,Kin,bias", [(1, 7, 64, False), (2, 40, 200, True), (3, 33, 256, False),
                                          (6, 130, 128, True), (70, 24, 96, False)])
def test_int8_linear_matches_reference(T, N, Kin, bias):
    g = torch.Generator().manual_seed(T + N)
    q, s = quantize_rows(torch.randn(N, Kin, generator=g))
    x = torch.randn(T, Kin, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    ref = F.linear(x.double(), dequant(q, s).double(), None if b is None else b.double())
    y = native.linear_int8(x, q, s, b)
    assert y.shape == (T, N) and y.dtype == torch.float32
    assert _rel(y, ref) < TOL, _rel(y, ref)
    assert _rel(linear_int8_torch(x, q, s) + (0 if b is None else b), ref) < TOL  # the fallback
    bad = s.clone()
    bad[N // 2] *= 1.01  # one row's scale 1% off
    assert _rel(native.linear_int8(x, q, bad, b), ref) > 10 * TOL
    q2 = q.clone()
    q2[0, Kin - 1] += 1 if q2[0, Kin - 1] < 127 else -1  # the last weight of a row (the tail)
    assert _rel(native.linear_int8(x, q2, s, b), ref) > 10 * TOL * (1 if Kin % 16 else 0.01)


@pytest.mark.parametrize("T,N,Kin", [(1, 40, 64), (3, 33, 256), (6, 130, 128), (70, 24, 192), (5, 50, 576), (2, 17, 2048)])
def test_int8_q8_linear_matches_emulation(T, N, Kin):
    """act="q8": int8 activations in blocks of 256 (natural order; llama.cpp's Q8_K, a shorter last
    block where Kin % 256 != 0) against the int8 rows, integer dot products (AVX512-VNNI; AVX2): equal to
    fp64 math on the emulated quantisation, and really quantised."""
    if not native.i8_q8():
        pytest.skip("int8 activations for int8 rows need AVX512-VNNI or AVX2")
    g = torch.Generator().manual_seed(T + Kin)
    q, s = quantize_rows(torch.randn(N, Kin, generator=g))
    x = torch.randn(T, Kin, generator=g)
    x[0, 256:512] = 0.0  # an all-zero block (part of one where Kin <= 256)
    x[-1, :8] *= 40.0  # outliers: their block's scale, not the others'
    b = torch.randn(N, generator=g)
    w = dequant(q, s).double()
    ref = F.linear(q8_emulate(x, 256).double(), w, b.double())
    y = native.linear_int8(x, q, s, b, act="q8")
    assert _rel(y, ref) < TOL, _rel(y, ref)
    assert 1e-4 < _rel(y, F.linear(x.double(), w, b.double())) < 4e-2  # quantised: ~2^-8 of its block's max per input
    x2 = x.clone()
    x2[-1, Kin - 3] += 0.3  # one input moved: a wrong block scale or lane would miss or smear it
    assert _rel(native.linear_int8(x2, q, s, b, act="q8"), F.linear(q8_emulate(x2, 256).double(), w, b.double())) < TOL


def test_int8_q8_big_head_token_alone_equals_its_batch():
    """A head of >= 8 MiB of int8 rows (a real model's, which streams from DRAM each step): on AVX2 a
    lone token reads each row whole instead of four rows interleaved. It must equal the emulation and,
    bit for bit, the same token inside a batch (multi-token tiles). N = 4100: a partial work item."""
    if not native.i8_q8():
        pytest.skip("int8 activations for int8 rows need AVX512-VNNI or AVX2")
    N, Kin = 4100, 2048  # 8.4 MB of codes
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (N, Kin), dtype=torch.int8, generator=g)
    s = torch.rand(N, generator=g) * 0.01 + 1e-3
    x = torch.randn(3, Kin, generator=g)
    x[1, 300] = 25.0  # an outlier in one block of the middle token
    batch = native.linear_int8(x, q, s, act="q8")
    ref = F.linear(q8_emulate(x, 256).double(), dequant(q, s).double())
    assert _rel(batch, ref) < TOL
    for t in range(3):
        alone = native.linear_int8(x[t:t + 1], q, s, act="q8")
        assert _rel(alone, ref[t:t + 1]) < TOL
        assert torch.equal(alone, batch[t:t + 1]), t


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """(an untied 16-bit checkpoint, its reference with lm_head replaced by the int8 dequantisation)."""
    def head_int8(t):
        t["lm_head.weight"] = dequant(*quantize_rows(t["lm_head.weight"])).to(t["lm_head.weight"].dtype)

    return tiny_with_reference(tmp_path_factory.mktemp("i8h"), head_int8)


def _logits(path: Path, **kw) -> tuple[torch.Tensor, object]:
    return decode_logits(path, PROMPT, **kw)


def test_int8_head_matches_its_dequantised_reference(pair):
    src, ref_dir = pair
    ref, _ = _logits(ref_dir)
    got, eng = _logits(src, int8_head=True)
    m = eng.model
    assert m.placement.int8_head and m.lm_head is None  # the 16-bit head is freed (untied)
    assert m.head_int8[0].dtype == torch.int8 and m.head_int8[0].shape == (m.cfg.vocab_size, m.cfg.hidden_size)
    err = (got - ref).abs().max().item()
    assert err < 2e-6, err  # observed 4.8e-7: the int8 kernel vs fp32 GEMMs on the same values
    plain, _ = _logits(src)  # without the flag: the head is 16-bit, logits differ by the rounding
    assert (plain - ref).abs().max().item() > 100 * 2e-6


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_decode_stack_head_equals_module_path(monkeypatch, act):
    """The demo (tied head: the embedding stays) with int8_head, one decode step through the one-call
    stack (its head plan reads the int8 rows) and through the module path: the same logits; with
    int4_act="q8" the head's activations are int8 too, in both."""
    from lynx_edge import Engine
    from lynx_edge.models import native_layer
    from lynx_edge.step import decode_step, prefill

    eng = Engine.from_pretrained("demo", device="cpu", dtype="bfloat16", int8_head=True, int4_act=act)
    assert eng.model.head_act == act
    assert eng.model.head_int8 is not None and eng.model.embed_tokens.dtype == torch.bfloat16
    outs = []
    for stack in (True, False):
        monkeypatch.setattr(native_layer, "NATIVE_LAYERS", stack)
        kv = eng._cache(2)
        for b in range(2):
            prefill(eng.model, kv, b, PROMPT[b:])
        outs.append(decode_step(eng.model, kv, [0, 1], torch.tensor([7, 9])))
    assert torch.equal(outs[0], outs[1])
    lin = eng.model.__dict__["_native_head"][1][2]
    assert lin.kind == native.FMT_I8 and lin.act == (act == "q8")  # the stack's head was int8


def test_int8_head_without_native_kernels_warns_and_keeps_16bit(pair, monkeypatch):
    from lynx_edge import Engine

    monkeypatch.setattr(native, "lib", lambda: None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng = Engine.from_pretrained(pair[0], device="cpu", dtype="float32", int8_head=True)
    assert any("int8_head applies on a CPU with the native kernels" in str(x.message) for x in w)
    assert eng.model.head_int8 is None and eng.model.lm_head is not None and not eng.model.placement.int8_head


def test_cli_flag(pair, tmp_path):
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app
    from lynx_edge.cli.common import engine_options

    assert engine_options(int8_head=True)["int8_head"] is True and "int8_head" not in engine_options()
    for cmd in ("bench", "chat", "serve"):
        assert "--int8-head" in CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "200"}).output
    out = tmp_path / "b.json"
    r = CliRunner().invoke(app, ["bench", str(pair[0]), "--int8-head", "-p", "4", "-n", "3", "-r", "1", "-b", "1",
                                 "--lynx", "off", "--save", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "int8 head" in r.output  # the table's title says what ran
    import json

    assert json.loads(out.read_text())["config"]["int8_head"] is True  # and the saved result records it
