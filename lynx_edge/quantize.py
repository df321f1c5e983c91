"""`lynx-edge quantize`: GPTQ (or RTN) the experts of a checkpoint (a shared expert too) — with
`attention=True` (`--attn`) its attention q/k/v/o too, as published GPTQ checkpoints are — layer by
layer, into a GPTQ checkpoint.

`quantize_model(src, out)` never holds the model: it streams one decoder layer at a time from
the source checkpoint's mmap (in fp32), runs the calibration activations through it, GPTQ-
quantizes that layer's experts from the inputs each expert actually saw, writes the layer as its
own safetensors shard (experts as GPTQ v1 tensors, everything else copied 16-bit), frees it and
moves on; the float layer's outputs feed the next layer (as gptqmodel does without true
sequential error feedback). Memory bound, beyond one layer's weights in fp32:
    calibration hidden states   calib_tokens × D × 4 bytes (×2 while a layer runs)
    captured expert inputs      calib_tokens × top_k × D × 4 bytes (GPTQ only)
    a shared expert's Hessians  (D² + I_shared²) × 8 bytes (GPTQ only: Qwen1.5-MoE-A2.7B 0.29 GB,
                                Qwen2-57B-A14B's 20480-wide one 3.4 GB), and --attn's D² + (H·hd)² × 8
The output loads with Engine.from_pretrained as INT4 experts. Glossary: D hidden, L layers.
"""
from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .checkpoint import Checkpoint
from .config import ConfigError, ModelConfig
from .loader import _LAYER_RE, internal_name, load_weights
from .models import FAMILIES
from .models.layers import AttnBatch, Rope, RoutingContext
from .models.transformer import DecoderLayer, router_spec
from .quant.experts import group_size_for
from .quant.formats import GPTQConfig, read_quant_config
from .quant.gptq import expert_gptq_tensors, quantize_experts_gptq
from .quant.int4 import quantize_experts

_COPY = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "heldout.txt",
         "special_tokens_map.json", "tokenizer.model")


class _Capture(nn.Module):
    """Wraps a layer's experts during calibration: records each expert's inputs, then computes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.rows: dict[int, list[torch.Tensor]] = {}

    def forward(self, x, ids, weights):
        for e in ids.unique().tolist():
            tok = (ids == e).any(-1)
            self.rows.setdefault(e, []).append(x[tok].float())
        return self.inner(x, ids, weights)


class _Layers(nn.ModuleDict):
    def __getitem__(self, i):
        return super().__getitem__(str(i))


class _OneLayer(nn.Module):
    """Just decoder layer i, named as in the full model (layers.{i}.…), for loader.load_weights."""

    def __init__(self, cfg: ModelConfig, i: int, layer: DecoderLayer):
        super().__init__()
        self.layers = _Layers({str(i): layer})
        self.cfg = _Cfg([i] if cfg.moe_layers[i] else [])


class _Cfg:
    def __init__(self, moe_layer_ids):
        self.moe_layer_ids = moe_layer_ids


def check_output_dir(out: Path) -> None:
    """Fail before any work: an existing non-empty directory or an unwritable parent."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: output directory exists and is not empty")
    parent = out if out.exists() else out.parent
    while not parent.exists():
        parent = parent.parent
    probe = parent / ".lynx_write_probe"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{out}: cannot write there ({exc.strerror})") from None


