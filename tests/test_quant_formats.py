"""Published 4-bit formats (quant/formats.py, quant/awq.py) against independent references: the
fixtures' expected_dequant (slow per-nibble decodes written by scripts/make_{awq,gptq}_fixture.py,
and gptqmodel's own dequantisation for gptq_tiny), in-test slow decoders, and published configs
(tests/fixtures/quant_configs/*.json, each naming its source)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from lynx_edge.quant import awq, formats
from lynx_edge.quant.formats import (
    QUANT_TENSOR_SUFFIXES, QuantConfig, QuantConfigError, QuantLinear, linear_from_checkpoint,
    permute_out, read_quant_config,
)

FIX = Path(__file__).parent / "fixtures"
GPTQ_V1 = QuantConfig("gptq", 4, 32, False, False, "gptq_v1")
AWQ = QuantConfig("awq", 4, 32, False, False, "awq")


def _fixture(name: str):
    d = FIX / name
    qc = read_quant_config(d, json.loads((d / "config.json").read_text()))
    return d, qc, load_file(d / "model.safetensors"), load_file(d / "expected_dequant.safetensors")


def _linear(tensors: dict, qc: QuantConfig, mod: str) -> QuantLinear:
    parts = {s: tensors[f"{mod}.{s}"] for s in QUANT_TENSOR_SUFFIXES if f"{mod}.{s}" in tensors}
    return linear_from_checkpoint(parts, qc, mod)


def _one_line(err: Exception, *needles: str) -> None:
    msg = str(err)
    assert "\n" not in msg and all(n in msg for n in needles), msg


# ------------------------------------------------------------------ AWQ bit order


def test_awq_word_layout_is_autoawq_order():
    # q[o, i] = o: the word of input row i, columns 0..7, must read nibble k = column AWQ_ORDER[k]
    codes = torch.arange(8, dtype=torch.uint8)[:, None].expand(8, 32).contiguous()  # [out=8, in=32]
    zeros = torch.arange(8, 16, dtype=torch.uint8)[None, :]  # [1 group, out=8]
    t = awq.pack_awq(codes, zeros, torch.ones(1, 8))
    assert t["qweight"].shape == (32, 1) and t["qzeros"].shape == (1, 1)
    assert {v & 0xFFFFFFFF for v in t["qweight"].flatten().tolist()} == {0x75316420}
    assert (t["qzeros"].item() & 0xFFFFFFFF) == 0xFDB9ECA8  # zeros 8..15 in the same nibble order
    assert [awq.AWQ_ORDER[j] for j in awq.AWQ_REVERSE_ORDER] == list(range(8))  # inverse permutations
    c, z = awq.unpack_awq(t["qweight"], t["qzeros"])
    assert torch.equal(c, codes) and torch.equal(z, zeros)


def _slow_awq_decode(words: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's from_linear loop read backwards, one nibble at a time → [rows, cols]."""
    rows, n = words.shape
    out = torch.zeros(rows, 8 * n, dtype=torch.uint8)
    for r, row in enumerate((words.long() % 2**32).tolist()):
        for c, word in enumerate(row):
            for k, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
                out[r, 8 * c + col] = (word >> (4 * k)) & 0xF
    return out


def test_awq_unpack_matches_slow_decode_and_roundtrips():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31, (6, 3), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(awq.unpack_awq_words(words), _slow_awq_decode(words))
    assert torch.equal(awq.pack_awq_words(awq.unpack_awq_words(words)), words)


def test_awq_packs_straight_to_int4_bytes():
    """awq_packed (no per-byte codes) equals int4.pack of the slow per-nibble decode; an AWQ
    QuantLinear carries those bytes and unpacks only when asked."""
    from lynx_edge.quant.int4 import pack

    g = torch.Generator().manual_seed(1)
    for n_in, n8 in ((32, 1), (64, 3), (2, 2)):
        words = torch.randint(-(2**31), 2**31, (n_in, n8), generator=g, dtype=torch.int64).to(torch.int32)
        assert torch.equal(awq.awq_packed(words), pack(_slow_awq_decode(words).t().contiguous())), (n_in, n8)
    zeros = torch.randint(0, 16, (2, 16), generator=g, dtype=torch.uint8)
    codes = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.uint8)
    ql = linear_from_checkpoint(awq.pack_awq(codes, zeros, torch.rand(2, 16).half()), AWQ, "m")
    assert ql._codes is None and torch.equal(ql.packed, pack(codes)) and torch.equal(ql.codes, codes)


