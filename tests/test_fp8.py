"""Block-scaled FP8 checkpoints (quant_method "fp8", the layout of Qwen/Qwen3-30B-A3B-FP8):
the format helpers against torch's own e4m3 decoding, the config reader, loading through every
expert backend against a float reference with the same (dequantised) weights, bad files, and the
memory plan of the real Qwen3-30B-A3B-FP8 config.

The float reference: the FP8 checkpoint with every FP8 weight replaced by its exact fp32
dequantisation (quant/fp8.dequant: e4m3 → fp32 is exact, times the block scale), loaded as a
plain fp32 model. The kernel tests are in tests/test_cpu_native.py (test_fp8_*).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import make_tiny
from lynx_edge.checkpoint import LoadError
from lynx_edge.config import ConfigError
from lynx_edge.kernels import native
from lynx_edge.quant import fp8
from lynx_edge.quant.formats import read_quant_config

pytestmark = pytest.mark.usefixtures("exact_int4")  # fp32 references: the exact rows (conftest)

FIX = Path(__file__).parent / "fixtures"
PROMPT = [5, 17, 42, 99, 3, 125, 7, 8, 120, 64, 33, 2]
BLOCK = (64, 32)  # whole blocks over the tiny model's D = 128, I = 64 (the hub's are 128 × 128)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> tuple[Path, Path]:
    """(FP8 checkpoint, its float reference)."""
    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny(root / "src", "qwen3_moe", hidden_size=128, moe_intermediate_size=64, head_dim=32)
    q = fp8.write_checkpoint(src, root / "fp8", BLOCK)
    return q, float_reference(q, root / "ref")


def float_reference(src: Path, dst: Path) -> Path:
    cfg = json.loads((src / "config.json").read_text())
    block = tuple(cfg["quantization_config"]["weight_block_size"])
    tensors = {}
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for k in names:
            if k.endswith(fp8.SCALE_SUFFIX):
                continue
            t = f.get_tensor(k)
            tensors[k] = fp8.dequant_ref(t, f.get_tensor(k + fp8.SCALE_SUFFIX), block) if k + fp8.SCALE_SUFFIX in names \
                else t.float()
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _engine(path: Path, **kw):
    from lynx_edge import Engine
    from lynx_edge.engine import EngineConfig
    from lynx_edge.build import LoadOptions, load_model
    from lynx_edge.config import ModelConfig

    cfg = ModelConfig.from_file(path / "config.json")
    eng = Engine.__new__(Engine)
    eng.model, eng.cfg, eng.kv, eng.ctx = load_model(path, cfg, LoadOptions(device="cpu", dtype="float32", **kw)), cfg, None, 256
    eng.config = EngineConfig()
    eng._session = []
    return eng


def _logits(eng) -> torch.Tensor:
    """Prefill logits for every prompt position, then 4 greedy decode steps' logits."""
    from lynx_edge.step import decode_step, prefill

    kv = eng._cache(1)
    logits = prefill(eng.model, kv, 0, PROMPT, 0, logits_for="all")[0]
    out, tok = [logits], logits[-1].argmax(-1, keepdim=True)
    for _ in range(4):
        step = decode_step(eng.model, kv, [0], tok)
        out.append(step)
        tok = step.argmax(-1)
    return torch.cat([o.reshape(-1, o.shape[-1]) for o in out])


# ------------------------------------------------------------------------------------------ format
@pytest.mark.parametrize("shape,block", [((5, 70), (4, 32)), ((37, 96), (16, 32)), ((3, 256), (128, 128)),
                                         ((64, 96), (16, 32))])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_dequant_decodes_every_code_as_torch_does(shape, block, kernels, monkeypatch):
    """Every finite e4m3 byte (normals, subnormals, ±0) decodes as torch's float8_e4m3fn → fp32,
    times its block's scale (blocks that do not divide the shape are cut at the edge), bit for bit,
    by the native kernel and by the torch fallback (e4m3 → fp16 by bits)."""
    if kernels == "torch":
        monkeypatch.setattr(native, "lib", lambda: None)
    elif native.lib() is None:
        pytest.skip("native kernels not built")
    n, k = shape
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    w = codes[torch.arange(n * k) % len(codes)].view(n, k)
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 4 + 2.0**-20
    got = fp8.dequant(w, scale, block)
    want = w.view(fp8.FP8).float() * scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    assert torch.equal(got, want) and torch.equal(fp8.dequant_ref(w, scale, block), want)
    s1 = torch.ones_like(scale)
    assert fp8.dequant(w, s1, block)[0, 1].item() == 2.0**-9  # 0x01: the smallest subnormal


