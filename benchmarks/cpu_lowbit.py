"""Low-bit expert MLPs on the CPU, candidates side by side: which kernel computes one SwiGLU expert
(gate_up [2I, D], down [D, I]) for T tokens fastest on this machine, and at what memory traffic.

Candidates (each the whole expert: gate_up → silu·up → down):
  fp32 / bf16        F.linear on dense weights (lynx-edge's 16/32-bit path)
  int4_ref           today's INT4 CPU path: dequantise the expert to fp32, then fp32 F.linear
  int4_numba         lynx_edge.quant.cpu_kernels: the packed INT4 block read in place, one compiled call
  int4pack_bf16/fp32 torch._weight_int4pack_mm_for_cpu (repacked at load into torch's layout,
                     scale·(q−8)+zero) with bf16 / fp32 activations
  int8pack_bf16/fp32 torch._weight_int8pack_mm (per-channel INT8) with bf16 / fp32 activations
  int4_compile       torch.compile'd dequant + matmul (skipped when its first compile is too slow)
"hot" runs one copy of the weights over and over (they sit in L2/L3: small models, the demo);
"cold" rotates over copies filling --cold-mb per candidate, so each call streams its weights
from DRAM (big models). Rounds alternate the candidates; medians per candidate; ratios are
fp32 time / candidate time (> 1: faster than fp32), so background load hits all alike.

    python benchmarks/cpu_lowbit.py [--threads 1,2] [-r 9] [--cold-mb 384] [--no-compile]
        [--decode demo,random-6-32-1024-384] [--decode-batches 1,16] [--decode-threads 1]
Writes benchmarks/results/cpu_lowbit.{json,md} (--out elsewhere).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))  # load_memory's checkpoint writer

from lynx_edge.kernels.moe_gemm import expert_mlp
from lynx_edge.quant.cpu_kernels import moe_int4_cpu
from lynx_edge.quant.int4 import Int4Experts, dequant, quantize_experts, unpack

SHAPES = [(256, 128), (2048, 768)]  # (D, I): the embedded demo; Qwen3-30B-A3B's experts
TOKENS = [1, 4, 16]
G = 128


def _copies(nbytes: int, cold_mb: float, hot: bool) -> int:
    return 1 if hot else max(2, int(cold_mb * 2**20 // nbytes))


def build(D: int, I: int, cold_mb: float, hot: bool, compile_ok: bool) -> dict:
    """name → (run(c, x) computing copy c's expert on x [T, D], copies, weight bytes per expert)."""
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(2 * I, D, generator=g) / D**0.5
    dn = torch.randn(D, I, generator=g) / I**0.5
    P = quantize_experts(gu[None], dn[None], G, True)  # one expert, symmetric group-128 RTN
    gu4, dn4 = P.dequant_expert(0)  # the INT4 weights as fp32 (what the low-bit kernels compute)
    cands = {}

    def dense(dt):
        n = _copies(3 * D * I * dt.itemsize, cold_mb, hot)
        ws = [(gu4.to(dt).clone(), dn4.to(dt).clone()) for _ in range(n)]
        return (lambda c, x: expert_mlp(x.to(dt), *ws[c])), n, 3 * D * I * dt.itemsize

    cands["fp32"] = dense(torch.float32)
    cands["bf16"] = dense(torch.bfloat16)
    n4 = _copies(P.layout.nbytes, cold_mb, hot)
    big = Int4Experts(P.data.expand(n4, -1).clone(), P.layout)  # n4 copies of the same expert block
    ids1 = {}

    def numba_run(c, x):
        T = x.shape[0]
        if (T, c) not in ids1:
            ids1[T, c] = torch.full((T, 1), c, dtype=torch.long)
        return moe_int4_cpu(x, ids1[T, c], torch.ones(T, 1), big)

    cands["int4_numba"] = (numba_run, n4, P.layout.nbytes)
    cands["int4_ref"] = ((lambda c, x: expert_mlp(x, *big.dequant_expert(c))), n4, P.layout.nbytes)
    # torch's int4pack: codes repacked, scale·(q − 8) + zero with zero = s·(8 − z) = 0 here (sym)
    (q_gu, s_gu, _), (q_dn, s_dn, _) = P.codes()

    def int4pack(dt):
        def one(q, s):
            wp = torch._convert_weight_to_int4pack_for_cpu(q[0].to(torch.int32), 1)
            sz = torch.stack([s[0].float(), torch.zeros_like(s[0], dtype=torch.float32)], -1).to(dt)
            return wp, sz.contiguous()
        nb = 3 * D * I // 2 + 3 * D * I // G * 2 * dt.itemsize
        n = _copies(nb, cold_mb, hot)
        a, b = one(q_gu, s_gu), one(q_dn, s_dn)
        ws = [(a[0].clone(), a[1].clone(), b[0].clone(), b[1].clone()) for _ in range(n)]

        def run(c, x):
            wg, sg, wd, sd = ws[c]
            gate, up = torch._weight_int4pack_mm_for_cpu(x.to(dt), wg, G, sg).chunk(2, -1)
            return torch._weight_int4pack_mm_for_cpu(F.silu(gate) * up, wd, G, sd)
        return run, n, nb

    def int8pack(dt):
        def one(w):  # per-output-channel symmetric INT8 of the INT4-dequantised weights
            s = w.abs().amax(1).clamp(min=1e-8) / 127
            return torch.round(w / s[:, None]).to(torch.int8), s.to(dt)
        nb = 3 * D * I + 3 * D * dt.itemsize
        n = _copies(nb, cold_mb, hot)
        a, b = one(gu4), one(dn4)
        ws = [(a[0].clone(), a[1].clone(), b[0].clone(), b[1].clone()) for _ in range(n)]

        def run(c, x):
            wg, sg, wd, sd = ws[c]
            gate, up = torch._weight_int8pack_mm(x.to(dt), wg, sg).chunk(2, -1)
            return torch._weight_int8pack_mm(F.silu(gate) * up, wd, sd)
        return run, n, nb

    for dt, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        cands[f"int4pack_{tag}"] = int4pack(dt)
        cands[f"int8pack_{tag}"] = int8pack(dt)
    if compile_ok:
        cands["int4_compile"] = (_compiled(big), n4, P.layout.nbytes)
    return cands


def _compiled(big: Int4Experts):
    """torch.compile of dequantise-then-multiply over the packed block (inductor may fuse the
    dequantisation into the GEMV's reduction)."""
    def mlp(x, gq, gs, dq, ds):
        gu = dequant(gq, gs, None, G)
        dn = dequant(dq, ds, None, G)
        gate, up = (x @ gu.t()).chunk(2, -1)
        return (F.silu(gate) * up) @ dn.t()
    torch._dynamo.config.recompile_limit = 64  # one compile per (shape, T); past the limit it would run eager
    fn = torch.compile(mlp, dynamic=False)
    return lambda c, x: fn(x, big.gu_q[c], big.gu_s[c], big.dn_q[c], big.dn_s[c])


def run_shape(D, I, T, cands, reps, calls):
    x = torch.randn(T, D)
    times = {k: [] for k in cands}
    pos = {k: 0 for k in cands}
    for k, (fn, n, _) in cands.items():  # warm-up (and first compiles)
        fn(0, x)
    for _ in range(reps):
        for k, (fn, n, _) in cands.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(pos[k], x)
                pos[k] = (pos[k] + 1) % n
            times[k].append((time.perf_counter() - t0) / calls * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def decode(models: list[str], batches: list[int], tokens: int, reps: int, threads: int) -> list[dict]:
    """Decode TPOT per expert kind on real engines, alternating engines each round (median)."""
    import contextlib
    import tempfile

    import lynx_edge.quant.experts as qe
    from lynx_edge import Engine
    from lynx_edge.hub import resolve_model

    from load_memory import write_checkpoint

    @contextlib.contextmanager
    def torch_ref():  # the INT4 path before this kernel: dequantise per step (fused_moe_int4's CPU path)
        old = qe.cpu_kernels.available
        qe.cpu_kernels.available = lambda: False
        try:
            yield
        finally:
            qe.cpu_kernels.available = old

    prompts = ["def main():\n    ", "import os\n", "class Config:\n", "for i in range(", "# utilities\n",
               "with open(path) as f:", "try:\n    ", "return [x for x in"]
    rows, tmp = [], tempfile.TemporaryDirectory()
    for model in models:
        path = model
        if model.startswith("random"):  # random-L-E-D-I: a qwen3_moe written here
            L, E, D, I = (int(v) for v in model.split("-")[1:])
            path = write_checkpoint(Path(tmp.name) / model, L, E, D, I)  # vocab 4096, as the demo's
            for f in ("tokenizer.json", "tokenizer_config.json"):  # the demo's tokenizer, to run prompts
                shutil.copy(resolve_model("demo") / f, path / f)
        kinds = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
                 "int4": dict(dtype="float32", int4=True), "int4_torch_ref": dict(dtype="float32", int4=True)}
        engines = {k: Engine.from_pretrained(path, device="cpu", threads=threads, **o) for k, o in kinds.items()}
        wbytes = {k: sum(p.numel() * p.element_size() for p in e.model.parameters())
                  + sum(b.numel() * b.element_size() for b in e.model.buffers()) for k, e in engines.items()}
        for B in batches:
            batch = [prompts[i % len(prompts)] for i in range(B)]
            tpot = {k: [] for k in engines}
            for _ in range(reps):
                for k, eng in engines.items():
                    ctx = torch_ref() if k == "int4_torch_ref" else contextlib.nullcontext()
                    with ctx:
                        eng.generate_batch(batch, max_new_tokens=tokens, ignore_eos=True)
                    tpot[k].append(eng.last_stats["tpot_ms"])
            med = {k: statistics.median(v) for k, v in tpot.items()}
            rows.append(dict(model=model, batch=B, tpot_ms=med, tpot_all=tpot, model_bytes=wbytes,
                             fp32_over={k: med["fp32"] / v for k, v in med.items()}))
            print(f"decode {model} B={B}: " + "  ".join(f"{k} {v:.2f}ms ({med['fp32'] / v:.2f}x)"
                                                      for k, v in med.items()), flush=True)
        del engines
    return rows


def cpu_flags() -> str:
    try:
        fl = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return ""
    return " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
                    if f in fl)


