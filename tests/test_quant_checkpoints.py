"""Published 4-bit checkpoints through Engine.from_pretrained, against float references.

Each fixture (tests/fixtures/*_tiny) carries expected_dequant.safetensors: the float weights its
4-bit linears decode to, computed by the tool that wrote it (gptqmodel 7.7 for gptq_tiny's
experts) or by an independent slow decoder of the published format (AWQ, act-order, mixed). The
reference is a 16-bit checkpoint with those weights in place of every 4-bit linear, loaded as a
plain float model; the 4-bit load (experts kept INT4; attention / shared / dense linears kept
packed on a CPU with the native kernels, else dequantised at load) must give the same logits.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lynx_edge import Engine
from lynx_edge.engine import EngineConfig
from lynx_edge.config import ConfigError
from lynx_edge.quant.experts import Int4MoEExperts
from lynx_edge.quant.formats import linear_from_checkpoint, read_quant_config

pytestmark = pytest.mark.usefixtures("exact_int4")  # fp32 references: the exact rows (conftest)

FIX = Path(__file__).parent / "fixtures"
PROMPT = [5, 17, 42, 99, 3, 125, 7, 8, 120, 64]  # every fixture has ≥ 128 tokens


def _expected(fixture: Path, cfg: dict) -> dict[str, torch.Tensor]:
    """Linear name (without .weight) → float weight [out, in] from expected_dequant.safetensors."""
    out = {}
    with safe_open(str(fixture / "expected_dequant.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k).float()
            if k.endswith(".gate_up") or k.endswith(".down"):  # gptq_tiny: stacked per layer [E, …]
                layer = k.split(".")[1]
                base = f"model.layers.{layer}.mlp.experts"
                for e in range(t.shape[0]):
                    if k.endswith(".down"):
                        out[f"{base}.{e}.down_proj"] = t[e]
                    else:
                        half = t.shape[1] // 2
                        out[f"{base}.{e}.gate_proj"], out[f"{base}.{e}.up_proj"] = t[e, :half], t[e, half:]
            else:
                out[k] = t
    return out


def float_reference(fixture: Path, dst: Path) -> Path:
    """The fixture with every 4-bit linear replaced by its expected float weight."""
    cfg = json.loads((fixture / "config.json").read_text())
    expected = _expected(fixture, cfg)
    qc = read_quant_config(fixture, cfg)
    tensors, groups = {}, {}
    with safe_open(str(fixture / "model.safetensors"), "pt") as f:
        for k in f.keys():
            base, _, suffix = k.rpartition(".")
            if suffix in ("qweight", "qzeros", "scales", "g_idx"):
                groups.setdefault(base, {})[suffix] = f.get_tensor(k)
            else:
                tensors[k] = f.get_tensor(k).float()
    for base, parts in groups.items():
        w = expected.get(base)
        if w is None:  # gptq_tiny's attention: gptqmodel wrote no dequantised copy; our decoder
            w = linear_from_checkpoint(parts, qc, base).dequant(torch.float32)
        tensors[base + ".weight"] = w.contiguous()
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (fixture / name).is_file():
            shutil.copy(fixture / name, dst / name)
    return dst


def _logits(eng: Engine) -> torch.Tensor:
    from lynx_edge.step import prefill

    return prefill(eng.model, eng._cache(1), 0, PROMPT, 0, logits_for="all")[0]


def _engine(path: Path, **kw) -> Engine:
    from lynx_edge.build import LoadOptions, load_model
    from lynx_edge.config import ModelConfig

    cfg = ModelConfig.from_file(path / "config.json")
    model = load_model(path, cfg, LoadOptions(device="cpu", dtype="float32", **kw))

    class _Tok:  # the fixtures' tokenizers are not needed: prompts are ids
        eos_token_id = None
        chat_template = None

    eng = Engine.__new__(Engine)
    eng.model, eng.cfg, eng.kv, eng.ctx = model, cfg, None, 256
    eng.config = EngineConfig()
    eng._session = []
    return eng


@pytest.mark.parametrize("fixture", ["gptq_tiny", "awq_tiny", "gptq_mixed_tiny", "gptq_actorder_tiny"])
def test_4bit_checkpoint_matches_its_float_reference(fixture, tmp_path):
    src = FIX / fixture
    ref = _logits(_engine(float_reference(src, tmp_path / "ref")))
    eng = _engine(src)
    kinds = {type(eng.model.layers[i].mlp.experts).__name__ for i in eng.cfg.moe_layer_ids}
    assert "Int4MoEExperts" in kinds
    got = _logits(eng)
    err = (got - ref).abs().max().item()
    print(fixture, "max |Δlogit|", err)
    assert err <= 1e-6, err  # observed 0.0: the same fp32 arithmetic on the same weights
    # bug injection: one expert's scales off by one ulp-ish → the comparison must notice
    packed = next(eng.model.layers[i].mlp.experts.packed for i in eng.cfg.moe_layer_ids
                  if isinstance(eng.model.layers[i].mlp.experts, Int4MoEExperts))
    packed.gu_s.mul_(1.01)
    assert (_logits(eng) - ref).abs().max().item() > 10 * max(err, 1e-6)


@pytest.mark.parametrize("fixture", ["gptq_tiny", "awq_tiny", "gptq_mixed_tiny", "gptq_actorder_tiny"])
def test_4bit_checkpoint_on_the_default_int16_activations(fixture, tmp_path, monkeypatch):
    """The default CPU rows (int16 activations per weight group) against the float reference: off by
    the activations' rounding only (observed 1.2e-5 to 1.7e-5 in logits of ~1)."""
    from lynx_edge.kernels import native

    if native.lib() is None:
        pytest.skip("native kernels not built")
    monkeypatch.setattr(native, "INT4_ACT", None)  # the default: q16 on AVX2
    if native.default_int4_act() != "q16":
        pytest.skip("q16 is the default where it was measured faster (AVX2 without AVX-512)")
    src = FIX / fixture
    ref = _logits(_engine(float_reference(src, tmp_path / "ref")))
    err = (_logits(_engine(src)) - ref).abs().max().item()
    assert 1e-7 < err <= 5e-5, err  # really int16 (the f32 rows: 0.0, above), and within its bound