def test_quantize_round_trip_is_within_e4m3_precision():
    w = torch.randn(200, 300) * torch.linspace(0.01, 3, 300)
    codes, scale = fp8.quantize(w, (128, 128))
    assert codes.dtype == fp8.FP8 and scale.shape == (2, 3)
    back = fp8.dequant(codes, scale, (128, 128))
    blockmax = fp8._expand(scale * fp8.E4M3_MAX, (200, 300), (128, 128))
    assert ((back - w).abs() <= w.abs() * 2**-4 + blockmax * 2**-10).all()  # 3 mantissa bits, subnormal floor
    assert torch.isclose(back.abs().amax(), w.abs().amax(), rtol=1e-6)  # each block's max maps to 448 exactly


def test_config_reader(tmp_path):
    base = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    qc = read_quant_config(tmp_path, {"quantization_config": base})
    assert (qc.method, qc.bits, qc.weight_block) == ("fp8", 8, (128, 128))
    for bad, field in [({"fmt": "e5m2"}, "fmt"), ({"weight_block_size": None}, "weight_block_size"),
                       ({"weight_block_size": [128]}, "weight_block_size"),
                       ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
                       ({"scale_fmt": "e4m3"}, "scale_fmt")]:
        with pytest.raises(ValueError, match=field):
            read_quant_config(tmp_path, {"quantization_config": {**base, **bad}})


# ------------------------------------------------------------------------------------------- loads
@pytest.mark.skipif(native.lib() is None, reason="native kernels not built")
def test_fp8_experts_stay_8bit_on_a_cpu_and_match_the_float_reference(fp8_model):
    """Experts (Fp8MoEExperts) and q/k/v/o (Fp8Linear, q/k/v fused into one) read 8-bit by the native
    kernels; prefill past NATIVE_MAX_ROWS widens the linears' row chunks instead."""
    from lynx_edge.step import prefill

    q, ref_dir = fp8_model
    ref_eng = _engine(ref_dir)
    ref = _logits(ref_eng)
    long = PROMPT * 4  # 48 rows: the widened prefill path
    ref_long = prefill(ref_eng.model, ref_eng._cache(1), 0, long, 0, logits_for="all")[0]
    eng = _engine(q)
    experts, attn = eng.model.layers[0].mlp.experts, eng.model.layers[0].self_attn
    assert type(experts) is fp8.Fp8MoEExperts and experts.gate_up.dtype == fp8.FP8
    assert type(attn.q_proj) is fp8.Fp8Linear and type(attn.o_proj) is fp8.Fp8Linear
    assert eng.model.placement.experts == "fp8" and eng.model.placement.quant_method == "fp8"
    assert eng.model.placement.packed_linears == 8  # q, k, v, o of both layers
    got = _logits(eng)
    assert type(attn._fused()) is fp8.Fp8Linear
    long_err = (prefill(eng.model, eng._cache(1), 0, long, 0, logits_for="all")[0] - ref_long).abs().max().item()
    assert long_err < 2e-6, long_err
    err = (got - ref).abs().max().item()
    assert err < 2e-6, err  # observed 1.8e-7 (logits ~0.8): the kernel's block sums vs fp32 GEMMs, same weights
    experts.down_scale[:, 0].mul_(1.01)  # bug injection: one block row of every down projection 1% off
    assert (_logits(eng) - ref).abs().max().item() > 10 * 2e-6


