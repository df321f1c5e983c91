"""Checkpoint → model in one pass: each tensor streams from the mmap straight to its final home.

The model is built without expert weights (its MoE blocks hold expert *sinks* chosen at build
time: resident 16-bit, resident INT4, or the offload store). `load_weights` walks the checkpoint
in file order and sends
  - non-expert tensors into their parameters (on the device, cast to the model dtype);
  - expert projections to `block.experts.load_part(e, part, w)` (w [out, in], a view of the
    mmap) — the sink packs it (copy, RTN INT4, or into the pinned store) and nothing else of the
    16-bit expert is kept;
  - 4-bit linears (GPTQ / AWQ: qweight, qzeros, scales[, g_idx]) to
    `block.experts.load_quant_part(e, part, QuantLinear)` for experts; attention / shared-expert /
    dense-MLP ones to `module.load_quant(QuantLinear)` where the build kept them packed (a CPU with
    the native kernels: quant/linear.Int4Linear), else dequantised into the 16-bit parameter;
  - 16-bit attention / dense weights to `load_dense` where the build made them INT4 (`int4_attn`:
    RTN-quantised as they arrive);
  - FP8 weights (`<name>.weight` e4m3 beside `<name>.weight_scale_inv`, quant/fp8.py) to
    `load_fp8_part(e, part, w, scale)` where the expert sink keeps them 8-bit, else dequantised
    (fp32, exact) and sent on as a 16-bit tensor would be.
Names understood: on-disk per-expert (`experts.{e}.w1/w2/w3`, `experts.{e}.gate_proj/up_proj/
down_proj`) and transformers' fused (`experts.gate_up_proj` [E, 2I, D], `experts.down_proj`
[E, D, I]). Missing or wrong-shape tensors raise LoadError naming them.
"""
from __future__ import annotations

import re
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable

import torch

from .checkpoint import Checkpoint, LoadError, TensorRef
from .quant import fp8

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)

QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.(weight|qweight|qzeros|scales|g_idx)$")
_FUSED_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_QUANT_RE = re.compile(r"^(.*)\.(qweight|qzeros|scales|g_idx)$")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
_OWN_RE = re.compile(r"^(.*\.mlp\.experts)\.(\w+)$")  # stacked tensors a backend reads itself (load_tensor)


def internal_name(name: str, renames) -> str:
    """A checkpoint name → this runtime's parameter name (family renames, no `model.` prefix)."""
    for old, new in renames:
        name = name.replace(old, new)
    if name.startswith("model."):
        name = name[len("model."):]
    return "embed_tokens" if name == "embed_tokens.weight" else name


def _ignored(n: str, family) -> bool:
    """Tensors a family deliberately does not run (its IGNORED prefixes: e.g. multi-token-prediction
    heads or a vision tower), whatever their form: skipped before any expert-name matching."""
    return n.startswith(getattr(family, "IGNORED", ()))


def expert_storage(ckpt: Checkpoint, family) -> dict[int, set[str]]:
    """layer → how its experts are stored: {"dense"} / {"quant"} / both (a mixed layer)."""
    kinds: dict[int, set[str]] = defaultdict(set)
    for name in ckpt.names():
        n = internal_name(name, family.RENAMES)
        if _ignored(n, family):
            continue
        m = _EXPERT_RE.match(n)
        if m and m.group(3) in family.EXPERT_PARTS:
            kinds[_layer_of(m.group(1))].add("dense" if m.group(4) == "weight" else "quant")
        elif _FUSED_RE.match(n):
            kinds[_layer_of(n)].add("dense")
    return dict(kinds)


def packed_linears(ckpt: Checkpoint, family) -> set[str]:
    """Internal module names of the non-expert linears the checkpoint stores 4-bit (qweight)."""
    out = set()
    for name in ckpt.names():
        n = internal_name(name, family.RENAMES)
        if n.endswith(".qweight") and not _ignored(n, family) and not _EXPERT_RE.match(n):
            out.add(n[: -len(".qweight")])
    return out


def fp8_scales(ckpt: Checkpoint) -> dict[str, str]:
    """Checkpoint name of each FP8 weight → the name of its block scales (`<weight>_scale_inv`)."""
    return {n[: -len(fp8.SCALE_SUFFIX)]: n for n in ckpt.names() if n.endswith(fp8.SCALE_SUFFIX)}


