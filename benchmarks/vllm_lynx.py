"""vLLM with and without the LYNX plugin: unique experts per decode step, TPOT, greedy agreement.

Runs in an environment with vLLM (e.g. .venv-vllm, see the README's "Scale out with vLLM"), on
the demo model and on the demo with every expert zero-padded to a larger intermediate size
(same outputs, experts heavy enough that decode is memory-bound, as in benchmarks/lynx_cpu.py).
Both engines live side by side and are timed alternately, so load on a shared machine hits both.
TPOT = (time for N tokens − time for 1 token) / (N − 1), median over reps. Unique experts per
layer per decode step come from the plugin's telemetry (before = the exact choice). Greedy
agreement = mean common prefix of the LYNX and exact continuations, as a fraction of N.

    .venv-vllm/bin/python benchmarks/vllm_lynx.py [--batch 1,4,16] [--new 16] [--pad 4096]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEMO = ROOT / "lynx_edge" / "demo"


def padded_demo(out: Path, inter: int) -> Path:
    """The demo checkpoint with every expert zero-padded to intermediate size `inter`."""
    import torch
    from safetensors.torch import load_file, save_file

    sd = load_file(str(DEMO / "model.safetensors"))
    for k, v in list(sd.items()):
        if ".mlp.experts." in k:  # gate/up [I, D] → [inter, D]; down [D, I] → [D, inter]
            pad = torch.zeros((inter, v.shape[1]) if "down_proj" not in k else (v.shape[0], inter), dtype=v.dtype)
            pad[: v.shape[0], : v.shape[1]] = v
            sd[k] = pad
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((DEMO / "config.json").read_text()) | {"moe_intermediate_size": inter}
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / f).write_bytes((DEMO / f).read_bytes())
    return out


def prompts(n: int, length: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(DEMO / "tokenizer.json")).encode((DEMO / "heldout.txt").read_text()).ids
    return [ids[i * 97: i * 97 + length] for i in range(n)]


def timed(llm, ps, n: int):
    from vllm import SamplingParams

    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    def prefix(x, y):
        k = 0
        while k < len(x) and k < len(y) and x[k] == y[k]:
            k += 1
        return k / max(len(x), 1)

    return statistics.mean(prefix(x, y) for x, y in zip(a, b))


def bench_model(model: Path, label: str, args) -> list[dict]:
    from vllm import LLM

    from lynx_edge.integrations import vllm as lv

    kw = dict(model=str(model), dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=16,
              seed=0, distributed_executor_backend="uni")
    engines = {"exact": LLM(**kw), args.lynx: LLM(**kw, additional_config={"lynx": args.lynx})}
    rows = []
    for B in [int(b) for b in args.batch.split(",")]:
        ps = prompts(B, args.prompt)
        tp = {m: [] for m in engines}
        toks = {}
        for r in range(args.reps + 1):  # round 0 warms up
            for m, llm in engines.items():
                if m != "exact":
                    lv.reset_stats()
                t1, _ = timed(llm, ps, 1)
                tn, toks[m] = timed(llm, ps, args.new)
                if r:
                    tp[m].append(1000 * (tn - t1) / (args.new - 1))
        s = lv.collect_stats()
        ex, ly = statistics.median(tp["exact"]), statistics.median(tp[args.lynx])
        row = {"model": label, "batch": B, "tpot_ms_exact": ex, "tpot_ms_lynx": ly, "speedup": ex / ly,
               "unique_exact": s["unique_before"], "unique_lynx": s["unique_after"],
               "reduction_pct": s["reduction_pct"], "remap_rate_pct": s["remap_rate_pct"],
               "decode_steps": s["decode_steps"], "greedy_agreement": agreement(toks[args.lynx], toks["exact"]),
               "tpot_all": tp}
        print(json.dumps({k: v for k, v in row.items() if k != "tpot_all"}), flush=True)
        rows.append(row)
    del engines
    gc.collect()
    return rows


def write_md(out: dict, path: Path) -> None:
    lines = [f"# vLLM {out['vllm']} on CPU: LYNX plugin (`{out['lynx']}`) vs exact", "",
             f"{out['threads']} torch thread(s), prompt {out['prompt_tokens']} tokens, {out['new_tokens']} new "
             f"tokens, median of {out['reps']} alternated reps. Reproduce: `{out['command']}`.", "",
             "Unique experts: the plugin's telemetry per MoE layer per decode step (exact = the exact choice "
             "of the same tokens). TPOT = (t(N tokens) − t(1 token)) / (N − 1), median (min–max). Greedy "
             "agreement: mean common prefix of the LYNX and exact free-running continuations / N (one early "
             "divergence counts every later token as disagreement).", "",
             "| model | B | unique experts/layer/step (exact → LYNX) | reduction | remap rate | "
             "TPOT exact ms | TPOT LYNX ms | speed-up (medians) | greedy agreement |", "|---|---|---|---|---|---|---|---|---|"]
    def tpot(r, m):  # median (min–max over reps): the spread says how much to trust it
        v = r["tpot_all"][m]
        return f"{statistics.median(v):.1f} ({min(v):.0f}–{max(v):.0f})"

    for r in out["rows"]:
        lines.append(f"| {r['model']} | {r['batch']} | {r['unique_exact']:.2f} → {r['unique_lynx']:.2f} | "
                     f"{r['reduction_pct']:.1f}% | {r['remap_rate_pct']:.1f}% | {tpot(r, 'exact')} | "
                     f"{tpot(r, out['lynx'])} | {r['speedup']:.2f}x | {100 * r['greedy_agreement']:.1f}% |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--pad", type=int, default=4096, help="0: skip the zero-padded demo")
    ap.add_argument("--lynx", default="on")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/vllm_lynx.json"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import vllm

    out = {"benchmark": "vLLM CPU decode, LYNX plugin vs exact", "vllm": vllm.__version__, "lynx": args.lynx,
           "threads": torch.get_num_threads(), "prompt_tokens": args.prompt, "new_tokens": args.new,
           "reps": args.reps, "command": "python benchmarks/vllm_lynx.py " + " ".join(sys.argv[1:]), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        models = [(DEMO, "demo")]
        if args.pad:
            models.append((padded_demo(Path(tmp) / "padded", args.pad), f"demo padded I={args.pad}"))
        for model, label in models:
            out["rows"] += bench_model(model, label, args)
            out["threads"] = torch.get_num_threads()  # vLLM sets its own thread count
            Path(args.out).write_text(json.dumps(out, indent=1))
    write_md(out, Path(args.out).with_suffix(".md"))


if __name__ == "__main__":
    main()