@pytest.mark.parametrize("how", ["dequantised", "int4", "offload", "offload-int4"])
def test_fp8_checkpoint_through_the_other_backends(fp8_model, how, monkeypatch):
    """Without the native kernels (and on a GPU) experts are dequantised at load into the 16-bit
    backend: the float reference's logits. --int4 re-quantises the dequantised weights (RTN, as
    from a 16-bit checkpoint); offload stores them in the host store's format."""
    from lynx_edge.models.layers import StackedExperts

    q, ref_dir = fp8_model
    if how == "dequantised":  # as without a C compiler
        monkeypatch.setattr(native, "lib", lambda: None)
        eng = _engine(q)
        assert type(eng.model.layers[0].mlp.experts) is StackedExperts and eng.model.placement.experts == "fp32"
        assert type(eng.model.layers[0].self_attn.q_proj).__name__ == "Linear"
        assert (_logits(eng) - _logits(_engine(ref_dir))).abs().max().item() <= 1e-6  # observed 0.0: same weights
    elif how == "int4":
        got, want = _logits(_engine(q, int4=True)), _logits(_engine(ref_dir, int4=True))
        assert (got - want).abs().max().item() <= 1e-6  # observed 0.0: the same RTN of the same weights
    elif how == "offload-int4":  # FP8 projections dequantised into the INT4 store as they stream in
        eng = _engine(q, offload=True, int4=True)
        assert eng.model.offload.fmt.name == "int4"
        assert (_logits(eng) - _logits(_engine(ref_dir, offload=True, int4=True))).abs().max().item() <= 1e-6
    else:  # the store keeps the checkpoint's FP8 bytes (offload.store.Fp8Format)
        eng, ref = _engine(q, offload=True), _engine(ref_dir, offload=True)
        assert eng.model.offload.fmt.name == "fp8" and eng.model.placement.experts == "fp8"
        assert eng.model.offload.store.host_bytes() < 0.3 * ref.model.offload.store.host_bytes()  # fp32 reference
        got, want = _logits(eng), _logits(ref)
        assert (got - want).abs().max().item() <= 2e-6  # observed 2.4e-7: native FP8 kernel vs fp32 math


