"""DeepSeek-V2 MLA's absorbed decode, the session-30 form (a broadcast [B, H, T, ·] @ [H, ·, ·] matmul
that copied kv_b's weight B times, in the model dtype; SDPA with r-wide values, which CPU bf16 ran on
the math path) against the current one (one matmul per head over all B·T queries, an fp32 copy of kv_b
on a CPU, SDPA over whole latent rows), one DeepSeek-V2-Lite layer (real config, random weights),
alternating in one process; medians of 5 after a warm-up, and the two outputs' largest difference.

    python benchmarks/mla_absorbed_ab.py [threads] [out.json]
"""
import json
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F
sys.path.insert(0, '.')
from pathlib import Path
from lynx_edge.config import ModelConfig
from lynx_edge.models.deepseek_v2 import MLAttention
from lynx_edge.models.layers import AttnBatch, Attention
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
def old_absorbed(self, q_nope, q_pe, ctx, ab):
    B, H, T, _ = q_nope.shape
    S, r = ctx.shape[1], self.r
    w = self.kv_b_proj.weight.view(H, self.dn + self.dv, r)
    q_lat = torch.matmul(q_nope, w[:, : self.dn])
    qq = torch.cat((q_lat, q_pe), -1).reshape(B, 1, H * T, r + self.dr)
    mask, causal = Attention.attend(self, ab, T)
    if causal:
        mask = ab.mask(None)
    if mask is not None:
        mask = mask.expand(B, H, T, S).reshape(B, 1, H * T, S)
    o = F.scaled_dot_product_attention(qq, ctx[:, None], ctx[:, None, :, :r], attn_mask=mask, scale=self.scale)
    return torch.matmul(o.view(B, H, T, r), w[:, self.dn :].transpose(1, 2))
cfg = ModelConfig.from_file(Path("tests/fixtures/real/deepseek-v2-lite-chat/config.json"))
width = cfg.arch.kv_lora_rank + cfg.arch.qk_rope_head_dim
rows = []
for dtype in (torch.bfloat16, torch.float32):
    torch.manual_seed(0)
    m = MLAttention(cfg, 1, dtype, torch.device("cpu"))
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.rand_like(p, dtype=torch.float32) * 0.5 + 0.75 if "norm" in name else torch.randn_like(p, dtype=torch.float32) * p.shape[-1] ** -0.5)
    m.mode = "absorbed"
    new = m.absorbed
    for B in (1, 4, 16):
        for S in (512, 4096):
            cache = (torch.randn(B, S + 1, width, dtype=dtype),)
            x = torch.randn(B, 1, cfg.hidden_size, dtype=dtype)
            ab = AttnBatch(positions=torch.full((B, 1), S), rows=slice(0, B), kv_len=S + 1, start=S)
            ts = {"old": [], "new": []}; outs = {}
            for rep in range(6):
                for k in (("old", "new") if rep % 2 else ("new", "old")):
                    m.absorbed = types.MethodType(old_absorbed, m) if k == "old" else new
                    ab.__dict__.pop("_mla_cos_sin", None)
                    with torch.inference_mode():
                        t0 = time.perf_counter(); outs[k] = m(x, ab, cache); dt = time.perf_counter() - t0
                    if rep: ts[k].append(dt)
            med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
            diff = ((outs["old"].float() - outs["new"].float()).abs().max() / outs["old"].float().abs().max()).item()
            row = dict(dtype=str(dtype)[6:], B=B, S=S, old_ms=round(med["old"], 2), new_ms=round(med["new"], 2),
                       speedup=round(med["old"] / med["new"], 2), rel_diff=float(f"{diff:.1e}"))
            rows.append(row); print(row, flush=True)
Path(sys.argv[2] if len(sys.argv) > 2 else "benchmarks/results/mla_absorbed_s31.json").write_text(json.dumps(rows, indent=1) + "\n")
