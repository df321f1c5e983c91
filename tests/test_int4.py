"""INT4 format (int4.py), GPTQ reader/writer (formats.py) and quantizer (gptq.py).

References: the unquantised weights (error bounds), exact round trips of the bit layouts,
gptqmodel's own dequantisation (tests/fixtures/gptq_tiny, made by scripts/make_gptq_fixture.py)
and RTN (GPTQ must beat it on correlated inputs).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_edge.kernels.moe_gemm import moe_ref
from lynx_edge.quant import formats
from lynx_edge.quant.gptq import (
    gptq_quantize, quantize_experts_gptq, rtn_quantize, write_gptq_checkpoint,
)
from lynx_edge.quant.int4 import (
    ALIGN, GROUP_SIZES, Int4Experts, Int4Layout, dequant, dequantize_experts, int4_moe_ref, pack,
    quantize_experts, quantize_rtn, unpack,
)

FIXTURE = Path(__file__).parent / "fixtures" / "gptq_tiny"
CASES = [(g, s) for g in GROUP_SIZES for s in (True, False)]


def _weights(*shape, seed=0):
    """Weights with per-row magnitudes spanning 3 decades and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 0, shape[-2])[:, None]
    w[..., 0, 5] = 3.0
    return w


# ------------------------------------------------------------------ int4.py: the format