def test_offload_fp8_format_block():
    """Fp8Format's block: codes and scales land where the views read them; the device path's
    weights (dequantised) equal torch's e4m3 decoding; the CPU path (native, in place) matches the
    plain SwiGLU on them; a 16-bit projection is quantised into it."""
    from lynx_edge.kernels.moe_gemm import expert_mlp
    from lynx_edge.offload.store import Fp8Format

    D, I, block = 128, 64, (64, 32)
    fmt = Fp8Format(D, I, block)
    buf = torch.zeros(2, fmt.nbytes, dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    parts = {p: fp8.quantize(torch.randn(*((D, I) if p == "down" else (I, D)), generator=g) * 0.1, block)
             for p in ("gate", "up", "down")}
    for p, (w, sc) in parts.items():
        fmt.write_fp8_part(buf, 1, p, w, sc)
    gu, dn = fmt.weights(buf[1], torch.float32)
    want = {p: fp8.dequant_ref(w, sc, block) for p, (w, sc) in parts.items()}
    assert torch.equal(gu, torch.cat([want["gate"], want["up"]])) and torch.equal(dn, want["down"])
    assert not buf[0].any()  # expert 0 untouched
    x = torch.randn(3, D, generator=g)
    ref = expert_mlp(x, gu, dn)
    assert (fmt.compute(buf[1], x) - ref).abs().max().item() <= 2e-6 * max(1.0, ref.abs().max().item())
    with pytest.raises(ValueError, match="does not match weight_block_size"):
        fmt.write_fp8_part(buf, 0, "down", parts["down"][0], parts["down"][1][:, :1])
    fmt.write_part(buf, 0, "down", want["down"])  # FP8 values re-quantise to themselves (same block max)
    assert torch.equal(fmt.weights(buf[0], torch.float32)[1], want["down"])


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_fp8_checkpoint_of_each_family_matches_its_float_reference(family, tmp_path):
    """Mixtral's w1/w2/w3 experts, Qwen2-MoE's shared expert (an Fp8Linear MLP beside FP8 experts;
    its one-row gate stays 16-bit), OLMoE's full-width q/k norms: FP8 checkpoints of each load and
    give the float reference's logits (the kernels' rounding only)."""
    from conftest import make_tiny

    over = dict(hidden_size=128, head_dim=32)
    over.update({"mixtral": dict(intermediate_size=64), "qwen2_moe": dict(moe_intermediate_size=64,
                 shared_expert_intermediate_size=64), "olmoe": dict(intermediate_size=64)}[family])
    src = make_tiny(tmp_path / "src", family, **over)
    q = fp8.write_checkpoint(src, tmp_path / "fp8", BLOCK)
    ref = _logits(_engine(float_reference(q, tmp_path / "ref")))
    eng = _engine(q)
    if native.lib() is not None:
        assert type(eng.model.layers[0].mlp.experts) is fp8.Fp8MoEExperts
        assert eng.model.placement.packed_linears >= 8
    err = (_logits(eng) - ref).abs().max().item()
    assert err < 2e-6, err  # observed 2.1e-7 (mixtral), 1.9e-7 (qwen2_moe), 3.3e-7 (olmoe)


def test_ue8m0_scales(fp8_model, tmp_path):
    """scale_fmt "ue8m0" (DeepSeek-V3.1, GLM FP8): block scales are powers of two, stored as F8_E8M0.
    Rounding each scale to a power of two and storing it that way loads to the same logits as the
    same powers of two stored float32."""
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("torch without float8_e8m0fnu")
    q, _ = fp8_model

    def pow2(t):
        return {k: (torch.exp2(torch.round(torch.log2(v))) if k.endswith(fp8.SCALE_SUFFIX) else v) for k, v in t.items()}

    f32 = _rewrite(q, tmp_path / "f32", lambda t: t.update(pow2(t)))
    e8 = _rewrite(q, tmp_path / "e8", lambda t: t.update({k: v.to(torch.float8_e8m0fnu) for k, v in pow2(t).items()
                                                           if k.endswith(fp8.SCALE_SUFFIX)}))
    for d in (f32, e8):
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"]["scale_fmt"] = "ue8m0"
        (d / "config.json").write_text(json.dumps(cfg))
    assert torch.equal(_logits(_engine(e8)), _logits(_engine(f32)))


def test_scales_in_another_shard(fp8_model, tmp_path):
    """Published FP8 checkpoints are sharded, and a weight's scale may sit in another shard than
    the weight: every tensor is found through model.safetensors.index.json."""
    q, ref_dir = fp8_model
    d = tmp_path / "sharded"
    d.mkdir()
    for f in q.iterdir():
        if f.suffix != ".safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    with safe_open(str(q / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    scales = {k: v for k, v in tensors.items() if k.endswith(fp8.SCALE_SUFFIX)}
    rest = {k: v for k, v in tensors.items() if k not in scales}
    save_file(rest, str(d / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(scales, str(d / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in rest}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in scales}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(_logits(_engine(d)), _logits(_engine(q)))


def _rewrite(src: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copytree(src, dst)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("case,match", [
    ("no_scale", "has no .*weight_scale_inv"),
    ("bad_scale", r"does not match weight_block_size"),
    ("expert_no_scale", "has no .*weight_scale_inv|stored float8"),
    ("no_config", "no FP8 quantization_config"),
])
def test_bad_fp8_files_are_one_line_errors(fp8_model, tmp_path, case, match):
    q, _ = fp8_model
    attn = "model.layers.1.self_attn.q_proj.weight"
    expert = "model.layers.0.mlp.experts.3.up_proj.weight"

    def edit(t):
        if case == "no_scale":
            del t[attn + fp8.SCALE_SUFFIX]
        elif case == "bad_scale":
            t[attn + fp8.SCALE_SUFFIX] = t[attn + fp8.SCALE_SUFFIX][:, :1].contiguous()
        elif case == "expert_no_scale":
            del t[expert + fp8.SCALE_SUFFIX]
    d = _rewrite(q, tmp_path / case, edit)
    if case == "no_config":
        cfg = json.loads((d / "config.json").read_text())
        cfg.pop("quantization_config")
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((LoadError, ConfigError), match=match) as exc:
        _engine(d)
    assert "\n" not in str(exc.value)


def test_quantize_refuses_an_fp8_checkpoint_with_a_way_forward(fp8_model, tmp_path):
    from lynx_edge.quantize import quantize_model

    with pytest.raises(ConfigError, match="FP8 checkpoint.*--int4"):
        quantize_model(str(fp8_model[0]), tmp_path / "out", method="rtn")


# -------------------------------------------------------------------------------------------- plan
def test_plan_of_qwen3_30b_a3b_fp8():
    """The published Qwen3-30B-A3B-FP8 (its config plus the FP8 block): on a CPU the experts are
    counted at one byte per weight plus fp32 block scales; on a GPU dequantised to bf16; --int4 as
    from a 16-bit checkpoint."""
    from lynx_edge.config import ModelConfig
    from lynx_edge.offload.memory import QuantInfo, plan_memory

    raw = json.loads((FIX / "qwen3-30b-a3b" / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    quant = QuantInfo("fp8", 8, 128, True, (128, 128))
    D, I, E, L = raw["hidden_size"], raw["moe_intermediate_size"], raw["num_experts"], raw["num_hidden_layers"]
    per_expert = 3 * D * I + 4 * (2 * I // 128 * (D // 128) + D // 128 * (I // 128))
    cpu = plan_memory(cfg, device="cpu", dtype=torch.bfloat16, offload=False, int4=False, quant=quant, ctx=4096)
    assert (cpu.expert_format, cpu.expert_bytes, cpu.mode) == ("fp8", per_expert, "fp8")
    assert cpu.report()["resources"][0]["parts"]["all experts"] == L * E * per_expert  # 28.5 GiB of 30.5B params
    gpu = plan_memory(cfg, device="cuda", dtype=torch.bfloat16, offload=True, int4=False, quant=quant, ctx=4096,
                      profile="rtx4090-24gb")
    assert gpu.expert_format == "fp8" and gpu.mode == "fp8+offload"  # the store keeps the checkpoint's FP8 bytes
    resident = plan_memory(cfg, device="cuda", dtype=torch.bfloat16, offload=False, int4=False, quant=quant,
                           ctx=4096, profile="rtx4090-24gb")
    assert resident.expert_format == "bf16"  # resident on a GPU: dequantised at load
    four = plan_memory(cfg, device="cpu", dtype=torch.bfloat16, offload=False, int4=True, quant=quant, ctx=4096)
    assert four.expert_format == "int4" and four.mode == "fp8+int4"
    assert any("fp8 checkpoint" in n for n in cpu.notes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload", [False, True])
def test_fp8_checkpoint_on_cuda(fp8_model, offload):
    """On a GPU: resident experts dequantised to bf16 at load; offloaded ones kept FP8 in the host
    store and dequantised per device slot. Logits against the float reference on the same device."""
    from lynx_edge.build import LoadOptions, load_model
    from lynx_edge.config import ModelConfig
    from lynx_edge.kv_cache import KVCache
    from lynx_edge.step import prefill

    q, ref_dir = fp8_model
    out = []
    for path in (q, ref_dir):
        cfg = ModelConfig.from_file(path / "config.json")
        model = load_model(path, cfg, LoadOptions(device="cuda", dtype="float32", offload=offload and path == q))
        if path == q:
            assert model.placement.experts == ("fp8" if offload else "fp32")
        kv = KVCache(cfg, 1, 64, torch.float32, torch.device("cuda"))
        out.append(prefill(model, kv, 0, PROMPT, 0, logits_for="all")[0].float().cpu())
    assert (out[0] - out[1]).abs().max().item() < 1e-4  # TF32 / kernel order on the GPU; not measured here


def test_fp8_qwen3_next_hybrid(tmp_path):
    """Qwen3-Next (linear-attention + gated attention hybrid, shared expert, MTP tensors skipped) as
    an FP8 checkpoint: its FP8 projections land in Fp8Linear / Fp8MoEExperts or are dequantised
    where a width does not fit a block (the dense MLP's 48), and the logits are the float
    reference's."""
    from test_qwen3_next import build_next

    src = build_next(tmp_path / "src")
    q = fp8.write_checkpoint(src, tmp_path / "fp8", (32, 32))
    ref = _logits(_engine(float_reference(q, tmp_path / "ref")))
    eng = _engine(q)
    if native.lib() is not None:
        assert any(type(m) is fp8.Fp8MoEExperts for m in eng.model.modules())
        assert any(type(m) is fp8.Fp8Linear for m in eng.model.modules())
    err = (_logits(eng) - ref).abs().max().item()
    assert err < 2e-5, err  # observed 2.1e-6 on logits up to 10 (this fixture's logits are large)
