"""gpt-oss (model_type "gpt_oss"): how it differs.

- Attention: q/k/v/o with biases; a learned sink logit per head joins every softmax (it takes
  probability mass, contributes no value); sliding-window (128) and full layers alternate as
  `layer_types` says; YaRN RoPE (config.parse_rope; transformers' default when the file has none).
- Router: a linear with bias (`mlp.router`), top-k on the biased logits, softmax over the selected
  ones (= softmax, top-k, renormalise: norm_topk_prob).
- Experts: biased gate_up / down, the clamped SwiGLU (kernels/moe_mxfp4.py), stored in the
  checkpoint as transformers' `gate_up_proj` [E, D, 2I] with gate/up columns interleaved and
  `down_proj` [E, I, D] (16-bit), or as published: MXFP4 `*_blocks`/`*_scales` [E, out, in/32(, 16)].
  OssExperts keeps them 16-bit or MXFP4 (never inflated: one expert is dequantised at a time).
Glossary: B batch, T tokens, D hidden, H/Hkv heads, hd head dim, S keys, E experts, I intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, check_top_k, parse_rope
from ..kernels import native
from ..kernels.moe_mxfp4 import fused_moe_oss, mxfp4_dequant, mxfp4_quantize, oss_act, oss_moe_ref, triton_ok
from ..routing import RouterSpec
from .layers import Attention, MoEBlock, _param, fp32_once
from .transformer import kv_cache_spec

MODEL_TYPE = "gpt_oss"

# transformers 5.x GptOssConfig defaults (rope_theta: the class's default_theta)
DEFAULTS = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 150000.0, "vocab_size": 201088,
            "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "sliding_window": 128, "num_experts_per_tok": 4, "num_local_experts": 128, "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0, "attention_bias": True, "layer_types": None}
# GptOssConfig.__post_init__'s rope when config.json has none
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class GptOssArch:
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    mxfp4: bool = False  # config.json quantization_config says the experts are MXFP4 on disk


def parse(c: dict, get) -> dict:
    if get("hidden_act") != "silu":
        raise ConfigError(f"hidden_act {get('hidden_act')!r} is not supported (gpt-oss: silu)")
    n, K = int(get("num_hidden_layers")), int(get("num_experts_per_tok"))
    E = int(c["num_experts"]) if c.get("num_experts") is not None else int(get("num_local_experts"))
    check_top_k(K, E)
    types = get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    window = get("sliding_window") or None
    out = dict(num_experts=E, top_k=K, moe_intermediate_size=int(get("intermediate_size")), norm_topk_prob=True,
               intermediate_size=int(get("intermediate_size")), attention_bias=bool(get("attention_bias")),
               sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
               moe_layers=(True,) * n,
               arch=GptOssArch(float(get("swiglu_limit")), float(get("swiglu_alpha")), _is_mxfp4(c)))
    if not (c.get("rope_parameters") or c.get("rope_scaling")):  # transformers' default rope is YaRN
        head_dim = int(c.get("head_dim") or get("head_dim"))
        out["rope"] = parse_rope({"rope_scaling": DEFAULT_ROPE}, get("rope_theta"), head_dim,
                                 int(get("max_position_embeddings")))
    return out


def _is_mxfp4(c: dict) -> bool:
    q = c.get("quantization_config")
    return isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "mxfp4"


# torch's CPU flash attention, which also returns each row's log-sum-exp (a private op: None without it)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class SinkAttention(Attention):
    """GQA attention whose softmax has one more logit per head: the learned sink (no value).
    Softmax over [scores, sink] then the sink's column dropped, as transformers' eager path;
    computed in query chunks so a long prefill never holds all [H, T, S] scores at once."""

    CHUNK_BYTES = 1 << 28
    BLOCK_Q = 256  # queries per masked flash call on a CPU (their keys cut to the band they see)

    def __init__(self, cfg, layer: int, dtype, device):
        super().__init__(cfg, layer, dtype, device, o_bias=cfg.attention_bias)
        self.sinks = _param(self.H, dtype=dtype, device=device)  # [H]
        self.scale = self.hd ** -0.5

    def native_sinks(self) -> torch.Tensor:
        """The sinks for the native decode kernel (the softmax below, one step per row): fp32 [H]."""
        return fp32_once(self, "_sinks32", self.sinks)[0]

    def sdpa(self, q, keys, vals, ab, T: int, attn: tuple | None = None) -> torch.Tensor:
        # q [B, H, T, hd], keys/vals [B, Hkv, S, hd] → [B, H, T, hd]
        mask, causal = attn if attn is not None else self.attend(ab, T)
        if q.device.type == "cpu" and _FLASH_CPU is not None:
            return self._flash_cpu(q, keys, vals, mask, causal)
        if causal:  # the no-mask fast path of a fresh prefill: plain causal over these T keys
            mask = ab.mask(None)
        B, S, G = q.shape[0], keys.shape[2], self.H // self.Hkv
        qg = q.view(B, self.Hkv, G, T, self.hd)
        k, v = keys[:, :, None], vals[:, :, None]  # [B, Hkv, 1, S, hd]
        sink = self.sinks.view(1, self.Hkv, G, 1, 1).float()
        step = max(1, self.CHUNK_BYTES // (4 * B * self.H * S))
        out = []
        for t0 in range(0, T, step):
            s = torch.matmul(qg[..., t0 : t0 + step, :], k.transpose(-1, -2)).float() * self.scale  # [B,Hkv,G,t,S]
            if mask is not None:
                s = s.masked_fill(~mask[:, :, None, t0 : t0 + step], float("-inf"))
            logits = torch.cat([s, sink.expand(*s.shape[:-1], 1)], dim=-1)
            p = torch.softmax(logits, dim=-1)[..., :-1]
            out.append(torch.matmul(p.to(v.dtype), v))
        return torch.cat(out, dim=3).view(B, self.H, T, self.hd)

    def _flash_cpu(self, q, keys, vals, mask, causal: bool) -> torch.Tensor:
        """The CPU path: torch's flash kernel in fp32 (no [T, S] scores held; 3-5x the chunked
        matmuls above at 256-1024 tokens, and their 16-bit bmm ran at ~3 GFLOP/s without native bf16:
        70% of a 256-token gpt-oss-20b prefill), the sinks folded in after it: it returns each row's
        log-sum-exp L of the scores, and e^sink in the softmax's denominator scales the row's output by
        1 / (1 + e^(sink - L)) = sigmoid(L - sink). fp32 as the native decode kernel computes."""
        B, _, T, _ = q.shape
        G, S, q32 = self.H // self.Hkv, keys.shape[2], q.float()
        k = keys.float().repeat_interleave(G, 1)  # [B, H, S, hd]: the op takes no grouped heads
        v = vals.float().repeat_interleave(G, 1)
        if mask is None:
            out, lse = _FLASH_CPU(q32, k, v, 0.0, causal, scale=self.scale)
        else:  # an additive fp32 mask (what the op takes), a block of queries at a time over the keys
            # any of them sees (a window layer's band: ≤ BLOCK_Q + window keys, not all S)
            step, outs = max(1, min(self.BLOCK_Q, self.CHUNK_BYTES // (4 * B * S))), []
            for t0 in range(0, T, step):
                m = mask[:, :, t0 : t0 + step]
                seen = m.reshape(-1, m.shape[-1]).any(0).nonzero()
                lo, hi = (int(seen[0]), int(seen[-1]) + 1) if len(seen) else (0, S)
                m = m[..., lo:hi]
                add = torch.zeros(m.shape, dtype=torch.float32).masked_fill_(~m, float("-inf"))
                outs.append(_FLASH_CPU(q32[:, :, t0 : t0 + step], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, False,
                                       attn_mask=add, scale=self.scale))
            out, lse = (torch.cat([o[i] for o in outs], dim=2) for i in (0, 1))
        keep = torch.sigmoid(lse.view(B, self.H, T) - self.native_sinks().view(1, -1, 1))  # [B, H, T]
        return (out * keep[..., None]).to(q.dtype)


class OssTensorReader:
    """gpt-oss's stacked expert tensors of one layer → per-expert calls on a sink: load_part(e, part,
    w [out, in]) for 16-bit weights, load_mx_part(e, part, blocks [out, in/32, 16], scales [out, in/32])
    for MXFP4 ones, load_bias(e, part, b [out]); part gate | up | down. The checkpoint interleaves
    gate/up (even rows / columns gate); every call gets them apart, so a sink never sees the layout.
    The resident OssExperts and the offload store are both sinks of it."""

    def __init__(self, E: int, D: int, I: int):
        self.E, self.D, self.I = E, D, I
        self._pending: dict[str, torch.Tensor] = {}  # a *_blocks tensor waiting for its *_scales
        self._biases: set[str] = set()

    def load_tensor(self, sink, name: str, w: torch.Tensor) -> set[tuple[int, str]]:
        """A checkpoint tensor `mlp.experts.<name>` → sink; → the (expert, part)s completed."""
        E, D, I = self.E, self.D, self.I
        done: set[tuple[int, str]] = set()
        if name in ("gate_up_proj_bias", "down_proj_bias"):
            gu = name == "gate_up_proj_bias"
            _check(name, w, (E, 2 * I) if gu else (E, D))
            for e in range(E):
                if gu:
                    sink.load_bias(e, "gate", w[e, 0::2])
                    sink.load_bias(e, "up", w[e, 1::2])
                else:
                    sink.load_bias(e, "down", w[e])
            self._biases.add(name)
        elif name in ("gate_up_proj", "down_proj"):  # transformers' 16-bit layout [E, in, out]
            gu = name == "gate_up_proj"
            _check(name, w, (E, D, 2 * I) if gu else (E, I, D))
            for e in range(E):
                if gu:
                    sink.load_part(e, "gate", w[e, :, 0::2].T)
                    sink.load_part(e, "up", w[e, :, 1::2].T)
                    done |= {(e, "gate"), (e, "up")}
                else:
                    sink.load_part(e, "down", w[e].T)
                    done.add((e, "down"))
        elif name.endswith(("_blocks", "_scales")):
            base, kind = name.rsplit("_", 1)
            if base not in ("gate_up_proj", "down_proj"):
                raise ValueError(f"unknown gpt-oss expert tensor {name}")
            self._pending[kind] = w
            if "blocks" in self._pending and "scales" in self._pending:
                done = self._mx_pair(sink, base, self._pending.pop("blocks"), self._pending.pop("scales"))
        else:
            raise ValueError(f"unknown gpt-oss expert tensor {name}")
        return done

    def _mx_pair(self, sink, base: str, blocks: torch.Tensor, scales: torch.Tensor) -> set[tuple[int, str]]:
        E, D, I = self.E, self.D, self.I
        rows, cols = (2 * I, D) if base == "gate_up_proj" else (D, I)
        _check(base + "_blocks", blocks, (E, rows, cols // 32, 16))
        _check(base + "_scales", scales, (E, rows, cols // 32))
        done = set()
        for e in range(E):
            if base == "down_proj":
                sink.load_mx_part(e, "down", blocks[e], scales[e])
                done.add((e, "down"))
            else:  # interleaved rows: even = gate, odd = up
                sink.load_mx_part(e, "gate", blocks[e, 0::2], scales[e, 0::2])
                sink.load_mx_part(e, "up", blocks[e, 1::2], scales[e, 1::2])
                done |= {(e, "gate"), (e, "up")}
        return done

    def finish(self) -> None:
        missing = {"gate_up_proj_bias", "down_proj_bias"} - self._biases
        if missing or self._pending:
            what = sorted(missing) or [f"the *_scales/*_blocks partner of {sorted(self._pending)}"]
            raise ValueError(f"gpt-oss experts: missing tensor(s) {', '.join(what)}")


class OssExperts(nn.Module):
    """gpt-oss's experts of one layer, resident: the expert backend and its own load sink.

    Weights 16-bit (gate_up [E, 2I, D], down [E, D, I]) or MXFP4 (bytes [E, out, in/2], e8m0
    scales [E, out, in/32]); biases in the model dtype. gate/up rows are de-interleaved at load
    (rows [:I] gate, [I:] up) — a row permutation, exact for MXFP4 too. A 16-bit checkpoint loads
    into MXFP4 storage by round-to-nearest (`--int4` on gpt-oss), an MXFP4 one into 16-bit
    storage by exact dequantisation.
    """

    def __init__(self, E: int, D: int, I: int, dtype, device, limit: float, alpha: float, mxfp4: bool = False,
                 act: str | None = None):
        super().__init__()
        if mxfp4 and (D % 32 or I % 32):
            raise ConfigError(f"MXFP4 experts need hidden ({D}) and intermediate ({I}) sizes divisible by 32")
        self.num_experts, self.hidden, self.inter, self.dtype = E, D, I, dtype
        self.limit, self.alpha, self.mxfp4 = limit, alpha, mxfp4
        self.act = act  # the MXFP4 rows' CPU activations: f32 | q16 | q8 (native.moe_oss); None: the default
        if mxfp4:
            u8 = torch.uint8
            self.gate_up = _param(E, 2 * I, D // 2, dtype=u8, device=device)  # [E, 2I, D/2] e2m1 pairs
            self.gate_up_scales = _param(E, 2 * I, D // 32, dtype=u8, device=device)
            self.down = _param(E, D, I // 2, dtype=u8, device=device)  # [E, D, I/2]
            self.down_scales = _param(E, D, I // 32, dtype=u8, device=device)
        else:
            self.gate_up = _param(E, 2 * I, D, dtype=dtype, device=device)  # [E, 2I, D]
            self.down = _param(E, D, I, dtype=dtype, device=device)  # [E, D, I]
        self.gate_up_b = _param(E, 2 * I, dtype=dtype, device=device)  # [E, 2I]
        self.down_b = _param(E, D, dtype=dtype, device=device)  # [E, D]
        self.reader = OssTensorReader(E, D, I)

    def extra_repr(self) -> str:
        return f"E={self.num_experts}, D={self.hidden}, I={self.inter}, {'mxfp4' if self.mxfp4 else self.dtype}"

    @property
    def four_bit(self) -> bool:
        return self.mxfp4

    # -- load sink (the reader calls load_part / load_mx_part / load_bias) -----------------------
    def _rows(self, part: str, e: int):
        I = self.inter
        rows = slice(0, I) if part == "gate" else slice(I, 2 * I) if part == "up" else slice(None)
        if part == "down":
            return self.down.data[e], (self.down_scales.data[e] if self.mxfp4 else None)
        return self.gate_up.data[e, rows], (self.gate_up_scales.data[e, rows] if self.mxfp4 else None)

    def load_part(self, e: int, part: str, w: torch.Tensor) -> None:
        """One 16-bit projection w [out, in] (part gate | up | down)."""
        dst, scales = self._rows(part, e)
        if scales is None:
            dst.copy_(w)
            return
        blocks, s = mxfp4_quantize(w.to(dst.device))
        dst.copy_(blocks.flatten(-2))
        scales.copy_(s)

    def load_mx_part(self, e: int, part: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """One MXFP4 projection: blocks [out, in/32, 16], scales [out, in/32]."""
        dst, dst_s = self._rows(part, e)
        if dst_s is None:  # 16-bit storage: exact dequantisation
            dst.copy_(mxfp4_dequant(blocks, scales, torch.float32))
        else:
            dst.copy_(blocks.flatten(-2))
            dst_s.copy_(scales)

    def load_bias(self, e: int, part: str, b: torch.Tensor) -> None:
        """One projection's bias b [out]."""
        I = self.inter
        dst = self.down_b.data[e] if part == "down" else self.gate_up_b.data[e, :I] if part == "gate" \
            else self.gate_up_b.data[e, I:]
        dst.copy_(b)

    def load_tensor(self, name: str, w: torch.Tensor) -> set[tuple[int, str]]:
        return self.reader.load_tensor(self, name, w)

    def finish_load(self) -> None:
        self.reader.finish()

    def export_to(self, sink) -> None:
        """Every expert into another sink (the offload store), as held: MXFP4 bytes stay MXFP4."""
        for e in range(self.num_experts):
            for part in ("gate", "up", "down"):
                dst, scales = self._rows(part, e)
                if scales is None:
                    sink.load_part(e, part, dst)
                else:
                    sink.load_mx_part(e, part, dst.unflatten(-1, (-1, 16)), scales)
                I = self.inter
                b = self.down_b[e] if part == "down" else self.gate_up_b[e, :I] if part == "gate" else self.gate_up_b[e, I:]
                sink.load_bias(e, part, b)

    # -- compute --------------------------------------------------------------------------------
    def expert(self, e: int, dtype) -> tuple[torch.Tensor, ...]:
        """(gate_up [2I, D], gate_up_bias [2I], down [D, I], down_bias [D]) of expert e in dtype."""
        if self.mxfp4:
            gu = mxfp4_dequant(self.gate_up[e].unflatten(-1, (-1, 16)), self.gate_up_scales[e], dtype)
            dn = mxfp4_dequant(self.down[e].unflatten(-1, (-1, 16)), self.down_scales[e], dtype)
        else:
            gu, dn = self.gate_up[e].to(dtype), self.down[e].to(dtype)
        return gu, self.gate_up_b[e].to(dtype), dn, self.down_b[e].to(dtype)

    def forward(self, x, ids, weights):  # x [N, D], ids/weights [N, K] → [N, D]
        if triton_ok(x, self.hidden, self.inter) and (self.mxfp4 or self.gate_up.dtype == x.dtype):
            sc = dict(gu_scales=self.gate_up_scales, dn_scales=self.down_scales) if self.mxfp4 else {}
            return fused_moe_oss(x, ids, weights, self.gate_up, self.gate_up_b, self.down, self.down_b,
                                 self.limit, self.alpha, **sc)
        if x.device.type == "cpu" and (native.lib() is not None if self.mxfp4 else
                                       native.dense_ok(self.gate_up, self.down)):
            # one native call: MXFP4 codes decoded in registers (no expert widened per step)
            gb, db = self._biases32()
            sc = dict(gate_up_scales=self.gate_up_scales, down_scales=self.down_scales) if self.mxfp4 else {}
            return native.moe_oss(x, ids, weights, self.gate_up, self.down, gb, db, self.limit, self.alpha, **sc,
                                  act=self.act)
        return oss_moe_ref(x, ids, weights, self.num_experts, lambda e: self.expert(e, x.dtype),
                           self.limit, self.alpha)

    def native_moe(self):
        """(native.MoeLayer, max slots) for the native decode layer (models/native_layer.py): the
        arguments forward's moe_oss call passes, so the layer call computes the same; (None, 0) where
        that call would not run (no kernels, another device, a 16-bit dtype the kernels do not read).
        The fp32 biases the plan points into stay on self (_biases32)."""
        mx = self.mxfp4
        on_cpu = native.lib() is not None and self.gate_up.device.type == "cpu"
        if not on_cpu or not (mx or native.dense_ok(self.gate_up, self.down)):
            return None, 0
        gb, db = self._biases32()
        plan = native.MoeLayer(native.FMT_MXFP4 if mx else native._FMT[self.gate_up.dtype], None, self.num_experts,
                               1 if mx else self.gate_up.element_size(), None, None, self.gate_up.data_ptr(),
                               self.down.data_ptr(), 0, 0, self.hidden, self.inter,
                               native.act_code(self.act) if mx else 0,
                               self.gate_up_scales.data_ptr() if mx else None,
                               self.down_scales.data_ptr() if mx else None, stream=1, gub=gb.data_ptr(),
                               dnb=db.data_ptr(), act_kind=1, limit=float(self.limit), alpha=float(self.alpha))
        return plan, 1 << 30

    def _biases32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 copies of the biases for the native kernel."""
        return fp32_once(self, "_b32", self.gate_up_b, self.down_b)


def _check(name: str, w: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(w.shape) != want:
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {want}")


def experts(cfg, layer: int, dtype, device, four_bit: bool = False, act: str | None = None) -> OssExperts:
    """The resident backend the builder asks this family for: MXFP4 when the checkpoint is (kept
    as published) or when 4-bit was asked for, else 16-bit in the model dtype. act: the MXFP4 rows'
    CPU activations (the engine's int4_act)."""
    a = cfg.arch
    return OssExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, device,
                      a.swiglu_limit, a.swiglu_alpha, mxfp4=a.mxfp4 or four_bit, act=act)


