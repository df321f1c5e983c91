"""Benchmark on the one streaming call: synthetic prompts, prefill and decode timed apart,
mean ± std over repetitions after a warm-up, per batch size and LYNX mode.

    result = run_bench(engine, [1, 4, 16], prompt_len=512, gen_len=128, reps=5, lynx_modes=["off", "lynx"])

Every number comes from the stats dict of Engine.stream_batch's last chunk, so bench measures
exactly what users run. Rows are flat dicts (`x` mean, `x_std` std) so JSON and CSV are trivial.
"""
from __future__ import annotations

import importlib
import inspect
import random
import statistics
from pathlib import Path
from typing import Callable

# Metrics averaged over repetitions (each present only when the engine reports it).
METRICS = ("prefill_tok_s", "prefill_s", "decode_tok_s", "tpot_ms", "unique_experts_per_layer",
           "remap_pct", "bytes_per_token", "hit_rate_pct", "proj_tok_s", "proj_hit_rate_pct", "proj_bytes_per_token")


def synthetic_prompts(engine, batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of exactly `prompt_len` token ids: windows of the model dir's heldout.txt
    when it is long enough, else ids drawn uniformly from the vocab; fixed by `seed`."""
    rng = random.Random(seed)
    heldout = Path(engine.model_dir) / "heldout.txt"
    if heldout.is_file():
        ids = engine.tokenizer.encode(heldout.read_text(encoding="utf-8"), add_special_tokens=False)
        if len(ids) >= prompt_len:
            starts = [rng.randrange(len(ids) - prompt_len + 1) for _ in range(batch)]
            return [ids[s:s + prompt_len] for s in starts]
    vocab = min(engine.cfg.vocab_size, engine.tokenizer.vocab_size)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _offload_metrics(stats: dict) -> dict:
    """Cache hit rate and host→device bytes per generated token from stats["offload"] (the
    offload runtime's counters for this generation), when present."""
    off = stats.get("offload")
    if not isinstance(off, dict):
        return {}
    out = {}
    if "hit_rate" in off:
        out["hit_rate_pct"] = 100.0 * float(off["hit_rate"])
    elif "hits" in off and "misses" in off:
        n = off["hits"] + off["misses"]
        out["hit_rate_pct"] = 100.0 * off["hits"] / n if n else 0.0
    for key in ("bytes_per_decode_token", "bytes_per_token"):
        if key in off:
            out["bytes_per_token"] = float(off[key])
            break
    else:
        moved = off.get("bytes_h2d", off.get("bytes_moved"))
        if moved is not None:
            out["bytes_per_token"] = float(moved) / max(1, stats.get("completion_tokens", 0))
    return out


def metrics(stats: dict) -> dict:
    """One generation's stats → the bench metrics it supports."""
    out = {k: float(stats[k]) for k in ("prefill_tok_s", "prefill_s", "decode_tok_s", "tpot_ms")}
    if "unique_experts_per_layer" in stats:
        out["unique_experts_per_layer"] = float(stats["unique_experts_per_layer"])
    if isinstance(stats.get("lynx"), dict) and "remap_rate_pct" in stats["lynx"]:
        out["remap_pct"] = float(stats["lynx"]["remap_rate_pct"])
    out.update(_offload_metrics(stats))
    return out


def measure(engine, prompts: list[list[int]], gen_len: int) -> dict:
    """One batched greedy generation of exactly gen_len tokens per prompt → its stats dict."""
    stats = None
    for chunk in engine.stream_batch(prompts, max_new_tokens=gen_len, ignore_eos=True):
        if chunk.stats is not None:
            stats = chunk.stats
    if stats is None:
        raise RuntimeError("the engine finished a generation without its stats")
    return stats


def aggregate(runs: list[dict]) -> dict:
    """Per metric: mean and sample std over the repetitions."""
    out = {}
    for key in METRICS:
        vals = [r[key] for r in runs if key in r]
        if len(vals) == len(runs) and vals:
            out[key] = statistics.fmean(vals)
            out[key + "_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return out


def run_bench(engine, batch_sizes: list[int], prompt_len: int, gen_len: int, reps: int,
              lynx_modes: list[str] | tuple[str, ...] = ("off",), seed: int = 0,
              progress: Callable[[int, int], None] | None = None,
              project: Callable[[], dict] | None = None) -> dict:
    """Time every (batch size, LYNX mode): one short warm-up, then `reps` timed runs.
    → {"config": …, "rows": [{batch, lynx, metric, metric_std, …}], "compare": […] (2+ modes)}.
    project (see `projector`): called after each timed run, adds proj_* metrics to the row."""
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be ≥ 1, got {batch_sizes}")
    if prompt_len < 1 or gen_len < 2 or reps < 1:
        raise ValueError("bench needs prompt length ≥ 1, ≥ 2 generated tokens (to time decode) and ≥ 1 repetition")
    if prompt_len + gen_len >= engine.ctx:
        raise ValueError(f"{prompt_len} prompt + {gen_len} generated tokens do not fit the context of "
                         f"{engine.ctx} (lower -p/-n or raise --ctx-size)")
    total, done = len(batch_sizes) * len(lynx_modes) * (reps + 1), 0
    rows, paired = [], {}
    try:
        for b in batch_sizes:
            prompts = synthetic_prompts(engine, b, prompt_len, seed)
            for mode in lynx_modes:
                engine.set_lynx(mode)
                measure(engine, prompts, min(gen_len, 4))  # warm-up: allocations, caches, kernels
                done += 1
                if progress:
                    progress(done, total)
            runs = {mode: [] for mode in lynx_modes}
            # modes alternate within each repetition, so background load hits them alike and each
            # repetition gives one paired speed-up (the spread shown next to the mean)
            for _ in range(reps):
                for mode in lynx_modes:
                    engine.set_lynx(mode)
                    runs[mode].append(metrics(measure(engine, prompts, gen_len)))
                    if project is not None:  # replays this run's routing (still recorded on the model)
                        runs[mode][-1].update(_projected(project()))
                    done += 1
                    if progress:
                        progress(done, total)
            for mode in lynx_modes:
                rows.append({"batch": b, "lynx": mode, **aggregate(runs[mode])})
                paired[b, mode] = [r["decode_tok_s"] for r in runs[mode]]
    finally:
        engine.set_lynx(engine.config.lynx)
    result = {"config": _describe(engine, prompt_len, gen_len, reps, seed), "rows": rows}
    if len(lynx_modes) > 1:
        result["compare"] = compare(rows, lynx_modes[0], paired)
    return result


def model_shape(cfg):
    """ModelConfig → the offload projection's ModelShape of this very model."""
    from .modelinfo import param_counts
    from .offload.projection import ModelShape

    return ModelShape(cfg.model_type, len(cfg.moe_layer_ids), cfg.num_experts, cfg.top_k, cfg.hidden_size,
                      cfg.moe_intermediate_size, float(param_counts(cfg)["non_expert"]), cfg.num_kv_heads,
                      cfg.head_dim)


def projector(engine, profile: str, shape: str | None = None) -> Callable[[], dict]:
    """→ a callable replaying the engine's last recorded routing (record_routing=True) through
    lynx_edge.offload.projection for `profile` and `shape` (a MODEL_SHAPES name; None: this model)."""
    from .offload import projection
    from .offload.profile import load_profile

    prof = load_profile(profile)
    target = shape if shape is not None else model_shape(engine.cfg)
    if isinstance(target, str) and target.lower() not in projection.MODEL_SHAPES:
        raise ValueError(f"unknown shape {target!r}; known: {', '.join(projection.MODEL_SHAPES)}")

    def run() -> dict:
        trace = projection.trace_from_stats(engine.model.routing.stats)
        return projection.project(trace, target, prof, policy=prof.policy, ctx=engine.ctx,
                                  trace_experts=engine.cfg.num_experts)

    return run


def _projected(p: dict) -> dict:
    return {"proj_tok_s": p["tok_s"], "proj_hit_rate_pct": 100.0 * p["hit_rate"],
            "proj_bytes_per_token": p["bytes_per_token"]}


def _describe(engine, prompt_len: int, gen_len: int, reps: int, seed: int) -> dict:
    import torch

    heldout = (Path(engine.model_dir) / "heldout.txt").is_file()
    conf = getattr(engine, "config", None)
    placement = getattr(engine.model, "placement", None)
    return {"model": str(engine.model_dir), "family": engine.cfg.model_type, "device": str(engine.model.device),
            "dtype": str(engine.model.dtype).replace("torch.", ""), "prompt_len": prompt_len,
            "gen_len": gen_len, "reps": reps, "seed": seed, "prompts": "heldout.txt" if heldout else "random ids",
            # what shapes the numbers: threads in use, expert storage and placement (--int4/--offload)
            "threads": torch.get_num_threads(), "int4": bool(getattr(conf, "int4", False)),
            "offload": bool(getattr(conf, "offload", False)),
            "experts": getattr(placement, "experts", None), "isa": cpu_isa(),
            "int4_attn": bool(getattr(conf, "int4_attn", False)), "int4_act": getattr(placement, "int4_act", None),
            "bf16_act": getattr(placement, "bf16_act", None),  # CPU bf16 weights' activations (--bf16-act)
            "int8_head": bool(getattr(placement, "int8_head", False)),
            "packed_linears": getattr(placement, "packed_linears", 0),  # attention read 4/8-bit on a CPU
            # whether the CPU decode ran lynx-edge's native kernels (kernels/cpu_native.c) or the
            # torch/numba fallbacks (no C compiler, LYNX_EDGE_NATIVE=0)
            "native_kernels": native_kernels(),
            # greedy decode steps per native call (core.EngineCore._burst; 1 = a call per step)
            "num_scheduler_steps": getattr(conf, "num_scheduler_steps", 1)}


def native_kernels() -> bool:
    from .kernels import native

    return native.lib() is not None


def cpu_isa() -> str:
    """The best SIMD level torch's CPU kernels use here (e.g. AVX512, AVX2, DEFAULT for Arm NEON)."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older torch
        return "unknown"


def compare(rows: list[dict], base_mode: str, paired: dict | None = None) -> list[dict]:
    """Each non-base row against the base mode at the same batch size: decode speed-up, the
    reduction of unique experts per layer, and a plain verdict. With `paired` ({(batch, mode):
    per-repetition tok/s}, repetitions alternating the modes) the speed-up is the median of the
    per-repetition ratios, with their min and max: a burst of background load inside one
    repetition moves one ratio, not the median. Without it: the ratio of the mean tok/s."""
    base = {r["batch"]: r for r in rows if r["lynx"] == base_mode}
    out = []
    for r in rows:
        b0 = base.get(r["batch"])
        if r["lynx"] == base_mode or b0 is None:
            continue
        c = {"batch": r["batch"], "lynx": r["lynx"], "base": base_mode,
             "speedup": r["decode_tok_s"] / b0["decode_tok_s"] if b0["decode_tok_s"] else 0.0}
        u0, u1 = b0.get("unique_experts_per_layer"), r.get("unique_experts_per_layer")
        if u0 and u1 is not None:
            c["unique_reduction_pct"] = 100.0 * (u0 - u1) / u0
        if paired is not None and (r["batch"], base_mode) in paired:
            ratios = [x / y for x, y in zip(paired[r["batch"], r["lynx"]], paired[r["batch"], base_mode]) if y]
            if ratios:
                c["speedup"] = statistics.median(ratios)
                c["speedup_min"], c["speedup_max"] = min(ratios), max(ratios)
        c["verdict"] = verdict(c)
        out.append(c)
    return out


def verdict(c: dict) -> str:
    """One plain phrase for a compare row: does LYNX pay at this batch size on this machine?"""
    lo, hi = c.get("speedup_min", c["speedup"]), c.get("speedup_max", c["speedup"])
    if c.get("unique_reduction_pct") is not None and c["unique_reduction_pct"] <= 0.0:
        return "slower: nothing to pool, routing cost only" if hi < 1.0 else "no change (nothing to pool)"
    if lo > 1.0:
        return "faster"
    if hi < 1.0:
        return "slower: LYNX does not pay here"
    return "within noise: no clear gain"


QUALITY = {"fast": dict(num_seqs=16, seq_len=96, prefill_len=64), "full": dict(num_seqs=32, seq_len=128, prefill_len=64)}


def quality_delta(engine, batch_sizes: list[int], lynx: str = "lynx", text: str | None = None,
                  level: str = "full") -> tuple[list[dict] | None, str]:
    """LYNX's quality change from lynx_edge.eval (perplexity change %, greedy agreement %) per
    batch size, on `text` or the model dir's heldout.txt → (rows or None, why not). level: fast
    (16 windows × 32 teacher-forced decode steps: seconds on the demo) | full (32 × 64, the
    README's sweep settings). Batch sizes above the window count are skipped."""
    try:
        mod = importlib.import_module("lynx_edge.eval")
    except ModuleNotFoundError as exc:
        if exc.name in ("lynx_edge.eval", "lynx_edge"):
            return None, "this build has no lynx_edge.eval"
        raise
    fn = getattr(mod, "evaluate", None) or getattr(mod, "run_eval", None)
    if fn is None:
        return None, "lynx_edge.eval has no evaluate()"
    if text is None and not (Path(engine.model_dir) / "heldout.txt").is_file():
        return None, "the model has no heldout.txt to measure quality on (see `lynx-edge eval --file`)"
    q = QUALITY[level]
    sizes = [b for b in batch_sizes if b <= q["num_seqs"]]
    rows = eval_rows(call_supported(fn, engine, text=text, batch_sizes=sizes, lynx=lynx, **q))
    return rows, f"lynx_edge.eval ({level}: {q['num_seqs']} windows × {q['seq_len'] - q['prefill_len']} decode steps)"


# lynx_edge.eval's results → rows with these names (the eval module may use any of the aliases)
_EVAL_KEYS = {
    "batch": ("batch", "batch_size"),
    "mode": ("mode", "lynx"),
    "unique_exact": ("unique_exact", "experts_exact", "unique_experts_exact"),
    "unique_lynx": ("unique_lynx", "experts_lynx", "unique_experts_lynx"),
    "reduction_pct": ("reduction_pct", "unique_reduction_pct"),
    "ppl_exact": ("ppl_exact", "perplexity_exact"),
    "ppl_lynx": ("ppl_lynx", "perplexity_lynx"),
    "ppl_change_pct": ("ppl_change_pct", "perplexity_change_pct"),
    "greedy_agreement_pct": ("greedy_agreement_pct", "agreement_pct", "greedy_agreement"),
}


def eval_rows(result) -> list[dict]:
    """Normalise lynx_edge.eval's output (a list of per-batch dicts, or a dict holding one under
    rows/results/per_batch) to _EVAL_KEYS names, deriving the percentages when absent."""
    if isinstance(result, dict):
        result = next((result[k] for k in ("rows", "results", "per_batch") if k in result), [result])
    rows = []
    for raw in result:
        raw = raw if isinstance(raw, dict) else vars(raw)
        row = {k: next((raw[a] for a in names if a in raw), None) for k, names in _EVAL_KEYS.items()}
        ue, ul, pe, pl = row["unique_exact"], row["unique_lynx"], row["ppl_exact"], row["ppl_lynx"]
        if row["reduction_pct"] is None and ue and ul is not None:
            row["reduction_pct"] = 100.0 * (ue - ul) / ue
        if row["ppl_change_pct"] is None and pe and pl is not None:
            row["ppl_change_pct"] = 100.0 * (pl - pe) / pe
        rows.append(row)
    return rows


def call_supported(fn: Callable, *args, **kwargs):
    """Call fn with the keyword arguments its signature takes (optional modules grow at their pace)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def plot_bench(result: dict, path: str | Path) -> Path:
    """PNG: decode tok/s and unique experts per layer vs batch size, one line per LYNX mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        raise RuntimeError("--plot needs matplotlib: pip install 'lynx-edge[bench]'") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["lynx"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["lynx"] == mode]
        label = "exact" if mode == "off" else f"LYNX ({mode})"
        xs = [r["batch"] for r in rows]
        ys = [r["decode_tok_s"] for r in rows]
        # bars never reach below zero: a lower error of mean − 0 at most (std can exceed the mean)
        err = [[min(r.get("decode_tok_s_std", 0.0), y) for r, y in zip(rows, ys)],
               [r.get("decode_tok_s_std", 0.0) for r in rows]]
        ax1.errorbar(xs, ys, err, marker="o", label=label, capsize=3)
        ax1.set_ylim(bottom=0)
        if all("unique_experts_per_layer" in r for r in rows):
            ax2.plot(xs, [r["unique_experts_per_layer"] for r in rows], marker="o", label=label)
    for ax, title in ((ax1, "decode tok/s"), (ax2, "unique experts / layer")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


__all__ = ["METRICS", "QUALITY", "aggregate", "compare", "cpu_isa", "native_kernels", "verdict", "eval_rows", "measure", "metrics", "model_shape", "plot_bench",
           "projector", "quality_delta", "run_bench", "synthetic_prompts"]