def test_pack_bit_order():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack(q).tolist() == [[0x21, 0x0F]]  # even column in the low nibble


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 8), k2=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_pack_unpack_roundtrip_any_shape(n, k2, seed):
    q = torch.randint(0, 16, (n, 2 * k2), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    assert torch.equal(unpack(pack(q)), q)


@pytest.mark.parametrize("group,sym", CASES)
def test_quantize_pack_roundtrip_exact(group, sym):
    w = _weights(3, 16, 256)
    q, s, z = quantize_rtn(w, group, sym)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert s.shape == (3, 256 // group, 16) and s.dtype == torch.float16
    assert torch.equal(unpack(pack(q)), q)
    if sym:
        assert bool((z == 8).all())
    # dequant of the packed bytes is exactly s·(q − z)
    ref = (q.float() - z.float().transpose(-1, -2).repeat_interleave(group, -1)) * s.float().transpose(
        -1, -2
    ).repeat_interleave(group, -1)
    assert torch.equal(dequant(pack(q), s, None if sym else z, group), ref)


@pytest.mark.parametrize("group,sym", CASES)
def test_dequant_error_bound(group, sym):
    w = _weights(32, 512, seed=1)
    q, s, z = quantize_rtn(w, group, sym)
    deq = dequant(pack(q), s, None if sym else z, group)
    half_step = s.float().transpose(0, 1).repeat_interleave(group, -1) / 2  # [N, Kin]
    assert bool(((w - deq).abs() <= half_step * (1 + 1e-5) + 1e-7).all())  # ≤ s/2 + fp32 eps


def test_degenerate_groups_are_finite():
    w = torch.zeros(4, 64)
    w[1] = 1e-9
    w[2, :32] = -2.0  # one-signed group, asymmetric → zero point at the end of the range
    for sym in (True, False):
        q, s, z = quantize_rtn(w, 32, sym)
        deq = dequant(pack(q), s, None if sym else z, 32)
        assert torch.isfinite(deq).all()
        half_step = s.float().transpose(0, 1).repeat_interleave(32, -1) / 2
        assert bool(((deq - w).abs() <= half_step * (1 + 1e-5)).all())


@pytest.mark.parametrize("group,sym", CASES)
def test_int4_experts_layout_and_roundtrip(group, sym):
    E, D, I = 3, 128, 256
    gu, dn = _weights(E, 2 * I, D, seed=2), _weights(E, D, I, seed=3)
    p = quantize_experts(gu, dn, group, sym)
    assert p.data.shape == (E, p.layout.nbytes) and p.layout.nbytes % ALIGN == 0
    for name, (off, shape, dt) in p.layout.parts().items():
        view = getattr(p, name)
        assert off % ALIGN == 0 and view.shape == (E, *shape) and view.dtype == dt
        assert view.untyped_storage().data_ptr() == p.data.untyped_storage().data_ptr()
    assert (p.gu_z is None) == sym
    # codes() inverts from_codes; dequant matches the per-matrix reference
    codes_gu, codes_dn = p.codes()
    assert torch.equal(codes_gu[0], quantize_rtn(gu, group, sym)[0])
    assert torch.equal(Int4Experts.from_codes(codes_gu, codes_dn, group, sym).data, p.data)
    deq_gu, deq_dn = dequantize_experts(p)
    q, s, z = quantize_rtn(dn, group, sym)
    assert torch.equal(deq_dn, dequant(pack(q), s, z, group))
    assert torch.equal(p.dequant_expert(1)[0], deq_gu[1])


def test_one_copy_moves_an_expert():
    p = quantize_experts(_weights(4, 128, 64), _weights(4, 64, 64, seed=5), 32, sym=False)
    slots = Int4Experts.empty(2, p.layout)
    slots.data[1].copy_(p.data[3])  # what the offload store does: one copy per expert
    for a, b in zip(slots.dequant_expert(1), p.dequant_expert(3)):
        assert torch.equal(a, b)


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="group size"):
        Int4Experts.empty(1, Int4Layout(64, 64, group_size=16))
    with pytest.raises(ValueError, match="multiple"):
        quantize_rtn(torch.randn(4, 96), 64)


# ------------------------------------------------------------------ int4.py: the fast load path


def _tricky(n: int, k: int, group: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """_weights plus the cases rounding can get wrong: an all-zero group, a tiny one, a
    one-signed one, and exact ties w/s = m + ½ (row 3: s = 1 sym and asym; row 4: asym s = 1
    with the odd zero point 3, where ties-to-even of round(w/s) + z differs from round(w/s + z))."""
    w = _weights(n, k, seed=seed)
    w[0, :group] = 0.0
    w[1, :group] = 1e-9
    w[2, :group] = -torch.rand(group, generator=torch.Generator().manual_seed(seed)) - 0.5
    w[3, :group] = torch.arange(group) % 16 - 7.5  # −7.5 … 7.5, every value a tie
    w[4, :group] = torch.arange(group) % 15 - 2.5  # −2.5 … 11.5
    w[4, :2] = torch.tensor([-3.0, 12.0])  # asym range [−3, 12]: s = 1, z = 3
    return w.to(dtype)


@pytest.mark.parametrize("group,sym", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk", [None, 3 * 256 + 7])  # one chunk / many, the last one short
def test_fast_rtn_is_bit_identical_to_the_spec(group, sym, dtype, chunk, monkeypatch):
    from lynx_edge.quant import int4

    if chunk:
        monkeypatch.setattr(int4, "CHUNK_ELEMS", chunk)
    w = _tricky(40, 256, group, dtype, seed=group)
    q, s, z = quantize_rtn(w, group, sym)  # the spec
    for src in (w, w.t().contiguous().t()):  # a view with any strides (fused [E, in, out] files)
        got_q = torch.empty(40, 128, dtype=torch.uint8)
        got_s = torch.empty(256 // group, 40, dtype=torch.float16)
        got_z = None if sym else torch.empty(256 // group, 40, dtype=torch.uint8)
        int4.rtn_pack_into(src, got_q, got_s, got_z, group, sym)
        assert torch.equal(got_q, pack(q))
        assert torch.equal(got_s, s)
        assert sym or torch.equal(got_z, z)


@pytest.mark.parametrize("group,sym", [(32, True), (64, False)])
def test_quantize_part_streams_the_stacked_spec(group, sym):
    from lynx_edge.quant.int4 import quantize_part

    E, D, I = 3, 128, 64
    gu, dn = _weights(E, 2 * I, D, seed=4).bfloat16(), _weights(E, D, I, seed=5).bfloat16()
    want = quantize_experts(gu.float(), dn.float(), group, sym)
    got = Int4Experts.empty(E, want.layout)
    for e in range(E):
        quantize_part(got, e, "gate", gu[e, :I])
        quantize_part(got, e, "up", gu[e, I:])
        quantize_part(got, e, "down", dn[e])
    assert torch.equal(got.data, want.data)
    with pytest.raises(ValueError, match="shape"):
        quantize_part(got, 0, "down", gu[0, :I])


def _slow_gptq_codes(qweight: torch.Tensor) -> torch.Tensor:
    """q[o, i] = nibble i % 8 of qweight[i // 8, o], read one code at a time → [out, in]."""
    words = (qweight.long() % 2**32).tolist()
    n_in, n_out = 8 * len(words), len(words[0])
    return torch.tensor([[(words[i // 8][o] >> 4 * (i % 8)) & 15 for i in range(n_in)] for o in range(n_out)],
                        dtype=torch.uint8)


@pytest.mark.parametrize("sym,v1", [(True, True), (False, True), (True, False), (False, False)])
def test_gptq_bytes_land_unchanged_and_equal_the_slow_decode(sym, v1):
    """A non-act-order GPTQ linear goes into the INT4 block as its own bytes (qweight transposed,
    never unpacked); the block equals one written from an independent per-nibble decode."""
    from lynx_edge.quant.experts import write_quant
    from lynx_edge.quant.formats import QuantConfig, linear_from_checkpoint
    from lynx_edge.quant.int4 import write_part

    D, I, G = 128, 64, 32
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (I, D), generator=g, dtype=torch.uint8)  # a gate projection [out, in]
    zeros = torch.full((D // G, I), 8, dtype=torch.uint8) if sym else \
        torch.randint(0, 16, (D // G, I), generator=g, dtype=torch.uint8)
    if not sym:
        zeros[0, :8] = 0  # v1's stored −1 borrows across nibbles
    scales = (torch.rand(D // G, I, generator=g) * 0.01 + 1e-3).half()
    tensors = {"qweight": formats.pack_qweight(codes), "qzeros": formats.pack_qzeros(zeros, v1), "scales": scales,
               "g_idx": (torch.arange(D) // G).int()}
    qc = QuantConfig("gptq", 4, G, sym, False, "gptq_v1" if v1 else "gptq_v2")
    ql = linear_from_checkpoint(tensors, qc, "m")
    assert ql.perm is None and ql._codes is None and ql.packed.dtype == torch.int32  # nothing unpacked
    assert ql._sym is (True if sym else None)  # symmetric words recognised without unpacking
    slow = _slow_gptq_codes(tensors["qweight"])
    assert torch.equal(slow, codes)
    for layout_sym in {sym, False}:  # a symmetric linear also lands in an asymmetric layout (zeros 8)
        layout = Int4Layout(D, I, G, layout_sym)
        fast, ref = Int4Experts.empty(2, layout), Int4Experts.empty(2, layout)
        fast.data.fill_(0xAB), ref.data.fill_(0xAB)
        write_quant(fast, 1, "up", ql)
        write_part(ref, 1, "up", slow, scales, formats.unpack_qzeros(tensors["qzeros"], v1))
        assert torch.equal(fast.data, ref.data)
        assert torch.equal(fast.dequant_expert(1)[0][I:], ql.dequant())


def test_int4_moe_ref_dequantises_only_active_experts(monkeypatch):
    E, D, I, T, K = 8, 64, 64, 5, 2
    p = quantize_experts(_weights(E, 2 * I, D), _weights(E, D, I, seed=7), 32, sym=True)
    x = torch.randn(T, D)
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [5, 3], [0, 3]])
    w = torch.softmax(torch.randn(T, K), -1)
    fetched, orig = [], Int4Experts.dequant_expert

    def spy(self, e, dtype=torch.float32):
        fetched.append(e)
        return orig(self, e, dtype)

    monkeypatch.setattr(Int4Experts, "dequant_expert", spy)
    y = int4_moe_ref(x, ids, w, p)
    assert fetched == [0, 3, 5]
    gu, dn = dequantize_experts(p)
    assert torch.equal(y, moe_ref(x, ids, w, gu, dn))


# ------------------------------------------------------------------ formats.py: GPTQ tensors


def test_gptq_qweight_bit_order():
    codes = (torch.arange(16) % 16).to(torch.uint8).repeat(2, 1)  # [out=2, in=16], q[o, i] = i
    qw = formats.pack_qweight(codes)
    assert qw.shape == (2, 2) and qw.dtype == torch.int32
    # 8 inputs per word along the input dim, input 0 in the low bits
    assert [v & 0xFFFFFFFF for v in qw[:, 0].tolist()] == [0x76543210, 0xFEDCBA98]
    assert torch.equal(formats.unpack_qweight(qw), codes)


def test_gptq_qzeros_v1_convention_with_borrow():
    zeros = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [8] * 8, [15, 0, 0, 9, 1, 0, 4, 2]], dtype=torch.uint8)
    v2 = formats.pack_qzeros(zeros, v1=False)
    v1 = formats.pack_qzeros(zeros, v1=True)
    assert (v2[0, 0].item() & 0xFFFFFFFF) == 0x76543210  # packed along the output dim
    assert (v1[0, 0].item() & 0xFFFFFFFF) == 0x76543210 - 0x11111111  # word − 0x11111111 (borrows)
    assert (v1[1, 0].item() & 0xFFFFFFFF) == 0x77777777  # symmetric: stored zero 7
    for fmt, words in ((True, v1), (False, v2)):
        assert torch.equal(formats.unpack_qzeros(words, v1=fmt), zeros)


def _ckpt(tmp_path, group=32, sym=False, naming="qwen", fmt="gptq", seed=0):
    p = quantize_experts(_weights(4, 128, 64, seed=seed), _weights(4, 64, 64, seed=seed + 1), group, sym)
    write_gptq_checkpoint(tmp_path, {0: p, 2: p}, naming=naming, checkpoint_format=fmt,
                          config={"model_type": "qwen3_moe" if naming == "qwen" else "mixtral"})
    return p


@pytest.mark.parametrize("naming", ["qwen", "mixtral"])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("group,sym", [(32, False), (64, True)])
def test_gptq_write_read_roundtrip(tmp_path, naming, fmt, group, sym):
    p = _ckpt(tmp_path, group, sym, naming, fmt)
    cfg = formats.read_gptq_config(tmp_path)
    assert (cfg.group_size, cfg.sym, cfg.checkpoint_format) == (group, sym, fmt)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4
    r = formats.read_gptq_experts(tmp_path, 2)
    assert r.layout == p.layout and torch.equal(r.data, p.data)
    src = formats.TensorSource(tmp_path)
    mod = "w1" if naming == "mixtral" else "gate_proj"
    key = formats.expert_prefix(0, 1, naming) + f".{mod}"
    assert src.get(key + ".qweight").shape == (64 // 8, 64)  # [in/8, out]
    assert src.get(key + ".qzeros").shape == (64 // group, 64 // 8)


def test_gptq_group_128_and_config_json_only(tmp_path):
    p = quantize_experts(_weights(2, 256, 128), _weights(2, 128, 128, seed=9), 128, sym=True)
    write_gptq_checkpoint(tmp_path, {0: p})
    (tmp_path / "quantize_config.json").unlink()  # transformers-style: only config.json
    assert torch.equal(formats.read_gptq_experts(tmp_path, 0).data, p.data)


def test_gptq_desc_act_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _ckpt(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    key = formats.expert_prefix(0, 0, "qwen") + ".up_proj.g_idx"
    tensors[key] = tensors[key][torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    save_file(tensors, tmp_path / "model.safetensors")
    qc = json.loads((tmp_path / "quantize_config.json").read_text()) | {"desc_act": True}
    (tmp_path / "quantize_config.json").write_text(json.dumps(qc))
    with pytest.raises(ValueError, match="desc_act") as info:
        formats.read_gptq_experts(tmp_path, 0)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change,match", [
    ({"bits": 8}, "4-bit"), ({"quant_method": "awq"}, "not a GPTQ"), ({"group_size": -1}, "group_size"),
])
def test_gptq_config_refusals(tmp_path, change, match):
    _ckpt(tmp_path)
    qc = json.loads((tmp_path / "quantize_config.json").read_text()) | change
    (tmp_path / "quantize_config.json").write_text(json.dumps(qc))
    with pytest.raises(ValueError, match=match):
        formats.read_gptq_config(tmp_path)


def test_sharded_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    p = _ckpt(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, tmp_path / f)
    index = {"weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(formats.read_gptq_experts(tmp_path, 0).data, p.data)


def test_reader_matches_gptqmodel_fixture():
    """gptqmodel 7.7 quantised a tiny Qwen3-MoE (v1 zeros, asym, G=32); our reader must give
    exactly the weights gptqmodel's own TorchLinear dequantises."""
    from safetensors.torch import load_file

    cfg = formats.read_gptq_config(FIXTURE)
    assert (cfg.group_size, cfg.sym, cfg.v1) == (32, False, True)
    p = formats.read_gptq_experts(FIXTURE, 0)
    exp = load_file(FIXTURE / "expected_dequant.safetensors")
    gu, dn = dequantize_experts(p)
    assert torch.equal(gu, exp["layers.0.gate_up"]) and torch.equal(dn, exp["layers.0.down"])


# ------------------------------------------------------------------ gptq.py: the quantizer


def _correlated(n, d, seed=0):
    """Activations with a decaying spectrum in a fixed random basis plus a shared offset, like
    real hidden states; seed draws new samples of the same distribution."""
    g = torch.Generator().manual_seed(1234)
    basis = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    offset = 0.3 * torch.randn(d, generator=g)
    z = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return (z * torch.logspace(0, -2, d)) @ basis.t() + offset


@pytest.mark.parametrize("group,sym", [(32, True), (128, False)])
def test_gptq_beats_rtn_on_correlated_inputs(group, sym):
    x = _correlated(1024, 256)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(3)) / 16
    x_test = _correlated(512, 256, seed=1)  # held out, same distribution

    def out_err(codes):
        q, s, z = codes
        return ((x_test @ (w - dequant(pack(q), s, z, group)).t()) ** 2).mean().item()

    e_gptq, e_rtn = out_err(gptq_quantize(w, x, group, sym)), out_err(rtn_quantize(w, group, sym))
    assert e_gptq < 0.6 * e_rtn, (e_gptq, e_rtn)


def test_gptq_experts_beat_rtn_end_to_end():
    E, D, I, T, K = 4, 64, 64, 256, 2
    g = torch.Generator().manual_seed(4)
    gu, dn = torch.randn(E, 2 * I, D, generator=g) / 8, torch.randn(E, D, I, generator=g) / 8
    x = _correlated(T, D, seed=2)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.full((T, K), 1.0 / K)
    x_in = [x[(ids == e).any(1)] for e in range(E)]
    ref = moe_ref(x, ids, w, gu, dn)
    err = {}
    for name, p in (("gptq", quantize_experts_gptq(gu, dn, x_in, group_size=32)),
                    ("rtn", quantize_experts(gu, dn, 32))):
        err[name] = ((int4_moe_ref(x, ids, w, p) - ref) ** 2).mean().item()
    assert err["gptq"] < 0.7 * err["rtn"], err


def test_gptq_without_calibration_falls_back_to_rtn():
    w = torch.randn(16, 64)
    for a, b in zip(gptq_quantize(w, torch.zeros(0, 64), 32), rtn_quantize(w, 32)):
        assert torch.equal(a, b)