def quantize_model(src, out_dir, method: str = "gptq", group_size: int = 128, sym: bool = True,
                   calib_text: str | None = None, calib_tokens: int = 16384, window: int = 256,
                   progress: Callable[[int, int], None] | None = None, attention: bool = False) -> Path:
    """src (a directory or name) → out_dir: a GPTQ-format checkpoint (v1 zeros) with INT4 experts
    and, with attention=True, INT4 q/k/v/o in every layer with plain softmax attention (q/k/v
    share one input, so GPTQ runs them as one [Nq+Nk+Nv, D] matrix over one Hessian; o_proj over
    the attention output; layers of other kinds — linear attention, MLA — keep 16-bit attention).

    Calibration text defaults to the first quarter of the model's heldout.txt (the rest is left
    for evaluation). Experts that see no calibration token fall back to RTN."""
    from .hub import resolve_model

    if method not in ("gptq", "rtn"):
        raise ValueError(f"method must be gptq or rtn, got {method!r}")
    out = Path(out_dir)
    check_output_dir(out)
    model_dir = resolve_model(src)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    qc = read_quant_config(model_dir, cfg.raw)
    if qc is not None and qc.method == "fp8":
        raise ConfigError(f"{model_dir}: an FP8 checkpoint; load it as it is (8-bit on a CPU), or with --int4 "
                          "to re-quantize its experts at load")
    if qc is not None:
        raise ConfigError(f"{model_dir}: already a 4-bit checkpoint ({qc.method.upper()})")
    family = FAMILIES[cfg.model_type]
    if getattr(family, "experts", None) is not None:  # the family's own expert math (gpt-oss), as build._backends
        fmt = family.expert_block_bytes(cfg, torch.bfloat16, True)[0] if hasattr(family, "expert_block_bytes") else None
        raise ConfigError(f"{cfg.model_type}: quantize writes GPTQ INT4 experts, which run a plain SwiGLU without "
                          "biases; this model's experts compute their own activation with biases, so it does not apply"
                          + (f" (its 4-bit format is {fmt.upper()}: load with --int4)" if fmt else ""))
    G = group_size_for(cfg.hidden_size, cfg.moe_intermediate_size, group_size)
    ckpt = Checkpoint(model_dir)
    by_layer: dict[int, list[str]] = {}
    for name in ckpt.names():
        m = _LAYER_RE.match(internal_name(name, family.RENAMES))
        by_layer.setdefault(int(m.group(1)) if m else -1, []).append(name)
    x = _calibration_states(cfg, ckpt, model_dir, calib_text, calib_tokens, window) if method == "gptq" else None
    rope = Rope(cfg, torch.device("cpu"))
    out.mkdir(parents=True, exist_ok=True)
    weight_map = _write_shard(out, "model-head.safetensors", {n: _copy16(ckpt.get(n)) for n in by_layer.get(-1, [])})
    ckpt.release(by_layer.get(-1, []))  # written: its pages leave the process (Checkpoint.release)
    naming = "mixtral" if cfg.model_type == "mixtral" else "qwen"
    for i in range(cfg.num_layers):
        layer = DecoderLayer(cfg, i, RoutingContext(router_spec(cfg)), torch.float32, torch.device("cpu"))
        load_weights(_OneLayer(cfg, i, layer), ckpt, family)
        tensors = {n: _copy16(ckpt.get(n)) for n in by_layer.get(i, []) if ".experts." not in n}
        attn = _AttnCapture(layer, G, x is not None) if attention else None
        shared = _SharedCapture(layer, G, x is not None) if cfg.moe_layers[i] else None
        if cfg.moe_layers[i]:
            ex = layer.mlp.experts
            if x is not None:
                cap = layer.mlp.experts = _Capture(ex)
                x = _run_layer(layer, x, rope, family.cache_spec(cfg, i, x.shape[1]))
                rows = cap.rows
                x_in = [torch.cat(rows[e]) if e in rows else torch.empty(0, cfg.hidden_size) for e in range(ex.num_experts)]
                packed = quantize_experts_gptq(*ex.weights(), x_in, None, G, sym)
                del rows, x_in, cap
            else:
                packed = quantize_experts(*ex.weights(), G, sym)
            tensors.update(expert_gptq_tensors(packed, i, naming))
        elif x is not None:
            x = _run_layer(layer, x, rope, family.cache_spec(cfg, i, x.shape[1]))
        if attn is not None:
            tensors = attn.quantize(tensors, by_layer.get(i, []), family, sym)
        if shared is not None:
            tensors = shared.quantize(tensors, by_layer.get(i, []), family, sym)
        weight_map.update(_write_shard(out, f"model-{i:05d}-of-{cfg.num_layers:05d}.safetensors", tensors))
        ckpt.release(by_layer.get(i, []))  # the shard's 16-bit reads re-mapped what load_weights had released
        del layer, tensors
        # the layer's modules and tensors sit in reference cycles (~800 objects a layer): without a
        # collection here they wait for the cyclic GC, and LFM2-8B-A1B's quantize climbed to 10.5 GB
        # anonymous / 15.7 GB peak RSS over 16 layers; collected, 3.1-4.5 GB and 5.5 GB (one layer's worth)
        gc.collect()
        if progress:
            progress(i + 1, cfg.num_layers)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    qc = GPTQConfig(G, sym, False, "gptq").to_json()
    (out / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")
    config = json.loads((model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}, indent=2) + "\n")
    for f in _COPY:
        if (model_dir / f).is_file():
            shutil.copy(model_dir / f, out / f)
    return out