def fp8_linears(ckpt: Checkpoint, family) -> set[str]:
    """Internal module names of the non-expert linears the checkpoint stores FP8 (weight_scale_inv)."""
    out = set()
    for w in fp8_scales(ckpt):
        n = internal_name(w, family.RENAMES)
        if n.endswith(".weight") and not _ignored(n, family) and not _EXPERT_RE.match(n):
            out.add(n[: -len(".weight")])
    return out


def _layer_of(name: str) -> int:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else -1


class _Units:
    """The checkpoint grouped into load units, in file order of their first tensor."""

    def __init__(self, ckpt: Checkpoint, family, params: dict, experts: dict, packed: dict):
        self.order: list[tuple] = []
        quant: dict[tuple, dict[str, str]] = {}
        self.scales = fp8_scales(ckpt)  # FP8: checkpoint name of a weight → its weight_scale_inv
        for name in ckpt.names():
            n = internal_name(name, family.RENAMES)
            if _ignored(n, family) or name.endswith((fp8.SCALE_SUFFIX, *fp8.IGNORED_SUFFIXES)):
                continue
            if name in self.scales and n.endswith(".weight") and hasattr(packed.get(n[:-7]), "load_fp8"):
                self.order.append(("fp8linear", n[:-7], name))  # kept 8-bit (quant/fp8.Fp8Linear)
                continue
            if n.endswith(".weight") and getattr(packed.get(n[:-7]), "rtn_group", None):
                self.order.append(("rtnlinear", n[:-7], name))  # a 16-bit weight into an Int4Linear (int4_attn)
                continue
            m, own = _EXPERT_RE.match(n), _OWN_RE.match(n)
            if own and hasattr(experts.get(own.group(1)), "load_tensor"):  # e.g. gpt-oss: biases, MXFP4
                self.order.append(("own", own.group(1), own.group(2), name))
            elif m and m.group(1) in experts and m.group(3) in family.EXPERT_PARTS:
                prefix, e, part = m.group(1), int(m.group(2)), family.EXPERT_PARTS[m.group(3)]
                if m.group(4) == "weight":
                    self.order.append(("expert", prefix, e, part, name))
                else:
                    self._quant(quant, ("qexpert", prefix, e, part), m.group(4), name)
            elif (fm := _FUSED_RE.match(n)) is not None:
                self.order.append(("fused", fm.group(1), fm.group(2), name))
            elif n in params:
                self.order.append(("param", n, name))
            elif (qm := _QUANT_RE.match(n)) is not None and (qm.group(1) + ".weight" in params
                                                              or qm.group(1) in packed):
                self._quant(quant, ("qlinear", qm.group(1)), qm.group(2), name)
            # else: tensors this runtime does not use (rotary inv_freq, MTP heads, …) are skipped
        self.quant = quant

    def _quant(self, quant: dict, key: tuple, suffix: str, name: str) -> None:
        if key not in quant:
            quant[key] = {}
            self.order.append(key)
        quant[key][suffix] = name


