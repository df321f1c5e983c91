"""`int4_attn` (`--int4-attn`): a 16-bit checkpoint's attention (and a family's other token mixers'
projections: LFM2's short convolutions) and dense projections quantised to INT4 at load on a CPU
(RTN, symmetric, the --int4 group), read packed by the native kernels.

Reference: the same checkpoint with each of those weights replaced by its RTN dequantisation
(quant.int4: the exact values the INT4 codes decode to), loaded as a plain float model with the
same --int4 experts: the logits must agree to the kernels' fp32 rounding.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import decode_logits, tiny_with_reference
from lynx_edge.kernels import native
from lynx_edge.quant.int4 import dequant, pack, quantize_rtn

pytestmark = [pytest.mark.skipif(native.lib() is None, reason="native kernels not built (no C compiler)"),
              pytest.mark.usefixtures("exact_int4")]  # fp32 references: the exact rows (conftest)
G = 32
PROMPT = [5, 17, 42, 99, 3, 125, 7, 8, 120, 64, 33, 2]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """(16-bit checkpoint, its reference with every attention projection RTN-dequantised)."""
    def attn_rtn(t):
        for k in t:
            if k.endswith(tuple(f"{p}.weight" for p in PROJ)):
                codes, s, z = quantize_rtn(t[k], G, sym=True)
                t[k] = dequant(pack(codes), s, z, G)

    return tiny_with_reference(tmp_path_factory.mktemp("i4a"), attn_rtn)


def _logits(path: Path, **kw) -> tuple[torch.Tensor, object]:
    return decode_logits(path, PROMPT, int4=True, int4_group=G, **kw)


def test_int4_attention_matches_its_rtn_reference(pair):
    src, ref_dir = pair
    ref, ref_eng = _logits(ref_dir)
    got, eng = _logits(src, int4_attn=True)
    attn = eng.model.layers[0].self_attn
    assert type(attn.q_proj).__name__ == "Int4Linear" and attn.q_proj.group_size == G
    assert eng.model.placement.packed_linears == 8 and type(ref_eng.model.layers[0].self_attn.q_proj).__name__ == "Linear"
    err = (got - ref).abs().max().item()
    assert err < 2e-6, err  # observed 6.0e-7: the INT4 linear kernel vs fp32 GEMMs on the same values
    plain, _ = _logits(src)  # without the flag: attention 16-bit, logits differ by the quantisation
    assert (plain - ref).abs().max().item() > 100 * 2e-6


def _family_checkpoint(family: str, root: Path) -> Path:
    if family == "lfm2_moe":
        from lfm2_tiny import make_lfm2_moe

        return make_lfm2_moe(root, conv_bias=True, num_dense_layers=1)  # biased projections, a dense MLP
    if family == "gpt_oss":
        from test_gpt_oss import build

        return build(root)
    if family.startswith("deepseek_v2"):  # V2-Lite's q_proj, or V2's low-rank q_a_proj → q_b_proj
        from test_deepseek_v2 import build

        return build(root, **({"q_lora_rank": 32} if family.endswith("lora") else {}))
    if family == "qwen3_next":
        from test_qwen3_next import build_next

        return build_next(root)
    from conftest import make_tiny

    return make_tiny(root, family)


# every projection int4_attn makes INT4 in each family's tiny checkpoint (module class → names)
FAMILY_INT4 = {
    "lfm2_moe": {"ShortConv": ("in_proj", "out_proj"), "Attention": PROJ, "DenseMLP": ("gate_proj", "up_proj", "down_proj")},
    "olmoe": {"OlmoeAttention": PROJ},
    "gpt_oss": {"SinkAttention": PROJ},
    "qwen3_next": {"GatedAttention": PROJ, "DenseMLP": ("gate_proj", "up_proj", "down_proj")},
    "deepseek_v2": {"MLAttention": ("q_proj", "kv_a_proj_with_mqa", "o_proj"),
                    "DenseMLP": ("gate_proj", "up_proj", "down_proj")},
    "deepseek_v2_lora": {"MLAttention": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"),
                         "DenseMLP": ("gate_proj", "up_proj", "down_proj")},
}


# observed: lfm2_moe 2.0e-5 (logits to 4.6), gpt_oss 1.3e-5 (a prompt position whose sums the sinks'
# softmax sharpens), olmoe 4.2e-7, qwen3_next 4.1e-6 (logits to 10), deepseek_v2 2.5e-7, its lora 2.1e-7
TOL = {"lfm2_moe": 4e-5, "gpt_oss": 2.5e-5, "olmoe": 2e-6, "qwen3_next": 1e-5, "deepseek_v2": 1e-6,
       "deepseek_v2_lora": 1e-6}


@pytest.mark.parametrize("family", sorted(FAMILY_INT4))
def test_family_projections_match_their_rtn_reference(family, tmp_path):
    """A family's own token mixers' projections (LFM2's short convolutions; OLMoE's, gpt-oss's and
    Qwen3-Next's attention subclasses; DeepSeek's MLA but its kv_b_proj, which the absorbed path
    reads itself) and its dense MLPs are INT4 under int4_attn (those whose inputs split into
    groups), and the logits are those of the float model whose same weights hold their RTN
    dequantisation (set in the reference engine before its first step), to the kernels' fp32
    rounding (the INT4 kernel's sums against fp32 GEMMs', through a few layers). Linear attention,
    routers and the head stay 16-bit."""
    from lynx_edge.models.layers import Linear
    from lynx_edge.quant.linear import Int4Linear

    path = _family_checkpoint(family, tmp_path / family)
    plain, plain_eng = decode_logits(path, PROMPT, int4_group=G)
    want = {f"{n}.{leaf}" for n, m in plain_eng.model.named_modules()
            for leaf in FAMILY_INT4[family].get(type(m).__name__, ()) if getattr(m, leaf).weight.shape[1] % G == 0}
    assert {type(plain_eng.model.get_submodule(n.rpartition(".")[0])).__name__ for n in want} == set(FAMILY_INT4[family])
    got, eng = decode_logits(path, PROMPT, int4_attn=True, int4_group=G)
    made = {n for n, m in eng.model.named_modules() if type(m) is Int4Linear}
    assert made == want and eng.model.placement.packed_linears == len(want)

    def rtn(ref_eng):
        mods = dict(ref_eng.model.named_modules())
        with torch.no_grad():
            for n in made:
                w = mods[n].weight
                assert type(mods[n]) is Linear
                codes, s, z = quantize_rtn(w, G, sym=True)
                w.copy_(dequant(pack(codes), s, z, G))

    ref, _ = decode_logits(path, PROMPT, prepare=rtn, int4_group=G)
    err = (got - ref).abs().max().item()
    assert err < TOL[family], err
    assert (plain - ref).abs().max().item() > 100 * TOL[family]  # the check sees the quantisation


def test_group_halves_where_it_does_not_divide(tmp_path):
    """hidden 96 (as gpt-oss's 2880 is no multiple of 128): q/k/v over 96 inputs take groups of 32 where
    --int4-group asks 128, o_proj over 128 inputs keeps 128; the logits are the RTN reference's at those
    groups. The rule itself: halvings down to 32, else 16-bit."""
    from lynx_edge.models.layers import rtn_group
    from lynx_edge.quant.linear import Int4Linear
    from conftest import make_tiny

    assert [rtn_group(n, 128) for n in (4096, 2880, 96, 48, 130)] == [128, 64, 32, 0, 0]
    path = make_tiny(tmp_path / "h96", "qwen3_moe", hidden_size=96, head_dim=32)
    got, eng = decode_logits(path, PROMPT, int4_attn=True, int4_group=128)
    attn = eng.model.layers[0].self_attn
    assert [getattr(attn, p).group_size for p in PROJ] == [32, 32, 32, 128]
    groups = {n: m.group_size for n, m in eng.model.named_modules() if type(m) is Int4Linear}

    def rtn(ref_eng):
        mods = dict(ref_eng.model.named_modules())
        with torch.no_grad():
            for n, g in groups.items():
                codes, s, z = quantize_rtn(mods[n].weight, g, sym=True)
                mods[n].weight.copy_(dequant(pack(codes), s, z, g))

    ref, _ = decode_logits(path, PROMPT, prepare=rtn)
    err = (got - ref).abs().max().item()
    assert err < 2e-6, err  # observed 8.3e-7


def test_int4_attn_bad_shape_is_one_line(pair, tmp_path):
    """A weight of the wrong shape fails the load with one line naming the tensor."""
    from lynx_edge import Engine
    from lynx_edge.checkpoint import LoadError

    src, _ = pair
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    name = "model.layers.1.self_attn.o_proj.weight"
    t[name] = t[name][:, :64].contiguous()
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LoadError, match="o_proj.weight") as exc:
        Engine.from_pretrained(bad, device="cpu", dtype="float32", int4=True, int4_group=G, int4_attn=True)
    assert "\n" not in str(exc.value)


def test_cli_flag_reaches_the_engine():
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app
    from lynx_edge.cli.common import engine_options

    assert engine_options(int4=True, int4_attn=True)["int4_attn"] is True
    assert "int4_attn" not in engine_options(int4=True)
    for cmd in ("chat", "bench", "serve"):
        assert "--int4-attn" in CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "200"}).output


@pytest.mark.parametrize("family", ["lfm2_moe", "olmoe", "gpt_oss"])
def test_memory_plan_counts_the_flags_as_built(family, tmp_path):
    """`info --int4-attn --int8-head` and the pre-load memory check count the non-expert weights
    (offload/memory.non_expert_bytes, on the meta device) as a built engine holds them: every weight
    outside the routed experts, the packed projections (codes and fp16 group scales; gpt-oss's hidden
    2880 in groups of 64 where --int4-group does not divide it) and the int8 head with its row scales
    — an untied lm_head's 16-bit weight freed, LFM2's tied one kept as the embedding."""
    from lynx_edge import Engine
    from lynx_edge.offload.memory import non_expert_bytes

    path = _family_checkpoint(family, tmp_path / family)
    group = 128 if family == "gpt_oss" else G
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", int4_attn=True, int8_head=True,
                                 int4_group=group)
    from lynx_edge.quant.linear import Int4Linear

    m = eng.model
    held = {t.data_ptr(): t for n, t in m.named_parameters() if ".mlp.experts." not in n}
    held |= {t.data_ptr(): t for mod in m.modules() if type(mod) is Int4Linear for t in (mod.packed, mod.scales)}
    built = sum(t.nbytes for t in held.values()) + sum(t.nbytes for t in m.head_int8)
    plain = non_expert_bytes(eng.cfg, 2)
    assert non_expert_bytes(eng.cfg, 2, int4_attn=True, int8_head=True, group=group) == built < plain
