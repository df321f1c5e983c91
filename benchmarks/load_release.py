"""Peak memory of a 4-bit load from a 16-bit checkpoint, with the loader's page release
(Checkpoint.release: each tensor's pages leave the process once it is in place) on and off, each load
in a fresh process, modes alternating: load seconds, peak anonymous and file-backed memory
(lynx_edge.rss.RssWatch) and the process's max RSS.

    python benchmarks/load_release.py MODEL_DIR [-r 2] [--out benchmarks/results/load_release_s38.json]
MODEL_DIR: e.g. full_size.py's LFM2-8B-A1B (~/.cache/lynx-edge/llamacpp/models/lfm2-24l-v65536, 16.7 GB
bf16), loaded `--int4 --int4-attn --int8-head` on two threads.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(mode: str, path: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import resource

    from lynx_edge import Engine
    from lynx_edge.checkpoint import Checkpoint
    from lynx_edge.rss import RssWatch

    if mode == "off":
        Checkpoint.release = lambda self, names: None
    t0 = time.perf_counter()
    with RssWatch() as w:
        Engine.from_pretrained(path, device="cpu", threads=2, int4=True, int4_attn=True, int8_head=True)
    return {"release": mode, "load_s": round(time.perf_counter() - t0, 1),
            "peak_anon_GB": round((w.peak["anon"] - w.start["anon"]) / 1e9, 2),
            "peak_file_GB": round((w.peak["file"] - w.start["file"]) / 1e9, 2),
            "maxrss_GB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("-r", "--rounds", type=int, default=2)
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.model)))
        return
    rows = []
    for _ in range(a.rounds):
        for mode in ("on", "off"):
            out = subprocess.run([sys.executable, __file__, a.model, "--child", mode], capture_output=True, text=True,
                                 check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    if a.out:
        a.out.write_text(json.dumps({"benchmark": __doc__.split("\n")[0], "model": a.model, "rows": rows,
                                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1) + "\n")


if __name__ == "__main__":
    main()