def to_markdown(res: dict) -> str:
    cols = list(res["rows"][0]["ms"]) if res["rows"] else []
    md = [f"# Low-bit expert kernels on the CPU ({res['cpu_capability']}; flags: {res['cpu_flags']}; "
          f"{res['cores']} cores, torch {res['torch']})", "",
          "Time of one SwiGLU expert (gate_up → silu·up → down) for T tokens; ratio = fp32 time / "
          "candidate time (> 1: faster than fp32 F.linear). Rounds alternate the candidates; medians of "
          f"{res['reps']} rounds. hot = one copy of the weights (cache-resident: the demo); cold = rotating "
          f"over {res['cold_mb']:.0f} MB of copies per candidate (DRAM-bound: big models). Group {res['group']}.", ""]
    for th in sorted({r["threads"] for r in res["rows"]}):
        md += [f"## {th} torch thread(s) (the numba kernel always runs on the calling thread)", "",
               "| D | I | T | mode | " + " | ".join(cols) + " |", "|---" * (4 + len(cols)) + "|"]
        for r in (r for r in res["rows"] if r["threads"] == th):
            md.append(f"| {r['D']} | {r['I']} | {r['T']} | {r['mode']} | " + " | ".join(
                f"{r['ms'][c]:.3f} ms ({r['vs_fp32'][c]:.2f}x)" for c in cols) + " |")
        md.append("")
    if res["rows"]:
        r0 = [r for r in res["rows"] if r["mode"] == "cold" and r["T"] == 1][-1]
        md += ["Weight bytes streamed per token at T=1 (D={D}, I={I}): ".format(**r0) + ", ".join(
            f"{c} {r0['bytes_per_token'][c] / 2**20:.2f} MiB" for c in cols) + "; at T tokens divide by T.", ""]
    if res.get("decode"):
        ks = list(res["decode"][0]["tpot_ms"])
        md += ["## Decode TPOT on real engines (ms; ratio = fp32 TPOT / TPOT)", "",
               f"{res['decode_tokens']} tokens, medians of {res['decode_reps']} alternating rounds, "
               f"{res['decode_threads']} thread(s). int4 = `--int4` (this kernel); int4_torch_ref = the "
               "previous INT4 CPU path (dequantise per step).", "",
               "| model | B | " + " | ".join(ks) + " |", "|---" * (2 + len(ks)) + "|"]
        for r in res["decode"]:
            md.append(f"| {r['model']} | {r['batch']} | " + " | ".join(
                f"{r['tpot_ms'][k]:.2f} ({r['fp32_over'][k]:.2f}x)" for k in ks) + " |")
        md.append("")
        md += ["Model bytes (parameters + buffers): " + "; ".join(
            f"{r['model']}: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in r["model_bytes"].items())
            for r in res["decode"] if r["batch"] == res["decode"][0]["batch"]), ""]
    md += ["## Choice by ISA", "", res.get("choice", ""), ""]
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2", help="torch thread counts to measure, comma-separated")
    ap.add_argument("-r", "--reps", type=int, default=9)
    ap.add_argument("--cold-mb", type=float, default=384)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--decode", default="demo,random-6-32-1024-384", help="models for the TPOT section ('' skips)")
    ap.add_argument("--decode-batches", default="1,16")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--decode-reps", type=int, default=3)
    ap.add_argument("--decode-threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    compile_ok = not args.no_compile
    rows = []
    for th in (int(v) for v in args.threads.split(",") if v):
        torch.set_num_threads(th)
        for D, I in SHAPES:
            for mode in ("hot", "cold"):
                t0 = time.perf_counter()
                cands = build(D, I, args.cold_mb, mode == "hot", compile_ok)
                for T in TOKENS:
                    calls = max(1, min(50, int(2e6 // (D * I * T))))
                    t1 = time.perf_counter()
                    med = run_shape(D, I, T, cands, args.reps, calls)
                    if compile_ok and "int4_compile" in cands and time.perf_counter() - t1 > 120:
                        compile_ok = False  # its compiles dominate: measured once, dropped for later shapes
                    base = med["fp32"]
                    rows.append(dict(threads=th, D=D, I=I, T=T, mode=mode, ms=med,
                                     vs_fp32={k: base / v for k, v in med.items()},
                                     bytes_per_token={k: cands[k][2] / T for k in cands}))
                    print(f"t={th} D={D} I={I} T={T:2d} {mode}: " + "  ".join(
                        f"{k} {v:.3f}ms ({base / v:.2f}x)" for k, v in med.items()), flush=True)
                del cands
                print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    res = dict(threads=args.threads, reps=args.reps, cold_mb=args.cold_mb, group=G, cpu_flags=cpu_flags(),
               cpu_capability=torch.backends.cpu.get_cpu_capability(), machine=platform.machine(),
               cores=os.cpu_count(), torch=torch.__version__, rows=rows)
    models = [m for m in args.decode.split(",") if m]
    if models:
        res.update(decode=decode(models, [int(b) for b in args.decode_batches.split(",")], args.decode_tokens,
                                 args.decode_reps, args.decode_threads),
                   decode_tokens=args.decode_tokens, decode_reps=args.decode_reps, decode_threads=args.decode_threads)
    res["choice"] = CHOICE
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / "cpu_lowbit.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(to_markdown(res))
    print(f"wrote {out} and {out.with_suffix('.md').name}")


CHOICE = """\
What runs: `Int4MoEExperts.forward` on a CPU and the offload store's INT4 CPU experts
(`Int4Format.compute`, Fiddler-style) call `lynx_edge.quant.cpu_kernels` (numba, compiled for the
host ISA by LLVM: 16-lane AVX-512 here, 8-lane AVX2, NEON on Arm) on every ISA. Why, on this
AVX512 machine (no avx512_bf16 / AMX exposed to this VM, whatever the model number says):
- it is the only candidate that is exact to fp32 rounding (bound 1.7e-6 of the output scale vs
  dequantise-then-fp32, tests/test_cpu_lowbit.py) and reads the bytes the format and the offload
  store already hold (no repack, no second copy), in one call per layer with no Python per expert
  (op count flat in active experts) — what the demo, overhead-bound, needs most;
- it beats fp32 F.linear on one thread (1.2-1.5x at T=1 and T=4, D=2048/I=768) and replaces a
  path that ran at 0.08-0.2x of fp32 (int4_ref); it runs on the calling thread, which does not
  collapse under background load as torch's 2-thread pool does, but it is 0.6-0.7x of 2-thread
  fp32 on a quiet machine (numba's own thread pools were tried: next to torch's OpenMP pool on
  2 cores both collapsed, 4-30 ms per call instead of ~1.3 ms) and 0.3-0.6x at T=16 (no register blocking over rows yet).
- torch's `_weight_int4pack_mm_for_cpu` with bf16 activations is the fastest kernel measured here
  (3.0-3.8x fp32 at T=1-4, 1.3x at T=16; 2-4x the numba kernel), but only with bf16
  activations and bf16 scales and zeros (our fp16 scales lose 3 mantissa bits: a 2^-9 relative
  weight error, far outside an fp32-tight bound), needs a repack into its own layout (the
  offload store could not move the same bytes), and is one torch call chain per expert. With
  fp32 activations it runs at 0.02-0.16x of fp32. It is the candidate for a bf16 CPU mode.
- `_weight_int8pack_mm` wins over fp32 only with bf16 activations (1.4-2.8x at T=1-4, ~0.9-1.1x
  at T=16), below int4pack_bf16 everywhere: no INT8 expert format is built.
- torch.compile'd dequantise-then-matmul: 0.1-0.3x fp32 here (inductor materialises the weights),
  and a compile per shape: dropped.
AVX2 / Arm: the same numba kernel (not measured on those here; the issue's AVX2 run found
int4pack_bf16 1.6-3.0x fp32 at one token, the same picture); AMX would favour the bf16 torch
kernels at T >= 16 and is not visible on this VM."""


if __name__ == "__main__":
    main()
