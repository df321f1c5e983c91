"""The zero-padded checkpoint: the same model with every expert's intermediate size widened with zeros.

    path = pad_checkpoint(resolve_model("demo"), tmp / "demo-I2048", 2048)

Outputs and routing are identical (gate/up rows of zeros give silu(0)·0 = 0 in the new columns,
and down's zero columns add nothing), but the experts weigh what a real MoE's do, so decode is
bound by expert weight traffic and LYNX's fewer distinct experts show up as time. It is a real
checkpoint on disk, so it loads through every path (resident, --int4, --offload). Glossary:
I expert intermediate, D hidden.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

_EXPERT = (".mlp.experts.",)  # per-expert tensors: …experts.{e}.{gate,up,down}_proj.weight


def pad_checkpoint(src: Path | str, out: Path | str, inter: int) -> Path:
    """Write `src`'s checkpoint with moe_intermediate_size `inter` (≥ the current one) to `out`."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    old = cfg.get("moe_intermediate_size")
    if old is None or inter < old:
        raise ValueError(f"padding needs moe_intermediate_size ≤ {inter} in {src / 'config.json'} (got {old})")
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {src}")
    padded = 0
    for f in files:
        sd = load_file(str(f))
        for k, v in sd.items():
            if any(p in k for p in _EXPERT) and k.endswith("_proj.weight"):
                padded += 1
                down = "down_proj" in k  # gate/up [I, D] → [inter, D]; down [D, I] → [D, inter]
                w = torch.zeros((v.shape[0], inter) if down else (inter, v.shape[1]), dtype=v.dtype)
                w[: v.shape[0], : v.shape[1]] = v
                sd[k] = w
        save_file(sd, str(out / f.name), metadata={"format": "pt"})
    if not padded:
        raise ValueError(f"no per-expert weights (…{_EXPERT[0]}N.*_proj.weight) in {src}: cannot pad")
    (out / "config.json").write_text(json.dumps(cfg | {"moe_intermediate_size": inter}), encoding="utf-8")
    for f in src.iterdir():  # tokenizer, generation config, index, held-out text: as they are
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copyfile(f, out / f.name)
    return out


__all__ = ["pad_checkpoint"]
