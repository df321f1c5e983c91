"""A checkpoint directory as named tensors, zero-copy from the files' memory maps.

`Checkpoint(dir)` validates every weight file up front (present, header readable, not
truncated) and parses the safetensors headers itself, so `get(name)` is a view into a private
(copy-on-write) mmap of the file: reading a tensor costs page cache (file-backed, reclaimable),
not anonymous memory, and each file is opened once however many tensors it holds. Pickle `.bin`
checkpoints are refused unless the caller passes allow_pickle=True (then loaded with
weights_only=True). Names come back in file order (file, then offset), so a loader that walks
them reads each file front to back.
"""
from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# F8_E8M0: FP8 checkpoints' power-of-two block scales (quantization_config scale_fmt "ue8m0"), torch ≥ 2.7
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # Linux / macOS; elsewhere release() does nothing
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


class LoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


@dataclass(frozen=True)
class TensorRef:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # byte offset of the data in the file (safetensors), -1 for pickles
    nbytes: int


def checkpoint_files(model_dir: Path, allow_pickle: bool = False) -> list[Path]:
    """The weight files of a checkpoint directory (sharded index, single file, or any *.safetensors)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise LoadError(f"{index}: not a valid safetensors index ({exc})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise LoadError(f"{f}: shard named in model.safetensors.index.json is missing")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(model_dir.glob("*.bin"))
    if pickles and not allow_pickle:
        raise LoadError(f"{model_dir}: only pickle checkpoints ({pickles[0].name}); refusing to unpickle — "
                        "pass allow_pickle=True if you trust them, or convert to safetensors")
    if pickles:
        return pickles
    raise LoadError(f"{model_dir}: no model weights (*.safetensors) found")


def read_header(path: Path) -> tuple[int, dict]:
    """→ (byte offset of the data section, header dict); LoadError for truncated/corrupt files."""
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
    if not isinstance(header, dict):
        raise LoadError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise LoadError(f"{path}: truncated safetensors file ({size} bytes, header promises {8 + n + end})")
    return 8 + n, header


class Checkpoint:
    """name → tensor for every weight file of a checkpoint directory (see module doc)."""

    def __init__(self, model_dir: str | Path, allow_pickle: bool = False):
        self.dir = Path(model_dir)
        self.files = checkpoint_files(self.dir, allow_pickle)
        self.refs: dict[str, TensorRef] = {}
        self._maps: dict[Path, torch.Tensor] = {}  # file → uint8 view of its whole mmap
        self._mmaps: dict[Path, mmap.mmap] = {}  # file → its mmap (release() advises it)
        self._pickles: dict[Path, dict] = {}
        for f in self.files:
            if f.suffix == ".bin":
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                self._pickles[f] = sd
                for k, v in sd.items():
                    self.refs[k] = TensorRef(k, f, tuple(v.shape), v.dtype, -1, v.numel() * v.element_size())
                continue
            base, header = read_header(f)
            for k, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dt = _DTYPES.get(v.get("dtype"))
                if dt is None:
                    raise LoadError(f"{f.name}: tensor {k} has unsupported dtype {v.get('dtype')!r}")
                a, b = v["data_offsets"]
                self.refs[k] = TensorRef(k, f, tuple(v["shape"]), dt, base + a, b - a)

    def __contains__(self, name: str) -> bool:
        return name in self.refs

    def names(self) -> list[str]:
        return list(self.refs)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.refs.values())

    def _map(self, f: Path) -> torch.Tensor:
        m = self._maps.get(f)
        if m is None:
            with open(f, "rb") as fh:
                # ACCESS_COPY: a private mapping, so torch gets a writable buffer (no warning) while
                # the pages stay shared file cache until something writes them (nothing does).
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            m = self._maps[f] = torch.frombuffer(mm, dtype=torch.uint8)
            self._mmaps[f] = mm
        return m

    def release(self, names) -> None:
        """The loader is done with these tensors: their whole pages leave this process's mapping
        (madvise MADV_DONTNEED). The page cache keeps them, reclaimable, but the process's RSS stops
        counting them, so a 4-bit load of a 16-bit checkpoint peaks near what it keeps (LFM2-8B-A1B's
        16.7 GB of bf16: ~5 GB) rather than near the file's size. Safe for any view still held: the
        mapping is private and never written, so a later read faults the same bytes back in."""
        for name in names:
            ref = self.refs.get(name)
            mm = self._mmaps.get(ref.file) if ref is not None and ref.offset >= 0 else None
            if mm is None or _DONTNEED is None:
                continue
            a = -(-ref.offset // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor only:
            b = (ref.offset + ref.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE  # its neighbours may be unread
            if b > a:
                mm.madvise(_DONTNEED, a, b - a)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` as a view of the file's mmap (CPU, the checkpoint's dtype)."""
        ref = self.refs.get(name)
        if ref is None:
            raise LoadError(f"{self.dir}: missing tensor {name!r}")
        if ref.offset < 0:
            return self._pickles[ref.file][name]
        raw = self._map(ref.file)[ref.offset : ref.offset + ref.nbytes]
        if ref.offset % ref.dtype.itemsize:
            raw = raw.clone()  # misaligned for a typed view (rare writers): one copy of this tensor
        numel = 1
        for s in ref.shape:
            numel *= s
        if ref.nbytes != numel * ref.dtype.itemsize:
            raise LoadError(f"{ref.file.name}: tensor {name} has {ref.nbytes} bytes for shape {ref.shape}")
        return raw.view(ref.dtype).view(ref.shape)

    def close(self) -> None:
        self._maps.clear()
        self._mmaps.clear()
        self._pickles.clear()


__all__ = ["Checkpoint", "LoadError", "TensorRef", "checkpoint_files", "read_header"]
