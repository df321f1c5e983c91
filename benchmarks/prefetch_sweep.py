"""One-token rows streamed from DRAM: lynx_linear (or lynx_linear_int4) built with several values of
a prefetch macro (kernels/cpu_native.c: TILE_PREFETCH, the distance, or PF_HINT, the cache level)
against torch's sum over the same bytes, one thread, rounds alternating.

Each round runs 16 matrices of 24 MB (more than a 32 MB L3 holds between calls) through every
build, order flipped per round, then sums them with torch: GB/s of weights read, medians and
ranges. It answers how far the row kernel's streaming is from the machine's plain read rate and
whether the prefetch distance or level is what limits it.

    python benchmarks/prefetch_sweep.py --distances 8192,32768,65536 --k 1024 --dtype float32
    python benchmarks/prefetch_sweep.py --defines PF_HINT=_MM_HINT_T0,PF_HINT=_MM_HINT_T1 --dtype int4
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def builds(variants: list[str]) -> dict:
    """variant "NAME=VALUE[:NAME=VALUE…]" → the kernel library built with those `#define`s (this tree's source
    otherwise; NAME must have a `#define` line of its own there)"""
    from lynx_edge.kernels import native

    src = native.SRC.read_text()
    libs = {}
    for v in variants:
        text = src
        for define in v.split(":"):  # "A=1:B=2" sets both in one build
            name, value = define.split("=", 1)
            pat = re.compile(rf"^#define {re.escape(name)} .*$", re.M)
            if not pat.search(text):
                sys.exit(f"prefetch_sweep: {native.SRC} has no line '#define {name} …' to vary")
            text = pat.sub(f"#define {name} {value}", text, count=1)
        p = Path(tempfile.mkdtemp()) / "cpu_native.c"
        p.write_text(text)
        native.SRC = p
        native.lib.cache_clear()
        libs[v] = native.lib()
    native.SRC = ROOT / "lynx_edge/kernels/cpu_native.c"
    return libs


def weights(dtype: str, k: int) -> tuple[list, callable]:
    """16 matrices of 24 MB of fp32 rows' worth of inputs (fewer bytes in bf16 / int4) and the call
    that runs one of them on one token"""
    from lynx_edge.kernels import native

    n = 6144 * 1024 // k
    if dtype != "int4":
        return [torch.randn(n, k).to(getattr(torch, dtype)) for _ in range(16)], native.linear
    g = 128  # symmetric INT4, group 128, no act order: the packed GPTQ row layout
    ws = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), (torch.rand(k // g, n) / 64).half())
          for _ in range(16)]
    return ws, lambda x, w: native.linear_int4(x, w[0], w[1], None)


def nbytes(w) -> int:
    return sum(t.numel() * t.element_size() for t in (w if isinstance(w, tuple) else (w,)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--distances", default="8192,16384,32768,65536", help="TILE_PREFETCH values")
    ap.add_argument("--defines", default=None, help="NAME=VALUE[:NAME=VALUE],… builds to compare instead of --distances")
    ap.add_argument("--k", type=int, default=1024, help="inputs per row")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "int4"))
    ap.add_argument("-r", "--rounds", type=int, default=9)
    ap.add_argument("--out", default=None, help="append this run to a JSON list")
    a = ap.parse_args()
    from lynx_edge.bench import cpu_isa
    from lynx_edge.kernels import native

    torch.set_num_threads(1)
    dists = (a.defines.split(",") if a.defines else [f"TILE_PREFETCH={d}" for d in a.distances.split(",")])
    libs, cur = builds(dists), [dists[0]]
    native.lib = lambda: libs[cur[0]]
    ws, call = weights(a.dtype, a.k)
    x = torch.randn(1, a.k)
    total = sum(nbytes(w) for w in ws)
    gbs: dict = {d: [] for d in dists} | {"torch_sum": []}
    for r in range(a.rounds):
        for d in (dists if r % 2 == 0 else dists[::-1]):
            cur[0] = d
            t = time.perf_counter()
            for w in ws:
                call(x, w)
            gbs[d].append(total / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        for w in ws:
            (w[0] if isinstance(w, tuple) else w).sum()
        gbs["torch_sum"].append(total / (time.perf_counter() - t) / 1e9)
    rows = {str(k): {"median_gb_s": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2)}
            for k, v in gbs.items()}
    from lynx_edge.kernels import native

    res = {"benchmark": "prefetch_sweep", "isa": cpu_isa(), "march": native.FLAGS[1], "dtype": a.dtype, "k": a.k, "rounds": a.rounds,
           "threads": 1, "torch": torch.__version__, "gb_s": rows}
    print(json.dumps(res, indent=1))
    if a.out:
        out = Path(a.out)
        runs = json.loads(out.read_text()) if out.is_file() else []
        out.write_text(json.dumps(runs + [res], indent=1))


if __name__ == "__main__":
    main()