# ------------------------------------------------------------------ fixtures decode exactly


@pytest.mark.parametrize("name", ["awq_tiny", "gptq_actorder_tiny", "gptq_mixed_tiny"])
def test_fixture_linears_decode_exactly(name):
    _, qc, tensors, expected = _fixture(name)
    assert len(expected) >= 16
    for mod, w in expected.items():
        ql = _linear(tensors, qc, mod)
        assert ql.codes.dtype == torch.uint8 and ql.scales.dtype == torch.float16 and ql.zeros.dtype == torch.uint8
        assert torch.equal(ql.dequant(torch.float32), w), mod
        assert torch.equal(ql.dequant(torch.float16), w.half()), mod


def test_awq_fixture_repacks_bit_for_bit_and_wrong_order_fails(monkeypatch):
    _, qc, tensors, expected = _fixture("awq_tiny")
    assert qc == QuantConfig("awq", 4, 32, False, False, "awq", ("mlp.gate",))
    for mod in expected:
        ql = _linear(tensors, qc, mod)
        t = awq.pack_awq(ql.codes, ql.zeros, ql.scales)
        for part in ("qweight", "qzeros", "scales"):
            assert torch.equal(t[part], tensors[f"{mod}.{part}"]), (mod, part)
    # bug injection: GPTQ-style natural nibble order must not decode AWQ words
    monkeypatch.setattr(awq, "AWQ_ORDER", tuple(range(8)))
    bad = [m for m in expected if not torch.equal(_linear(tensors, qc, m).dequant(), expected[m])]
    assert len(bad) == len(expected)


def test_awq_fixture_names_and_modules_to_not_convert():
    """AutoAWQ's substring rule: "mlp.gate" keeps the routers and the dense gate_proj 16-bit."""
    _, qc, tensors, expected = _fixture("awq_tiny")
    linears = {k.rsplit(".", 1)[0] for k in tensors
               if k.startswith("model.layers.") and k.endswith((".weight", ".qweight")) and "norm" not in k}
    for mod in linears:
        assert qc.is_quantized(mod) == (f"{mod}.qweight" in tensors) == (mod in expected), mod
    assert "model.layers.1.mlp.gate_proj.weight" in tensors and "model.layers.1.mlp.up_proj.qweight" in tensors
    assert "model.layers.0.self_attn.q_proj.qweight" in tensors and "model.layers.0.mlp.gate.weight" in tensors


# ------------------------------------------------------------------ GPTQ act-order