@pytest.mark.parametrize("fixture", ["gptq_tiny", "awq_tiny", "gptq_mixed_tiny", "gptq_actorder_tiny"])
def test_4bit_attention_stays_packed_on_a_cpu(fixture, tmp_path, monkeypatch):
    """q/k/v/o (and shared experts) of a 4-bit checkpoint are Int4Linear on a CPU with the native
    kernels — the fused q/k/v too — and give the float reference's logits on the kernel path
    (≤ 32 rows) and the widened prefill path; without the kernels they load dequantised, as before."""
    from lynx_edge.kernels import native
    from lynx_edge.models.layers import Linear
    from lynx_edge.quant.linear import Int4Linear
    from lynx_edge.step import prefill

    if native.lib() is None:
        pytest.skip("native kernels not built")
    src = FIX / fixture
    ref_eng = _engine(float_reference(src, tmp_path / "ref"))
    long = PROMPT * 4  # 40 rows: prefill widens row chunks instead of the kernel
    refs = [_logits(ref_eng), prefill(ref_eng.model, ref_eng._cache(1), 0, long, 0, logits_for="all")[0]]
    eng = _engine(src)
    attn = eng.model.layers[0].self_attn
    assert type(attn.q_proj) is Int4Linear and type(attn.o_proj) is Int4Linear
    assert eng.model.placement.packed_linears >= 4
    got = [_logits(eng), prefill(eng.model, eng._cache(1), 0, long, 0, logits_for="all")[0]]
    assert type(attn._fused()) is Int4Linear  # one kernel call for q, k and v
    errs = [(g - r).abs().max().item() for g, r in zip(got, refs)]
    assert max(errs) <= 1e-6, errs  # observed ≤ 3.6e-7: fp32 sums in another order
    attn.o_proj.scales.mul_(1.01)  # bug injection: the packed attention is what runs
    assert (_logits(eng) - refs[0]).abs().max().item() > 10 * max(max(errs), 1e-7)
    monkeypatch.setattr(native, "lib", lambda: None)  # no compiler: dequantised at load, as before
    plain = _engine(src)
    assert type(plain.model.layers[0].self_attn.q_proj) is Linear and plain.model.placement.packed_linears == 0
    assert (_logits(plain) - refs[0]).abs().max().item() <= 1e-6