def expert_block_bytes(cfg, dtype, four_bit: bool) -> tuple[str, int]:
    """(format, bytes of one expert) as OssExperts holds it: MXFP4 is in/2 bytes + in/32 scales per
    row; biases [2I + D] in the model dtype either way."""
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    bias = (2 * I + D) * dtype.itemsize
    if cfg.arch.mxfp4 or four_bit:
        return "mxfp4", 3 * D * I * 17 // 32 + bias
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    return name, 3 * D * I * dtype.itemsize + bias


def expert_store(cfg, dtype, four_bit: bool = False) -> dict:
    """How an offload store holds and runs these experts without knowing the family: weights
    "mxfp4" or the 16-bit dtype's name (as OssExperts would hold them), biases, the activation
    over [gate | up] rows → [n, I], and a reader of one layer's checkpoint tensors (OssTensorReader:
    it calls the store sink's load_part / load_mx_part / load_bias)."""
    a = cfg.arch
    return dict(weights=expert_block_bytes(cfg, dtype, four_bit)[0],
                act=partial(oss_act, limit=a.swiglu_limit, alpha=a.swiglu_alpha),
                reader=partial(OssTensorReader, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size))


def attention(cfg, i: int, dtype, device) -> SinkAttention:
    return SinkAttention(cfg, i, dtype, device)


def mlp(cfg, i: int, ctx, dtype, device, backends=None) -> MoEBlock:
    # without the builder (e.g. counting parameters on meta): 16-bit storage, one element per weight
    a = cfg.arch
    backend = backends(i) if backends else OssExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                                      dtype, device, a.swiglu_limit, a.swiglu_alpha)
    return MoEBlock(cfg, i, ctx, dtype, device, backend, router_bias=True)


def router_spec(cfg) -> RouterSpec:
    """top-k on the biased logits, softmax over the k selected = softmax → top-k → renormalise."""
    return RouterSpec(cfg.num_experts, cfg.top_k, True)


cache_spec = kv_cache_spec

RENAMES = ((".mlp.router.", ".mlp.gate."),)
EXPERT_PARTS: dict[str, str] = {}  # no per-expert tensors: OssExperts.load_tensor reads the stacked ones
