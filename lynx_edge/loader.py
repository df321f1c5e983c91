"""Checkpoint → model: safetensors through mmap, one tensor at a time, straight into place.

Understands single-file and sharded (model.safetensors.index.json) checkpoints, the on-disk
per-expert names (`experts.{e}.w1/w2/w3`, `experts.{e}.gate_proj/up_proj/down_proj`) and
transformers' fused names (`experts.gate_up_proj` [E, 2I, D], `experts.down_proj` [E, D, I]).
Experts land stacked as gate_up [E, 2I, D] (gate rows first) and down [E, D, I]. Only one
checkpoint tensor is materialised at a time, so loading never holds two copies of the model.
Pickle `.bin` checkpoints are refused unless the caller passes allow_pickle=True.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)

_ST_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
              "F8_E4M3": 1, "F8_E5M2": 1}
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
_FUSED_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class LoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


@dataclass(frozen=True)
class TensorRef:
    name: str
    file: Path
    shape: tuple[int, ...]
    nbytes: int


def checkpoint_files(model_dir: Path, allow_pickle: bool = False) -> list[Path]:
    """The weight files of a checkpoint directory, validated (sizes, headers) before any read."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise LoadError(f"{index}: not a valid safetensors index ({exc})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(model_dir.glob("*.bin"))
        if pickles and not allow_pickle:
            raise LoadError(
                f"{model_dir}: only pickle checkpoints ({pickles[0].name}); refusing to unpickle — "
                "pass allow_pickle=True if you trust them, or convert to safetensors"
            )
        if pickles:
            return pickles
        raise LoadError(f"{model_dir}: no model weights (*.safetensors) found")
    for f in files:
        if not f.is_file():
            raise LoadError(f"{f}: shard named in model.safetensors.index.json is missing")
        _check_safetensors(f)
    return files


def _check_safetensors(path: Path) -> None:
    """Catch truncated or corrupt files with a clear message before safetensors does."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise LoadError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise LoadError(f"{path}: corrupt safetensors header (length {n} for a {size}-byte file)")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LoadError(f"{path}: corrupt safetensors header (not JSON)") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise LoadError(f"{path}: truncated safetensors file ({size} bytes, header promises {8 + n + end})")


def iter_tensor_refs(files: list[Path]) -> Iterator[TensorRef]:
    for f in files:
        if f.suffix == ".bin":
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            for k, v in sd.items():
                yield TensorRef(k, f, tuple(v.shape), v.numel() * v.element_size())
            continue
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                shape = tuple(sl.get_shape())
                numel = 1
                for s in shape:
                    numel *= s
                yield TensorRef(k, f, shape, numel * _ST_DTYPES.get(sl.get_dtype(), 4))


class _Reader:
    """Keeps one open handle per file; get() materialises one tensor (from the mmap)."""

    def __init__(self):
        self.handles: dict[Path, object] = {}

    def get(self, ref: TensorRef) -> torch.Tensor:
        h = self.handles.get(ref.file)
        if h is None:
            if ref.file.suffix == ".bin":
                h = torch.load(ref.file, map_location="cpu", weights_only=True, mmap=True)
            else:
                h = safe_open(ref.file, framework="pt")
            self.handles[ref.file] = h
        return h[ref.name] if isinstance(h, dict) else h.get_tensor(ref.name)


def _internal_name(name: str, renames) -> str:
    for old, new in renames:
        name = name.replace(old, new)
    if name.startswith("model."):
        name = name[len("model."):]
    return "embed_tokens" if name == "embed_tokens.weight" else name


def load_weights(model, model_dir: Path, family, progress: ProgressFn | None = None, allow_pickle: bool = False):
    """Stream every checkpoint tensor into `model`'s preallocated parameters.

    Raises LoadError for a missing tensor, a wrong shape or an unreadable file.
    """
    files = checkpoint_files(model_dir, allow_pickle)
    params = dict(model.named_parameters())
    refs = list(iter_tensor_refs(files))
    total = sum(r.nbytes for r in refs) or 1
    filled: set[str] = set()
    expert_filled: dict[str, set] = {}
    reader, done = _Reader(), 0
    for ref in refs:
        name = _internal_name(ref.name, family.RENAMES)
        m = _EXPERT_RE.match(name)
        if m and m.group(3) in family.EXPERT_PARTS:
            _load_expert(params, m, ref, reader, family.EXPERT_PARTS[m.group(3)], expert_filled)
        elif (fm := _FUSED_RE.match(name)) is not None:
            _load_fused(params, fm, ref, reader, filled)
        elif name in params:
            _copy(params[name], reader.get(ref), ref)
            filled.add(name)
        # else: tensors this runtime does not use (e.g. rotary_emb.inv_freq) are skipped.
        done += ref.nbytes
        if progress:
            progress(done, total)
    _check_complete(model, params, filled, expert_filled, model_dir)


def _copy(dst: torch.Tensor, src: torch.Tensor, ref: TensorRef) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise LoadError(f"{ref.file.name}: tensor {ref.name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def _load_expert(params, m, ref, reader, part, expert_filled):
    prefix, e = m.group(1), int(m.group(2))
    target = params.get(prefix + (".down" if part == "down" else ".gate_up"))
    if target is None or e >= target.shape[0]:
        raise LoadError(f"{ref.file.name}: tensor {ref.name} does not fit this model (expert {e})")
    inter = target.shape[1] // 2 if part != "down" else None
    dst = {"gate": lambda: target[e, :inter], "up": lambda: target[e, inter:], "down": lambda: target[e]}[part]()
    _copy(dst, reader.get(ref), ref)
    expert_filled.setdefault(prefix, set()).add((e, part))


def _load_fused(params, m, ref, reader, filled):
    key = m.group(1) + (".gate_up" if m.group(2) == "gate_up_proj" else ".down")
    if key not in params:
        raise LoadError(f"{ref.file.name}: tensor {ref.name} does not fit this model")
    src = reader.get(ref)
    dst = params[key]
    if src.shape != dst.shape and src.dim() == 3 and src.shape[1:] == dst.shape[1:][::-1]:
        src = src.transpose(1, 2)  # some transformers versions store [E, in, out]
    _copy(dst, src, ref)
    filled.add(key)


def _check_complete(model, params, filled, expert_filled, model_dir):
    E = model.cfg.num_experts
    for name in params:
        if name in filled:
            continue
        if name.endswith((".experts.gate_up", ".experts.down")):
            prefix = name.rsplit(".", 1)[0]
            got = expert_filled.get(prefix, set())
            parts = ("down",) if name.endswith(".down") else ("gate", "up")
            missing = [(e, p) for e in range(E) for p in parts if (e, p) not in got]
            if not missing:
                continue
            e, p = missing[0]
            raise LoadError(f"{model_dir}: missing tensor for {prefix}.{e} ({p} projection)")
        raise LoadError(f"{model_dir}: missing tensor {name!r}")