def test_act_order_keeps_one_input_permutation_per_expert():
    eng = _engine(FIX / "gptq_actorder_tiny")
    ex = eng.model.layers[0].mlp.experts
    assert ex.x_perm is not None and ex.x_perm.shape == (ex.num_experts, ex.hidden)
    assert not torch.equal(ex.x_perm[0].long(), torch.arange(ex.hidden))  # really shuffled
    for e in range(ex.num_experts):  # each row a permutation of 0..D-1
        assert torch.equal(ex.x_perm[e].long().sort().values, torch.arange(ex.hidden))


def test_mixed_layer_keeps_its_16bit_expert_exact():
    eng = _engine(FIX / "gptq_mixed_tiny")
    p = eng.model.placement
    assert p.quant_method == "gptq" and p.dense_layers == (1,)
    assert type(eng.model.layers[1].mlp.experts).__name__ == "StackedExperts"
    assert isinstance(eng.model.layers[0].mlp.experts, Int4MoEExperts)


def test_4bit_checkpoint_offloaded_equals_resident(tmp_path):
    src = FIX / "awq_tiny"
    ref = _logits(_engine(src))
    off = _engine(src, offload=True, offload_options=dict(profile="cpu-only", expert_slots=2))
    assert off.model.offload.store.fmt.name == "int4"
    assert torch.equal(_logits(off), ref)


def test_gptq_checkpoint_offloaded_store_holds_the_resident_blocks():
    """The GPTQ bytes go into the offload store as into the resident INT4 block (same fast path)."""
    src = FIX / "gptq_tiny"
    res, off = _engine(src), _engine(src, offload=True, offload_options=dict(profile="cpu-only", expert_slots=2))
    for i in res.cfg.moe_layer_ids:
        assert torch.equal(off.model.offload.store.layers[i], res.model.layers[i].mlp.experts.packed.data)


def test_act_order_experts_offloaded_fail_in_one_line():
    from lynx_edge.loader import LoadError

    with pytest.raises(LoadError, match=r"act-order \(desc_act\) expert weights are not supported") as info:
        _engine(FIX / "gptq_actorder_tiny", offload=True, offload_options=dict(profile="cpu-only", expert_slots=2))
    msg = str(info.value)
    assert "\n" not in msg and ".mlp.experts." in msg and "model.safetensors" in msg, msg


def test_bad_quantization_config_is_one_line(tmp_path):
    dst = tmp_path / "bad"
    shutil.copytree(FIX / "awq_tiny", dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="bits") as exc:
        _engine(dst)
    assert "\n" not in str(exc.value)


def test_fp16_export_runs_bf16_on_a_cpu(tmp_path, monkeypatch):
    """A published AWQ / GPTQ export is fp16 (awq_tiny: torch_dtype float16, fp16 scales, norms and
    embeddings). Past the fp32 size rule it loads bf16 where the native kernels run, not fp16 on
    torch's ops (~10x slower there), and its logits stay within bf16 rounding of the float reference."""
    from lynx_edge import build
    from lynx_edge.kernels import native

    if native.lib() is None:
        pytest.skip("native kernels not built")
    monkeypatch.delenv("LYNX_EDGE_CPU_DTYPE", raising=False)  # the default rule, not the suite's pin
    monkeypatch.setenv("LYNX_EDGE_CPU_BF16", "0")  # a CPU without native bf16 math (this kind of box)
    monkeypatch.setattr(build, "CPU_FP32_MAX_BYTES", 0)  # as if it were a real multi-GB export
    src = FIX / "awq_tiny"
    ref = _logits(_engine(float_reference(src, tmp_path / "ref")))
    eng = Engine.from_pretrained(src, device="cpu")
    assert eng.model.embed_tokens.dtype == torch.bfloat16
    kinds = {type(eng.model.layers[i].mlp.experts).__name__ for i in eng.cfg.moe_layer_ids}
    assert kinds == {"Int4MoEExperts"}
    got = _logits(eng).float()

    def rel(x):
        return ((x - ref).abs().max() / ref.abs().max()).item()

    err = rel(got)
    print("fp16 export as bf16: max |Δlogit| / max |logit|", err)
    assert err < 1.5e-2, err  # observed 5.8e-3 (bf16 keeps 8 significant bits: 3.9e-3 per value)
    packed = next(eng.model.layers[i].mlp.experts.packed for i in eng.cfg.moe_layer_ids)
    packed.gu_s.mul_(1.25)  # one layer's gate/up scales off: the comparison must notice
    assert rel(_logits(eng).float()) > 3 * err
