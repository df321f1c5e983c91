"""Load speed per mode from page cache: plain, int4 (RTN at load), offload, offload-int4, gptq, gptq-offload.

Writes (once, cached in --dir) a random qwen3_moe bf16 checkpoint and its GPTQ (v1, sym, group
128) copy with benchmarks/load_memory.py's writers, reads every file once so the loads run from
page cache, then times lynx_edge.build.load_model per mode, each in a fresh subprocess after one
warm-up load of the same mode (imports, lazy modules, the checkpoint's pages): median of --runs
rounds, the modes interleaved within each round so drifting load on the box hits all of them.
GB/s = checkpoint bytes (all *.safetensors of the directory loaded) / load seconds.

A second, profiled load (cProfile) per mode splits the time into phases by the functions that do
the work (both the current code and, with --before, an older tree):
    open        Checkpoint(): safetensors headers, mmaps
    plan+build  memory plan, model construction, empty expert sinks (load_model − the rest)
    copy        16-bit tensors into parameters / the dense store (incl. first-touch page faults)
    decode      GPTQ/AWQ tensors → QuantLinear (linear_from_checkpoint)
    quantize    RTN scales/zeros and codes
    pack        codes → packed bytes
    int4 write  packed bytes, scales, zeros into the INT4 block or store
    other       the loader's loop, name matching, checks
cProfile inflates Python-heavy phases, so phase seconds are shown as shares of the profiled load.

    python benchmarks/load_speed.py                      # writes benchmarks/results/load_speed.{json,md}
    git archive <commit> lynx_edge | tar -x -C /tmp/before && python benchmarks/load_speed.py --before /tmp/before
    python benchmarks/load_speed.py --layers 2 --experts 8 --hidden 256 --inter 256 --runs 1 --out /tmp/x.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_memory import write_checkpoint, write_gptq  # noqa: E402  (the shared checkpoint writers)

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "int4", "offload", "offload-int4", "gptq", "gptq-offload")
PHASES = ("open", "plan+build", "copy", "decode", "quantize", "pack", "int4 write", "other")


def _opts(mode: str, dtype: str | None):
    from lynx_edge.build import LoadOptions

    off = "offload" in mode
    return LoadOptions(device="cpu", dtype=dtype, offload=off, int4=mode in ("int4", "offload-int4"),
                       offload_options=dict(profile="cpu-only") if off else None)


def _phases(stats, total: float) -> dict[str, float]:
    """Seconds per phase from cProfile stats (see module doc); works for old and new code."""
    st = stats.stats  # (file, line, func) → (cc, nc, tt, ct, callers)

    def cum(file: str, func: str) -> float:
        return sum(v[3] for k, v in st.items() if k[0].endswith(file) and k[2] == func)

    def called_from(callee: str, file: str, func: str) -> float:
        """Cumulative time of builtin `callee` (e.g. "<built-in method torch.add>") inside file:func."""
        out = 0.0
        for k, v in st.items():
            if k[2] == callee:
                out += sum(c[3] for ck, c in v[4].items() if ck[0].endswith(file) and ck[2] == func)
        return out

    p = dict.fromkeys(PHASES, 0.0)
    p["open"] = cum("lynx_edge/checkpoint.py", "__init__")
    weights = cum("lynx_edge/loader.py", "load_weights")
    p["plan+build"] = max(0.0, total - weights - p["open"])
    sinks = sum(cum(f, "load_part") for f in ("models/layers.py", "quant/experts.py", "offload/experts.py"))
    p["copy"] = cum("lynx_edge/loader.py", "_copy") + sinks - cum("quant/int4.py", "quantize_part")
    p["decode"] = cum("quant/formats.py", "linear_from_checkpoint")
    # pack: the old write_part packed codes (int4.pack); the new RTN packs with one torch.add
    new_pack = called_from("<built-in method torch.add>", "quant/int4.py", "rtn_pack_into")
    p["pack"] = cum("quant/int4.py", "pack") + new_pack
    p["quantize"] = cum("quant/int4.py", "quantize_rtn") + cum("quant/int4.py", "rtn_pack_into") - new_pack
    old_write = cum("quant/int4.py", "write_part") - cum("quant/int4.py", "pack")
    new_write = cum("quant/int4.py", "write_packed")
    p["int4 write"] = new_write if new_write else max(0.0, old_write)
    p["other"] = max(0.0, weights - sum(p[k] for k in ("copy", "decode", "quantize", "pack", "int4 write")))
    return p


def child(mode: str, ckpt: Path, dtype: str | None, threads: int, profile: bool, src: str | None = None) -> dict:
    """In a fresh process: one warm-up load, one timed load, optionally one profiled load."""
    import gc

    import torch

    torch.set_num_threads(threads)
    import lynx_edge
    from lynx_edge.build import load_model

    if src and not Path(lynx_edge.__file__).resolve().is_relative_to(Path(src).resolve()):
        raise SystemExit(f"lynx_edge imported from {lynx_edge.__file__}, not from {src}")
    from lynx_edge.config import ModelConfig

    cfg = ModelConfig.from_file(ckpt / "config.json")
    model = load_model(ckpt, cfg, _opts(mode, dtype))  # warm-up
    del model
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    model = load_model(ckpt, cfg, _opts(mode, dtype))
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = dict(seconds=secs, cpu_seconds=cpu, dtype=str(model.dtype).replace("torch.", ""))
    del model
    gc.collect()
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        model = load_model(ckpt, cfg, _opts(mode, dtype))
        prof.disable()
        total = time.perf_counter() - t0
        out.update(profiled_seconds=total, phases=_phases(pstats.Stats(prof), total))
    return out


def _run_child(src: Path, mode: str, ck: Path, args, profile: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--dir", str(ck), "--threads", str(args.threads),
           "--src", str(src)] + (["--dtype", args.dtype] if args.dtype else []) + (["--profile"] if profile else [])
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(src)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{mode} ({src}): load failed\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    import torch

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="lynx_speed_"))
    src = work / "bf16"
    if not (src / "config.json").is_file():
        write_checkpoint(src, args.layers, args.experts, args.hidden, args.inter)
    if not (work / "gptq" / "config.json").is_file():
        write_gptq(src, work / "gptq")
    ckpts = {"bf16": src, "gptq": work / "gptq"}
    size = {k: sum(f.stat().st_size for f in d.glob("*.safetensors")) for k, d in ckpts.items()}
    for d in ckpts.values():  # page cache: every mode reads warm files
        for f in d.glob("*.safetensors"):
            f.read_bytes()
    trees = {"after": ROOT}
    if args.before:
        trees = {"before": Path(args.before).resolve(), **trees}
    modes = args.modes.split(",")
    load0 = os.getloadavg()
    res: dict[str, dict[str, dict]] = {t: {m: {"seconds": [], "cpu_seconds": []} for m in modes} for t in trees}
    for r in range(args.runs):
        for mode in modes:
            kind = "gptq" if mode.startswith("gptq") else "bf16"
            for tree, path in trees.items():
                out = _run_child(path, mode, ckpts[kind], args, profile=(r == 0))
                row = res[tree][mode]
                row["seconds"].append(out["seconds"])
                row["cpu_seconds"].append(out["cpu_seconds"])
                row["dtype"], row["checkpoint"], row["checkpoint_bytes"] = out["dtype"], kind, size[kind]
                if "phases" in out:
                    row["phases"], row["profiled_seconds"] = out["phases"], out["profiled_seconds"]
                print(f"round {r} {tree:6s} {mode:13s} {out['seconds']:7.3f} s  ({out['cpu_seconds']:.3f} CPU s)  "
                      f"{size[kind] / out['seconds'] / 1e9:6.2f} GB/s", flush=True)
    for tree in res.values():
        for row in tree.values():
            row["median_s"] = statistics.median(row["seconds"])
            row["median_cpu_s"] = statistics.median(row["cpu_seconds"])
            row["gb_s"] = row["checkpoint_bytes"] / row["median_s"] / 1e9
    return dict(machine=dict(cpu_count=os.cpu_count(), torch=torch.__version__, threads=args.threads,
                             loadavg_start=load0, loadavg_end=os.getloadavg()),
                checkpoint=dict(layers=args.layers, experts=args.experts, hidden=args.hidden, inter=args.inter,
                                bf16_bytes=size["bf16"], gptq_bytes=size["gptq"], dtype=args.dtype),
                runs=args.runs, trees={k: str(v) for k, v in trees.items()}, before_label=args.before_label,
                results=res)


def to_markdown(res: dict) -> str:
    c, m = res["checkpoint"], res["machine"]
    tr = res["results"]
    lines = [f"# Load speed from page cache — random qwen3_moe, {c['layers']} layers × {c['experts']} experts, "
             f"D={c['hidden']}, I={c['inter']}; bf16 checkpoint {c['bf16_bytes'] / 1e9:.2f} GB, GPTQ "
             f"{c['gptq_bytes'] / 1e9:.2f} GB; CPU, {m['threads']} thread(s), model dtype {c['dtype'] or 'default'}", "",
             f"Median of {res['runs']} rounds (modes interleaved, each load in a fresh process after a warm-up load); "
             f"GB/s = checkpoint bytes / load_model wall seconds (CPU s: the process's CPU time, less sensitive to a busy "
             f"box). Load average {m['loadavg_start'][0]:.2f} at the start, "
             f"{m['loadavg_end'][0]:.2f} at the end ({m['cpu_count']} cores, shared).", ""]
    if "before" in tr:
        lines += [f"before = {res.get('before_label') or res['trees']['before']}; after = this tree.", "",
                  "| mode | checkpoint | before s (CPU s) | before GB/s | after s (CPU s) | after GB/s | speed-up |",
                  "|---|---|---|---|---|---|---|"]
        for mode, a in tr["after"].items():
            b = tr["before"][mode]
            lines.append(f"| {mode} | {a['checkpoint']} | {b['median_s']:.3f} ({b['median_cpu_s']:.3f}) | {b['gb_s']:.2f} | "
                         f"{a['median_s']:.3f} ({a['median_cpu_s']:.3f}) | {a['gb_s']:.2f} | {b['median_s'] / a['median_s']:.2f}x |")
    else:
        lines += ["| mode | checkpoint | s (CPU s) | GB/s |", "|---|---|---|---|"]
        for mode, a in tr["after"].items():
            lines.append(f"| {mode} | {a['checkpoint']} | {a['median_s']:.3f} ({a['median_cpu_s']:.3f}) | {a['gb_s']:.2f} |")
    plain = tr["after"].get("plain")
    rel = [f"{k} {v['median_s'] / plain['median_s']:.2f}x" for k, v in tr["after"].items()
           if plain and k != "plain" and v["checkpoint"] == "bf16"]
    if rel:
        lines += ["", "Time relative to a plain load of the same bf16 checkpoint (after): " + ", ".join(rel) + "."]
    for tree, rows in tr.items():
        lines += ["", f"## Where the time goes ({tree}; one cProfile'd load, share of its time)", "",
                  "| mode | profiled s | " + " | ".join(PHASES) + " |", "|---|---|" + "---|" * len(PHASES)]
        for mode, r in rows.items():
            if "phases" not in r:
                continue
            tot = r["profiled_seconds"]
            lines.append(f"| {mode} | {tot:.3f} | " + " | ".join(f"{100 * r['phases'][p] / tot:.0f}%" for p in PHASES) + " |")
    if res.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", help="model dtype ('' = the runtime's CPU default)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared box)")
    ap.add_argument("--before", default=None, help="a directory holding an older lynx_edge/ to compare against")
    ap.add_argument("--before-label", default=None, help="what --before is (e.g. its commit), for the record")
    ap.add_argument("--dir", default=None, help="work directory (checkpoints are cached there)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/load_speed.json + .md)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--src", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtype = args.dtype or None
    if args.child:
        print(json.dumps(child(args.child, Path(args.dir), args.dtype, args.threads, args.profile, args.src)))
        return
    res = run(args)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / "load_speed.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    md = to_markdown(res)
    out.with_suffix(".md").write_text(md) if not args.out else None
    print(md)


if __name__ == "__main__":
    main()