def load_weights(model, ckpt: Checkpoint, family, quant=None, progress: ProgressFn | None = None) -> None:
    """Stream every tensor of `ckpt` into `model` (see module doc). quant: the checkpoint's
    QuantConfig (lynx_edge.quant.formats) when it has 4-bit linears, else None."""
    params = dict(model.named_parameters())
    experts = {f"layers.{i}.mlp.experts": model.layers[i].mlp.experts for i in model.cfg.moe_layer_ids}
    # 4-bit linears kept packed, FP8 ones kept 8-bit (a CPU with the native kernels)
    packed = {n: m for n, m in model.named_modules() if hasattr(m, "load_quant") or hasattr(m, "load_fp8")}
    units = _Units(ckpt, family, params, experts, packed)
    get = _Reader(ckpt, units.scales, quant)
    total, done = ckpt.total_bytes or 1, 0
    filled: set[str] = set()
    got: dict[str, set] = defaultdict(set)  # expert prefix → {(e, part)}
    held: list[str] = []  # the last "own" unit's tensors: its sink may read them in the next unit
    for u in units.order:
        kind = u[0]
        if kind == "param":
            _, n, name = u
            _copy(params[n], get(name), ckpt.refs[name])
            filled.add(n)
            names = [name]
        elif kind == "expert":
            _, prefix, e, part, name = u
            sink = experts[prefix]
            _check_expert(sink, e, name, ckpt)
            if name in units.scales and hasattr(sink, "load_fp8_part"):  # kept 8-bit, or the sink converts
                with _one_line(ckpt, name):
                    sink.load_fp8_part(e, part, ckpt.get(name), ckpt.get(units.scales[name]), get.block(name))
            else:
                sink.load_part(e, part, _shaped(sink, part, get(name), ckpt.refs[name]))
            got[prefix].add((e, part))
            names = [name]
        elif kind == "fp8linear":
            _, mod, name = u
            names = [name]
            with _one_line(ckpt, name):
                packed[mod].load_fp8(ckpt.get(name), ckpt.get(units.scales[name]))
        elif kind == "rtnlinear":
            _, mod, name = u
            names = [name]
            with _one_line(ckpt, name):
                packed[mod].load_dense(get(name))
        elif kind == "own":
            _, prefix, suffix, name = u
            names = [name]
            with _one_line(ckpt, name):
                got[prefix] |= experts[prefix].load_tensor(suffix, get(name))
        elif kind == "fused":
            _, prefix, which, name = u
            names = [name]
            _load_fused(experts.get(prefix), prefix, which, get(name), ckpt.refs[name], got)
        else:  # 4-bit linears
            tensors = units.quant[u]
            names = list(tensors.values())
            ql = _quant_linear(ckpt, tensors, quant, u)
            if kind == "qexpert":
                _, prefix, e, part = u
                _check_expert(experts[prefix], e, names[0], ckpt)
                try:
                    experts[prefix].load_quant_part(e, part, ql)
                except ValueError as exc:  # act-order where unsupported, a layout mismatch: one line
                    raise LoadError(f"{ckpt.refs[names[0]].file.name}: {names[0].rsplit('.', 1)[0]}: {exc}") from None
                got[prefix].add((e, part))
            elif u[1] in packed:  # kept 4-bit (a CPU with the native kernels: quant/linear.py)
                try:
                    packed[u[1]].load_quant(ql)
                except ValueError as exc:
                    raise LoadError(f"{ckpt.refs[names[0]].file.name}: {u[1]}: {exc}") from None
            else:
                n = u[1] + ".weight"
                _copy(params[n], ql.dequant(params[n].dtype), ckpt.refs[tensors["qweight"]])
                filled.add(n)
        scales = [units.scales[x] for x in names if x in units.scales]
        done += sum(ckpt.refs[x].nbytes for x in [*names, *scales])
        # read once: their pages leave the process (page cache keeps them); a family's own reader may
        # hold a tensor unread until the next one (gpt-oss's blocks wait for their scales), so the
        # last "own" unit's tensors are handed back again after this one
        ckpt.release([*held, *names, *scales])
        held = names if kind == "own" else []
        if progress:
            progress(done, total)
    ckpt.release(held)
    _check_complete(model, params, filled, experts, got, ckpt)
    for name, m in packed.items():
        if not m.loaded:
            dense = hasattr(m, "load_fp8") or getattr(m, "rtn_group", None)
            raise LoadError(f"{ckpt.dir}: missing tensor {name}.{'weight' if dense else 'qweight'}")
    for sink in experts.values():
        finish = getattr(sink, "finish_load", None)
        if finish is not None:
            finish()


@contextmanager
def _one_line(ckpt: Checkpoint, name: str):
    """A sink's ValueError (a wrong shape, dtype or layout) → LoadError naming the file and tensor."""
    try:
        yield
    except ValueError as exc:
        raise LoadError(f"{ckpt.refs[name].file.name}: tensor {name}: {exc}") from None