def test_actorder_perm_regroups_shuffled_g_idx():
    _, qc, tensors, expected = _fixture("gptq_actorder_tiny")
    assert (qc.desc_act, qc.sym, qc.zero_format) == (True, False, "gptq_v1")
    for mod in expected:
        g_idx = tensors[f"{mod}.g_idx"].long()
        n = g_idx.numel()
        assert not torch.equal(g_idx, torch.arange(n) // 32)  # really shuffled
        ql = _linear(tensors, qc, mod)
        assert ql.perm is not None and torch.equal(torch.sort(ql.perm).values, torch.arange(n))
        assert torch.equal(g_idx[ql.perm], torch.arange(n) // 32)
        # codes column j is input column perm[j]: unpermuted codes say the same
        raw = formats.unpack_qweight(tensors[f"{mod}.qweight"])
        assert torch.equal(ql.codes, raw[:, ql.perm])


def test_permute_out_absorbs_down_proj_perm_into_gate_up():
    _, qc, tensors, _ = _fixture("gptq_actorder_tiny")
    base = "model.layers.0.mlp.experts.1"
    gate, up, down = (_linear(tensors, qc, f"{base}.{m}") for m in ("gate_proj", "up_proj", "down_proj"))
    p = down.perm
    assert torch.equal(permute_out(gate, p).dequant(), gate.dequant()[p])  # exact row reorder
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    ref = (F.silu(x @ gate.dequant().t()) * (x @ up.dequant().t())) @ down.dequant().t()
    g2, u2 = permute_out(gate, p), permute_out(up, p)
    down_stored = QuantLinear(down.codes, down.scales, down.zeros, None)  # = W_down[:, p], no runtime perm
    y = (F.silu(x @ g2.dequant().t()) * (x @ u2.dequant().t())) @ down_stored.dequant().t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-7)  # fp32 summation order only
    wrong = (F.silu(x @ gate.dequant().t()) * (x @ up.dequant().t())) @ down_stored.dequant().t()
    assert (wrong - ref).abs().max() > 0.1 * ref.abs().max()  # without the absorbed perm it differs


def test_read_gptq_experts_absorbs_down_perm(tmp_path):
    """Legacy per-layer reader: gate/up plain, down act-order → same expert function."""
    _, qc, tensors, _ = _fixture("gptq_actorder_tiny")
    out = {}
    for e in range(4):
        base = f"model.layers.0.mlp.experts.{e}"
        for m in ("gate_proj", "up_proj"):  # re-store gate/up without act order (groups i // G)
            ql = _linear(tensors, qc, f"{base}.{m}")
            out[f"{base}.{m}.qweight"] = formats.pack_qweight(ql.codes[:, torch.argsort(ql.perm)])
            out[f"{base}.{m}.qzeros"] = formats.pack_qzeros(ql.zeros)
            out[f"{base}.{m}.scales"] = ql.scales
        for s in QUANT_TENSOR_SUFFIXES:
            out[f"{base}.down_proj.{s}"] = tensors[f"{base}.down_proj.{s}"]
    save_file(out, tmp_path / "model.safetensors")
    cfg = formats.GPTQConfig(32, False, True, "gptq")
    packed = formats.read_gptq_experts(tmp_path, 0, cfg=cfg)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    for e in range(4):
        base = f"model.layers.0.mlp.experts.{e}"
        qc1 = formats._as_quant_config(cfg)
        parts = {m: _linear(out, qc1, f"{base}.{m}").dequant() for m in ("gate_proj", "up_proj", "down_proj")}
        ref = (F.silu(x @ parts["gate_proj"].t()) * (x @ parts["up_proj"].t())) @ parts["down_proj"].t()
        gu, dn = packed.dequant_expert(e)
        h = F.silu(x @ gu[: gu.shape[0] // 2].t()) * (x @ gu[gu.shape[0] // 2:].t())
        torch.testing.assert_close(h @ dn.t(), ref, rtol=1e-5, atol=1e-7)


def test_bad_g_idx_is_one_line():
    _, qc, tensors, _ = _fixture("gptq_actorder_tiny")
    mod = "model.layers.0.self_attn.q_proj"
    parts = {s: tensors[f"{mod}.{s}"] for s in QUANT_TENSOR_SUFFIXES}
    parts["g_idx"] = torch.cat([torch.zeros(40), torch.ones(24)]).to(torch.int32)  # groups of 40 and 24
    with pytest.raises(ValueError) as info:
        linear_from_checkpoint(parts, qc, mod)
    _one_line(info.value, f"{mod}.g_idx", "32")


# ------------------------------------------------------------------ mixed and gptqmodel fixtures


def test_mixed_fixture_16bit_expert_and_quantized_attention_shared():
    _, qc, tensors, expected = _fixture("gptq_mixed_tiny")
    assert qc.dynamic_skip == (r"model\.layers\.1\.mlp\.experts\.2\..*",) and qc.sym
    skipped = "model.layers.1.mlp.experts.2.up_proj"
    assert f"{skipped}.weight" in tensors and not qc.is_quantized(skipped) and skipped not in expected
    for mod in ("model.layers.1.mlp.experts.1.up_proj", "model.layers.0.self_attn.q_proj",
                "model.layers.1.mlp.shared_expert.down_proj", "model.layers.0.self_attn.o_proj"):
        assert qc.is_quantized(mod) and mod in expected and f"{mod}.weight" not in tensors
    assert "model.layers.0.self_attn.q_proj.bias" in tensors  # biases stay 16-bit beside qweight
    assert all(_linear(tensors, qc, m).perm is None and _linear(tensors, qc, m).sym for m in expected)


def _slow_gptq_decode(t: dict, v1: bool) -> torch.Tensor:
    qw, qz = (t["qweight"].long() % 2**32).tolist(), (t["qzeros"].long() % 2**32).tolist()
    s, gi = t["scales"].float(), t["g_idx"].tolist()
    w = torch.zeros(len(qw[0]), 8 * len(qw))
    for i in range(8 * len(qw)):
        for o in range(len(qw[0])):
            word = (qz[gi[i]][o // 8] + (0x11111111 if v1 else 0)) % 2**32
            w[o, i] = s[gi[i], o] * (((qw[i // 8][o] >> 4 * (i % 8)) & 15) - ((word >> 4 * (o % 8)) & 15))
    return w


def test_gptqmodel_fixture_all_linears():
    """gptqmodel 7.7 fixture: experts equal gptqmodel's own dequantisation; q/k/v/o (quantized by
    gptqmodel too; no gptqmodel reference stored) equal an in-test slow decode."""
    d, qc, tensors, expected = _fixture("gptq_tiny")
    assert qc == QuantConfig("gptq", 4, 32, False, False, "gptq_v1")
    for e in range(4):
        base = f"model.layers.0.mlp.experts.{e}"
        gate, up, down = (_linear(tensors, qc, f"{base}.{m}").dequant() for m in ("gate_proj", "up_proj", "down_proj"))
        assert torch.equal(torch.cat([gate, up]), expected["layers.0.gate_up"][e])
        assert torch.equal(down, expected["layers.0.down"][e])
    for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
        mod = f"model.layers.0.self_attn.{m}"
        t = {s: tensors[f"{mod}.{s}"] for s in QUANT_TENSOR_SUFFIXES}
        assert torch.equal(linear_from_checkpoint(t, qc, mod).dequant(), _slow_gptq_decode(t, v1=True)), mod


# ------------------------------------------------------------------ configs


CONFIGS = sorted((FIX / "quant_configs").glob("*.json"))


def _write_config(tmp_path: Path, file: str, content: dict) -> dict:
    """Lay the published block out as a checkpoint would; returns the config.json dict."""
    config = {"model_type": "mixtral"}
    if file == "config.json":
        config.update(content)
    else:
        (tmp_path / file).write_text(json.dumps(content))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return config


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_published_configs(tmp_path, path):
    spec = json.loads(path.read_text())
    config = _write_config(tmp_path, spec["file"], spec["content"])
    if "error" in spec:
        with pytest.raises(QuantConfigError) as info:
            read_quant_config(tmp_path, config)
        _one_line(info.value, spec["file"], spec["error"])
        return
    qc = read_quant_config(tmp_path, config)
    got = {k: getattr(qc, k) for k in spec["expect"]}
    got["modules_to_not_convert"] = list(qc.modules_to_not_convert)
    assert qc.bits == 4 and got == {**got, **spec["expect"]}, (got, spec["expect"])


def test_16bit_checkpoint_has_no_quant_config(tmp_path):
    assert read_quant_config(tmp_path, {"model_type": "qwen3_moe"}) is None


AWQ_BLOCK = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ_BLOCK = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}


@pytest.mark.parametrize("block,field", [
    (GPTQ_BLOCK | {"bits": 8}, "bits"),
    (GPTQ_BLOCK | {"bits": 3}, "bits"),
    (GPTQ_BLOCK | {"quant_method": "bitsandbytes"}, "quant_method"),
    (GPTQ_BLOCK | {"group_size": 256}, "group_size"),
    (GPTQ_BLOCK | {"checkpoint_format": "marlin"}, "checkpoint_format"),
    (GPTQ_BLOCK | {"format": "bitblas"}, "format"),
    (GPTQ_BLOCK | {"is_marlin_format": True}, "is_marlin_format"),
    (GPTQ_BLOCK | {"pack_dtype": "int16"}, "pack_dtype"),
    (GPTQ_BLOCK | {"sym": "yes"}, "sym"),
    (GPTQ_BLOCK | {"dynamic": {r".*\.0\..*": {"group_size": 32}}}, "dynamic"),
    (AWQ_BLOCK | {"version": "gemv"}, "version"),
    (AWQ_BLOCK | {"version": "marlin"}, "version"),
    (AWQ_BLOCK | {"zero_point": False}, "zero_point"),
    (AWQ_BLOCK | {"backend": "llm-awq"}, "backend"),
    (AWQ_BLOCK | {"modules_to_not_convert": "gate"}, "modules_to_not_convert"),
    ({"bits": 4, "group_size": 128}, "quant_method"),
])
def test_bad_configs_one_line(tmp_path, block, field):
    config = _write_config(tmp_path, "config.json", {"quantization_config": block})
    with pytest.raises(QuantConfigError) as info:
        read_quant_config(tmp_path, config)
    _one_line(info.value, "config.json", f"quantization_config.{field}")


def test_unreadable_quantize_config_one_line(tmp_path):
    (tmp_path / "quantize_config.json").write_text("{bits: 4")
    with pytest.raises(QuantConfigError) as info:
        read_quant_config(tmp_path, {})
    _one_line(info.value, "quantize_config.json")


def test_gptqmodel_dynamic_negative_rules_only(tmp_path):
    block = GPTQ_BLOCK | {"dynamic": {r"-:.*experts\.3\..*": {}, r"+:.*\.1\..*": {"bits": 4}}}
    qc = read_quant_config(tmp_path, _write_config(tmp_path, "config.json", {"quantization_config": block}))
    assert qc.dynamic_skip == (r".*experts\.3\..*",)
    assert not qc.is_quantized("model.layers.0.mlp.experts.3.up_proj")
    assert qc.is_quantized("model.layers.0.mlp.experts.13.up_proj") is True


# ------------------------------------------------------------------ tensor errors


@pytest.mark.parametrize("qc,mutate,needle", [
    (GPTQ_V1, lambda t: t.pop("qzeros"), ".qzeros"),
    (GPTQ_V1, lambda t: t.update(scales=t["scales"][:1]), ".scales"),
    (GPTQ_V1, lambda t: t.update(qweight=t["qweight"].float()), ".qweight"),
    (GPTQ_V1, lambda t: t.update(g_idx=t["g_idx"][:10]), ".g_idx"),
    (GPTQ_V1, lambda t: t.update(scales=t["scales"].float() * (1 + 2**-20)), ".scales"),
    (AWQ, lambda t: t.update(qzeros=t["qzeros"][:, :1]), ".qzeros"),
])
def test_bad_tensors_one_line(qc, mutate, needle):
    codes = torch.randint(0, 16, (64, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    zeros, scales = torch.full((2, 64), 8, dtype=torch.uint8), torch.rand(2, 64).half()
    if qc.method == "awq":
        t = awq.pack_awq(codes, zeros, scales)
    else:
        t = {"qweight": formats.pack_qweight(codes), "qzeros": formats.pack_qzeros(zeros),
             "scales": scales, "g_idx": (torch.arange(64) // 32).int()}
    assert torch.equal(linear_from_checkpoint(dict(t), qc, "m").codes, codes)
    mutate(t)
    with pytest.raises(ValueError) as info:
        linear_from_checkpoint(t, qc, "model.layers.3.mlp.experts.7.up_proj")
    _one_line(info.value, "model.layers.3.mlp.experts.7.up_proj" + needle)
