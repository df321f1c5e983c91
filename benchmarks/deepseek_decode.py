"""DeepSeek-V2-Lite's CPU decode under `--int4` with and without `--int4-attn`, side by side.

`--int4-attn` makes MLA's projections INT4 too (q_proj, kv_a_proj_with_mqa, o_proj: RTN at load; not
kv_b_proj, which the absorbed decode reads itself), and the first layer's dense MLP and the shared
experts. A V2-Lite layer's attention is ~14 M parameters (28 MB in bf16) against 6 routed experts of
2048 x 1408 (~28 M parameters, ~15 MB in 4-bit) and two shared ones: with 4-bit experts, bf16
attention and shared experts are most of a token's bytes.

The checkpoint: the published DeepSeek-V2-Lite config (tests/fixtures/real) at 4 of its 27 layers (the
dense first one and 3 MoE layers of 64 experts), vocabulary 4096 (the test tokenizer), random weights
written once by transformers under ~/.cache/lynx-edge/bench. Both engines loaded once, 24 decode tokens
after 16-token prompts, rounds in turn (reversed every other round); medians and the median paired ratio.

    python benchmarks/deepseek_decode.py [--batch 1,16] [--threads 1] [-r 5] [--out benchmarks/results/deepseek_int4attn_s37.json]
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from vs_llamacpp import ab_parser, engines_ab, paired_ratio  # noqa: E402

REAL = ROOT / "tests/fixtures/real/deepseek-v2-lite-chat/config.json"
LAYERS, VOCAB = 4, 4096


def checkpoint() -> Path:
    path = Path.home() / f".cache/lynx-edge/bench/deepseek-v2-lite-{LAYERS}l"
    if (path / "config.json").is_file():
        return path
    import torch
    import transformers
    from conftest import write_tokenizer  # needs the dev extra (transformers, tokenizers)

    print(f"writing the random DeepSeek-V2-Lite checkpoint {path} …", flush=True)
    cfg = {**json.loads(REAL.read_text()), "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
           "bos_token_id": 0, "eos_token_id": 2}
    cfg.pop("auto_map", None)  # remote code is never run
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path),
                                                          dtype=torch.bfloat16)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(path)
    return path


def main() -> None:
    ap = ab_parser(__doc__)
    a = ap.parse_args()
    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, synthetic_prompts
    from lynx_edge.modelinfo import dense_decode_bytes
    from lynx_edge.threads import set_threads

    set_threads(a.threads, explicit=True)
    path = checkpoint()
    batches = [int(b) for b in a.batch.split(",")]
    engines = {k: Engine.from_pretrained(path, device="cpu", max_num_seqs=max(batches), dtype="bfloat16", int4=True,
                                         int4_attn=k == "int4+attn") for k in ("int4", "int4+attn")}
    # MiB every token reads outside the routed experts (modelinfo.dense_decode_bytes)
    non_expert_mb = {k: round(dense_decode_bytes(e.model) / 2**20, 1) for k, e in engines.items()}
    rows = []
    for B in batches:
        tok_s = engines_ab(engines, synthetic_prompts(engines["int4"], B, 16), a.rounds, 24)
        row = {"batch": B, "threads": a.threads, "tok_s": {k: round(statistics.median(v), 2) for k, v in tok_s.items()},
               "int4attn_vs_int4": paired_ratio(tok_s["int4+attn"], tok_s["int4"])}
        rows.append(row)
        print(row, flush=True)
    print({"non_expert_mb": non_expert_mb}, flush=True)
    if a.out:
        a.out.write_text(json.dumps({"benchmark": __doc__.split("\n")[0], "isa": cpu_isa(), "rounds": a.rounds,
                                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "layers": LAYERS,
                                     "vocab": VOCAB, "non_expert_mb": non_expert_mb, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