class _Reader:
    """name → the tensor as a 16-bit sink takes it: the mmap view, or for an FP8 weight its exact
    dequantisation (fp32, one tensor at a time: the transient is one projection)."""

    def __init__(self, ckpt: Checkpoint, scales: dict[str, str], quant):
        self.ckpt, self.scales, self.quant = ckpt, scales, quant

    def block(self, name: str) -> tuple[int, int]:
        """The checkpoint's FP8 weight_block_size; LoadError without an FP8 quantization config."""
        block = getattr(self.quant, "weight_block", None)
        if block is None:
            raise LoadError(f"{self.ckpt.dir}: tensor {name} has a block scale ({self.scales[name]}) but the "
                            "checkpoint has no FP8 quantization_config (quant_method fp8, weight_block_size)")
        return block

    def __call__(self, name: str) -> torch.Tensor:
        t, ref = self.ckpt.get(name), self.ckpt.refs[name]
        scale = self.scales.get(name)
        if scale is None:
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise LoadError(f"{ref.file.name}: tensor {name} is FP8 but has no {name}{fp8.SCALE_SUFFIX} beside it")
            return t
        block = self.block(name)
        if t.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise LoadError(f"{ref.file.name}: tensor {name} is {str(t.dtype).replace('torch.', '')}, expected "
                            "float8_e4m3fn beside its weight_scale_inv")
        s = self.ckpt.get(scale)
        try:
            fp8.check_scale(t, s, block, name)
        except ValueError as exc:
            raise LoadError(f"{ref.file.name}: {exc}") from None
        return fp8.dequant(t, s, block)


def _quant_linear(ckpt: Checkpoint, tensors: dict[str, str], quant, key):
    label = tensors.get("qweight", next(iter(tensors.values())))
    if quant is None:
        raise LoadError(f"{ckpt.dir}: tensor {label} is 4-bit but the checkpoint has no quantization config "
                        "(quantize_config.json or config.json quantization_config)")
    from .quant.formats import linear_from_checkpoint

    try:
        return linear_from_checkpoint({s: ckpt.get(n) for s, n in tensors.items()}, quant, label.rsplit(".", 1)[0])
    except (KeyError, ValueError) as exc:
        raise LoadError(f"{ckpt.dir}: {exc}") from None


def _check_expert(sink, e: int, name: str, ckpt: Checkpoint) -> None:
    if e >= sink.num_experts:
        raise LoadError(f"{ckpt.refs[name].file.name}: tensor {name} does not fit this model (expert {e} "
                        f"of {sink.num_experts})")


def _shaped(sink, part: str, w: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    D, I = sink.hidden, sink.inter
    want = (D, I) if part == "down" else (I, D)
    if tuple(w.shape) != want:
        raise LoadError(f"{ref.file.name}: tensor {ref.name} has shape {tuple(w.shape)}, expected {want}")
    return w


def _copy(dst: torch.Tensor, src: torch.Tensor, ref: TensorRef) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise LoadError(f"{ref.file.name}: tensor {ref.name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def _load_fused(sink, prefix: str, which: str, src: torch.Tensor, ref: TensorRef, got) -> None:
    if sink is None:
        raise LoadError(f"{ref.file.name}: tensor {ref.name} does not fit this model")
    E, D, I = sink.num_experts, sink.hidden, sink.inter
    want = (E, 2 * I, D) if which == "gate_up_proj" else (E, D, I)
    if tuple(src.shape) != want and src.dim() == 3 and tuple(src.shape) == (want[0], want[2], want[1]):
        src = src.transpose(1, 2)  # some transformers versions store [E, in, out]
    if tuple(src.shape) != want:
        raise LoadError(f"{ref.file.name}: tensor {ref.name} has shape {tuple(src.shape)}, expected {want}")
    for e in range(E):
        if which == "gate_up_proj":
            sink.load_part(e, "gate", src[e, :I])
            sink.load_part(e, "up", src[e, I:])
            got[prefix] |= {(e, "gate"), (e, "up")}
        else:
            sink.load_part(e, "down", src[e])
            got[prefix].add((e, "down"))


def _check_complete(model, params, filled, experts, got, ckpt: Checkpoint) -> None:
    for prefix, sink in experts.items():
        have = got.get(prefix, set())
        for e in range(sink.num_experts):
            for p in ("gate", "up", "down"):
                if (e, p) not in have:
                    raise LoadError(f"{ckpt.dir}: missing tensor for {prefix}.{e} ({p} projection)")
    for name in params:
        if name not in filled and ".mlp.experts." not in name:
            raise LoadError(f"{ckpt.dir}: missing tensor {name!r}")


__all__ = ["Checkpoint", "LoadError", "ProgressFn", "expert_storage", "fp8_linears", "fp8_scales", "internal_name",
           "load_weights", "packed_linears"]