class _LinearsCapture:
    """One layer's plain Linears of one module (PREFIX), quantized in GROUPS of parts that share an
    input: the inputs GPTQ needs (a hook on the module for the first group, on the first part of each
    other group) while the float layer runs, then the swap of their 16-bit tensors for GPTQ ones.
    Only when every part is a plain Linear whose input width the group size divides; otherwise nothing
    is captured or changed."""

    PREFIX: str = ""
    GROUPS: tuple = ()  # (key, parts)

    def __init__(self, layer: DecoderLayer, G: int, calibrate: bool):
        from .models.layers import Linear

        owner = self.owner(layer)
        lins = {p: getattr(owner, p, None) for _, parts in self.GROUPS for p in parts} if owner is not None else {}
        ok = bool(lins) and all(type(m) is Linear and m.weight.shape[1] % G == 0 for m in lins.values())
        self.lins, self.G, self.H, self.hooks = (lins if ok else {}), G, {}, []
        if ok and calibrate:
            for n, (key, parts) in enumerate(self.GROUPS):
                at = owner if n == 0 else lins[parts[0]]
                self.hooks.append(at.register_forward_pre_hook(lambda m, args, key=key: self._add(key, args[0])))

    def owner(self, layer: DecoderLayer):
        raise NotImplementedError

    def _add(self, key: str, x: torch.Tensor) -> None:
        """Accumulate Σ xᵀx in fp64 (the rows themselves are not kept) and the row count."""
        x = x.reshape(-1, x.shape[-1]).double()
        h, n = self.H.get(key, (0.0, 0))
        self.H[key] = (h + x.t() @ x, n + x.shape[0])

    def quantize(self, tensors: dict, names: list[str], family, sym: bool) -> dict:
        """tensors (the layer's 16-bit ones, checkpoint names) with the parts swapped for GPTQ tensors."""
        from .quant.gptq import gptq_quantize, gptq_tensors
        from .quant.int4 import quantize_rtn

        for h in self.hooks:
            h.remove()
        if not self.lins:
            return tensors
        for key, parts in self.GROUPS:
            w = torch.cat([self.lins[p].weight.data.float() for p in parts])  # [ΣN, in]
            if key in self.H:  # H = 2/n·Σxᵀx, as quant.gptq.hessian
                h, n = self.H[key]
                codes = gptq_quantize(w, torch.empty(0, w.shape[1]), self.G, sym, H=2.0 / max(1, n) * h)
            else:
                codes = quantize_rtn(w, self.G, sym)
            at = 0
            for p in parts:
                rows = self.lins[p].weight.shape[0]
                q, s, z = codes[0][at : at + rows], codes[1][:, at : at + rows], codes[2][:, at : at + rows]
                at += rows
                name = next(n for n in names if internal_name(n, family.RENAMES).endswith(f"{self.PREFIX}.{p}.weight"))
                del tensors[name]
                base = name[: -len(".weight")]
                tensors.update({f"{base}.{k}": t.contiguous() for k, t in gptq_tensors((q, s, z), self.G).items()})
        return tensors


class _AttnCapture(_LinearsCapture):
    """The attention's q/k/v (one input) and o_proj, for `attention=True`."""

    PREFIX, GROUPS = "self_attn", (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)))

    def owner(self, layer: DecoderLayer):
        return getattr(layer, "self_attn", None)


class _SharedCapture(_LinearsCapture):
    """A MoE layer's shared expert (Qwen2-MoE, DeepSeek): gate/up (the block's input) and down, 4-bit
    as the routed experts are and as published GPTQ checkpoints hold it; its one-row gate stays 16-bit.
    The block's native shared-expert call is switched off for the capture, so the hooks see its inputs."""

    PREFIX, GROUPS = "shared_expert", (("gu", ("gate_proj", "up_proj")), ("down", ("down_proj",)))

    def owner(self, layer: DecoderLayer):
        mlp = getattr(layer, "mlp", None)
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None:
            mlp.native_shared = lambda: None  # this throwaway float layer runs the torch path (hooked)
        return shared


def _copy16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.dtype == torch.float32 else t.clone()


def _write_shard(out: Path, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name), metadata={"format": "pt"})
    return {k: name for k in tensors}


def _calibration_states(cfg, ckpt: Checkpoint, model_dir: Path, text: str | None, tokens: int, window: int):
    """Calibration text → its embeddings, fp32 [n_windows, window, D] (the last window may be short:
    it is dropped unless it is the only one)."""
    from .tokenizer import Tokenizer

    if text is None:
        held = model_dir / "heldout.txt"
        if not held.is_file():
            raise FileNotFoundError(f"{held}: no calibration text (pass calib_text / --calib)")
        full = held.read_text(encoding="utf-8", errors="replace")
        text = full[: len(full) // 4]
    ids = Tokenizer(model_dir).encode(text, add_special_tokens=False)[:tokens]
    if len(ids) < 2:
        raise ValueError("calibration text is too short (fewer than 2 tokens)")
    n = max(1, len(ids) // window)
    w = min(window, len(ids))
    ids_t = torch.tensor(ids[: n * w]).view(n, w)
    renames = FAMILIES[cfg.model_type].RENAMES  # e.g. Qwen3.5: model.language_model.embed_tokens
    emb_name = next(k for k in ckpt.names() if internal_name(k, renames) == "embed_tokens")
    return ckpt.get(emb_name)[ids_t].float()  # [n, w, D]


@torch.inference_mode()
def _run_layer(layer: DecoderLayer, x: torch.Tensor, rope: Rope, cache_spec, rows: int = 8) -> torch.Tensor:
    """x [n, w, D] → the float layer's outputs, `rows` windows at a time (bounded KV and activations).
    cache_spec: the layer's cache shapes per row for w positions (its family's cache_spec)."""
    n, w, _ = x.shape
    out = torch.empty_like(x)
    for r0 in range(0, n, rows):
        xb = x[r0 : r0 + rows]
        B = xb.shape[0]
        pos = torch.arange(w)[None].expand(B, w)
        ab = AttnBatch(positions=pos, rows=slice(0, B), kv_len=w)
        ab.cos, ab.sin = rope.cos_sin(pos, xb.dtype, w)  # as the model forward computes them
        kv = tuple(torch.zeros(B, *shape) for shape in cache_spec)
        out[r0 : r0 + rows] = layer(xb, ab, kv, torch.zeros(B * w, dtype=torch.bool))
    return out


__all__ = ["check_output_dir", "quantize_model"]
