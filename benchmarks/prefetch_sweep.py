"""One-token dense rows streamed from DRAM: lynx_linear built with several TILE_PREFETCH distances
(kernels/cpu_native.c) against torch's sum over the same bytes, one thread, rounds alternating.

Each round runs 16 matrices of 24 MB (more than a 32 MB L3 holds between calls) through every
build, order flipped per round, then sums them with torch: GB/s of weights read, medians and
ranges. It answers how far the row kernel's streaming is from the machine's plain read rate and
whether the prefetch distance is what limits it.

    python benchmarks/prefetch_sweep.py --distances 8192,32768,65536 --k 1024 --dtype float32
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT = "#define TILE_PREFETCH 8192"


def builds(distances: list[int]) -> dict:
    """distance → the kernel library built with that TILE_PREFETCH (this tree's source otherwise)"""
    from lynx_edge.kernels import native

    src = native.SRC.read_text()
    if DEFAULT not in src:
        sys.exit(f"prefetch_sweep: {native.SRC} has no line {DEFAULT!r} to vary")
    libs = {}
    for d in distances:
        p = Path(tempfile.mkdtemp()) / "cpu_native.c"
        p.write_text(src.replace(DEFAULT, f"#define TILE_PREFETCH {d}"))
        native.SRC = p
        native.lib.cache_clear()
        libs[d] = native.lib()
    native.SRC = ROOT / "lynx_edge/kernels/cpu_native.c"
    return libs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--distances", default="8192,16384,32768,65536")
    ap.add_argument("--k", type=int, default=1024, help="inputs per row")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("-r", "--rounds", type=int, default=9)
    ap.add_argument("--out", default=None, help="append this run to a JSON list")
    a = ap.parse_args()
    from lynx_edge.bench import cpu_isa
    from lynx_edge.kernels import native

    torch.set_num_threads(1)
    dists = [int(d) for d in a.distances.split(",")]
    libs, cur = builds(dists), [dists[0]]
    native.lib = lambda: libs[cur[0]]
    dt = getattr(torch, a.dtype)
    ws = [torch.randn(6144 * 1024 // a.k, a.k).to(dt) for _ in range(16)]  # 16 x 24 MB (fp32)
    x = torch.randn(1, a.k)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    gbs: dict = {d: [] for d in dists} | {"torch_sum": []}
    for r in range(a.rounds):
        for d in (dists if r % 2 == 0 else dists[::-1]):
            cur[0] = d
            t = time.perf_counter()
            for w in ws:
                native.linear(x, w)
            gbs[d].append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        for w in ws:
            w.sum()
        gbs["torch_sum"].append(nbytes / (time.perf_counter() - t) / 1e9)
    rows = {str(k): {"median_gb_s": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2)}
            for k, v in gbs.items()}
    res = {"benchmark": "prefetch_sweep", "isa": cpu_isa(), "dtype": a.dtype, "k": a.k, "rounds": a.rounds,
           "threads": 1, "torch": torch.__version__, "gb_s": rows}
    print(json.dumps(res, indent=1))
    if a.out:
        out = Path(a.out)
        runs = json.loads(out.read_text()) if out.is_file() else []
        out.write_text(json.dumps(runs + [res], indent=1))


if __name__ == "__main__":
    main()
