"""This tree's native kernels against another revision's, end to end: decode tok/s of one engine
through the streaming call (bench.measure), the two builds alternating round by round in one
process (native_ab.Builds swaps the library every native call goes to). What a kernel change does
to a real step, beside the kernel-level A/Bs (int4_rows.py, dense_tiles.py, attn_decode.py).

    python benchmarks/decode_ab.py --base HEAD~1 --model PATH [--batch 1,16] [--int4-act q16] [--lynx lynx] [-r 7]
Appends to benchmarks/results/decode_ab.json (or --out).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from native_ab import Builds, append_run, paired, parser  # noqa: E402  (beside this script)


def tokens(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The greedy tokens of one batched generation, per prompt."""
    out = [[] for _ in prompts]
    for chunk in engine.stream_batch(prompts, max_new_tokens=n, ignore_eos=True):
        out[chunk.index] += chunk.token_ids
    return out


def main() -> None:
    ap = parser("decode_ab.json", rounds=7)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per round")
    ap.add_argument("--int4-act", default=None, choices=("f32", "q16", "q8"))
    ap.add_argument("--lynx", default="off", help="routing, as lynx-edge's --lynx (off: exact)")
    ap.add_argument("--prompt-len", type=int, default=8, help="tokens per prompt (the main job: 128)")
    a = ap.parse_args()
    builds = Builds(a.base, "decode_ab")  # before the engine: its plans must not pin a build
    from lynx_edge import Engine
    from lynx_edge.bench import measure, synthetic_prompts
    from lynx_edge.threads import set_threads

    set_threads(a.threads, explicit=True)
    sizes = [int(b) for b in a.batch.split(",")]
    eng = Engine.from_pretrained(a.model, device="cpu", dtype=a.dtype, max_num_seqs=max(sizes), int4_act=a.int4_act,
                               lynx=a.lynx)
    run = builds.header("end-to-end decode, this tree vs --base (one engine, builds alternating)", a.rounds)
    run |= {"model": str(a.model), "dtype": a.dtype, "threads": a.threads, "tokens": a.tokens,
            "int4_act": a.int4_act, "lynx": a.lynx, "prompt_len": a.prompt_len, "rows": []}
    for B in sizes:
        prompts = synthetic_prompts(eng, B, a.prompt_len)
        tok, tpot = {}, {"base": [], "tree": []}
        for tag in ("base", "tree"):  # warm-up, and the tokens each build generates (greedy)
            builds.use(tag)
            tok[tag] = tokens(eng, prompts, a.tokens)
        for r in range(a.rounds):
            for tag in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                builds.use(tag)
                tpot[tag].append(measure(eng, prompts, a.tokens + 1)["tpot_ms"])
        row = {"batch": B, "base_tpot_ms": statistics.median(tpot["base"]),
               "tree_tpot_ms": statistics.median(tpot["tree"]),
               "speedup": {k: round(v, 3) for k, v in paired(tpot["base"], tpot["tree"]).items()},
               "same_tokens": tok["base"] == tok["tree"]}
        run["rows"].append(row)
        print(json.dumps(row), flush=True)
    append_run(Path(a.out), run)


if __name__ == "__main__":
    main()
