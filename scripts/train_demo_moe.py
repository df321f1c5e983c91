#!/usr/bin/env python
"""Train lynx-edge's embedded demo MoE model (a tiny fine-grained Qwen3-MoE) on CPU.

The result is a transformers-loadable checkpoint (``model_type: qwen3_moe``, i.e.
``Qwen3MoeForCausalLM``) written to ``lynx_edge/demo/``: model.safetensors, config.json,
tokenizer.json, tokenizer_config.json (ChatML chat template), generation_config.json,
heldout.txt and a README.md model card. Figures go to ``benchmarks/results/demo_model.json``.

Corpus
    The ``.py`` sources of the running interpreter's standard library
    (``sysconfig.get_paths()["stdlib"]``), every machine has them offline. Directories named
    ``test``/``tests``/``idle_test``, ``site-packages``/``dist-packages`` and ``__pycache__``
    are skipped; files are visited in sorted relative-path order.

Split (deterministic)
    A file is held out iff ``int(sha256(relpath)[:8], 16) % 1000 < 20`` (~2 % of files).
    Held-out files are concatenated (sorted order, separated by a blank line) into
    ``heldout.txt``; the tokenizer and the model never see them.

Model
    Qwen3-MoE: 32 routed experts, top-4, norm_topk_prob, SwiGLU experts, GQA attention with
    q/k RMSNorm, RoPE, tied embeddings, byte-level BPE vocabulary of 4096 (``tokenizers``).

Training
    A plain-torch re-implementation of the Qwen3-MoE forward (sorted-dispatch experts, much
    faster on CPU than transformers' training path) whose parameters map 1:1 onto the HF
    checkpoint names. Loss = next-token cross-entropy + 0.01 * Switch-Transformer
    load-balancing loss (E * sum_e f_e * P_e, as transformers' ``load_balancing_loss_func``,
    computed per layer and averaged over layers). AdamW, peak lr 3e-3, linear warm-up over
    the first 3 % of the time budget then cosine decay to 10 % that ends exactly at the
    budget: the schedule is a function of elapsed wall-clock time, and training stops when
    ``--minutes`` have passed.

After saving, the checkpoint is re-loaded with ``Qwen3MoeForCausalLM.from_pretrained`` and
its logits are checked against the training module (max |diff| <= 1e-4, fp32); held-out
perplexity is then computed with transformers (non-overlapping 256-token windows,
teacher-forced) together with router statistics.

Reproduce:  python scripts/train_demo_moe.py --minutes 40
Smoke run:  python scripts/train_demo_moe.py --minutes 1 --out /tmp/demo_smoke --results /tmp/demo_smoke.json
Re-evaluate an existing checkpoint:  python scripts/train_demo_moe.py --eval-only
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path

# The machine is shared: with busy-waiting OpenMP workers a descheduled thread stalls every
# parallel op (we measured 2 spinning threads 4x slower than 1 thread under load). Sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
HELDOUT_PER_MILLE = 20
EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MAX_CKPT_BYTES = 40 * 1024 * 1024


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ----------------------------------------------------------------------------- corpus


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 1000 < HELDOUT_PER_MILLE


def load_corpus() -> tuple[str, list[tuple[str, str]], list[tuple[str, str]]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dp, dn, fn in os.walk(root):
        dn[:] = [d for d in dn if d not in SKIP_DIRS]
        for f in fn:
            if f.endswith(".py"):
                files.append(os.path.relpath(os.path.join(dp, f), root).replace(os.sep, "/"))
    train, held = [], []
    for rel in sorted(files):
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        (held if is_heldout(rel) else train).append((rel, text))
    return str(root), train, held


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config(max_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }


# ----------------------------------------------------------------------------- model


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dt)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Layer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        D, H, KV, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        E, I = c["num_experts"], c["moe_intermediate_size"]
        self.c = c
        self.input_layernorm = nn.Parameter(torch.ones(D))
        self.q_proj = nn.Parameter(torch.empty(H * hd, D))
        self.k_proj = nn.Parameter(torch.empty(KV * hd, D))
        self.v_proj = nn.Parameter(torch.empty(KV * hd, D))
        self.o_proj = nn.Parameter(torch.empty(D, H * hd))
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.post_attention_layernorm = nn.Parameter(torch.ones(D))
        self.gate = nn.Parameter(torch.empty(E, D))  # router
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, D))  # HF fused layout: gate rows first
        self.down = nn.Parameter(torch.empty(E, D, I))

    def attn(self, x, cos, sin):
        c = self.c
        B, S, _ = x.shape
        hd, eps = c["head_dim"], c["rms_norm_eps"]
        q = rms_norm(F.linear(x, self.q_proj).view(B, S, -1, hd), self.q_norm, eps).transpose(1, 2)
        k = rms_norm(F.linear(x, self.k_proj).view(B, S, -1, hd), self.k_norm, eps).transpose(1, 2)
        v = F.linear(x, self.v_proj).view(B, S, -1, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.linear(o.transpose(1, 2).reshape(B, S, -1), self.o_proj)

    def moe(self, x):
        """x [T, D] -> (out [T, D], router_logits [T, E] fp32, balancing loss)."""
        c = self.c
        T, D = x.shape
        E, K = c["num_experts"], c["num_experts_per_tok"]
        logits = F.linear(x, self.gate).float()
        probs = torch.softmax(logits, dim=-1)
        topv, topi = torch.topk(probs, K, dim=-1)
        if c["norm_topk_prob"]:
            topv = topv / topv.sum(-1, keepdim=True)
        flat = topi.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        tok = order // K
        xs = x[tok]
        outs = []
        # unbind (not self.gate_up[e]): its backward is one stack instead of E full-size zero+add
        w_gu, w_d = self.gate_up.unbind(0), self.down.unbind(0)
        for e, xe in enumerate(xs.split(counts.tolist())):
            if xe.shape[0] == 0:
                continue
            g, u = F.linear(xe, w_gu[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(g) * u, w_d[e]))
        ys = torch.cat(outs).float() * topv.reshape(-1)[order, None]
        out = torch.zeros(T, D, dtype=torch.float32, device=x.device).index_add_(0, tok, ys)
        # Switch-Transformer balancing loss: E * sum_e (assignments_e / T) * mean_prob_e
        aux = E * (counts.float() / T * probs.mean(0)).sum()
        return out.to(x.dtype), logits, aux

    def forward(self, x, cos, sin):
        eps = self.c["rms_norm_eps"]
        x = x + self.attn(rms_norm(x, self.input_layernorm, eps), cos, sin)
        B, S, D = x.shape
        m, logits, aux = self.moe(rms_norm(x, self.post_attention_layernorm, eps).reshape(B * S, D))
        return x + m.view(B, S, D), logits, aux


class DemoMoE(nn.Module):
    """Plain-torch Qwen3-MoE (tied embeddings) used for training."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Parameter(torch.empty(c["vocab_size"], c["hidden_size"]))
        self.layers = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = nn.Parameter(torch.ones(c["hidden_size"]))
        hd = c["head_dim"]
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_weights(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        std = 0.02
        out_std = std / math.sqrt(2 * self.c["num_hidden_layers"])
        with torch.no_grad():
            self.embed_tokens.normal_(0, std, generator=g)
            for L in self.layers:
                for p in (L.q_proj, L.k_proj, L.v_proj, L.gate, L.gate_up):
                    p.normal_(0, std, generator=g)
                for p in (L.o_proj, L.down):
                    p.normal_(0, out_std, generator=g)

    def forward(self, ids: torch.Tensor, return_router_logits: bool = False):
        B, S = ids.shape
        pos = torch.arange(S, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = F.embedding(ids, self.embed_tokens)
        auxes, router = [], []
        for L in self.layers:
            x, logits, aux = L(x, cos, sin)
            auxes.append(aux)
            if return_router_logits:
                router.append(logits)
        x = rms_norm(x, self.norm, self.c["rms_norm_eps"])
        logits = F.linear(x, self.embed_tokens)
        return logits, torch.stack(auxes).mean(), router

    # ---- checkpoint mapping: exactly the names Qwen3MoeForCausalLM.save_pretrained writes
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        I = self.c["moe_intermediate_size"]
        sd = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        for l, L in enumerate(self.layers):
            p = f"model.layers.{l}."
            sd[p + "input_layernorm.weight"] = L.input_layernorm
            sd[p + "post_attention_layernorm.weight"] = L.post_attention_layernorm
            for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                sd[p + f"self_attn.{n}.weight"] = getattr(L, n)
            sd[p + "mlp.gate.weight"] = L.gate
            for e in range(self.c["num_experts"]):
                sd[p + f"mlp.experts.{e}.gate_proj.weight"] = L.gate_up[e, :I]
                sd[p + f"mlp.experts.{e}.up_proj.weight"] = L.gate_up[e, I:]
                sd[p + f"mlp.experts.{e}.down_proj.weight"] = L.down[e]
        return {k: v.detach().contiguous() for k, v in sd.items()}

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]):
        I = self.c["moe_intermediate_size"]
        mine = self.hf_state_dict()
        assert set(sd) == set(mine), (set(sd) ^ set(mine))
        with torch.no_grad():
            self.embed_tokens.copy_(sd["model.embed_tokens.weight"])
            self.norm.copy_(sd["model.norm.weight"])
            for l, L in enumerate(self.layers):
                p = f"model.layers.{l}."
                L.input_layernorm.copy_(sd[p + "input_layernorm.weight"])
                L.post_attention_layernorm.copy_(sd[p + "post_attention_layernorm.weight"])
                for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                    getattr(L, n).copy_(sd[p + f"self_attn.{n}.weight"])
                L.gate.copy_(sd[p + "mlp.gate.weight"])
                for e in range(self.c["num_experts"]):
                    L.gate_up[e, :I].copy_(sd[p + f"mlp.experts.{e}.gate_proj.weight"])
                    L.gate_up[e, I:].copy_(sd[p + f"mlp.experts.{e}.up_proj.weight"])
                    L.down[e].copy_(sd[p + f"mlp.experts.{e}.down_proj.weight"])


def hf_config(c: dict, dtype: str, eos_id: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["moe_intermediate_size"] * 4,  # unused: no dense MLP layers
        "moe_intermediate_size": c["moe_intermediate_size"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "num_experts": c["num_experts"],
        "num_experts_per_tok": c["num_experts_per_tok"],
        "norm_topk_prob": c["norm_topk_prob"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": c["max_position_embeddings"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": c["rope_theta"]},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "output_router_logits": False,
        "router_aux_loss_coef": c["router_aux_loss_coef"],
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "use_cache": True,
        "dtype": dtype,
    }


# ----------------------------------------------------------------------------- training


def make_batches(stream: torch.Tensor, seq: int, batch: int, seed: int):
    """Endless iterator over [batch, seq+1] windows; each epoch uses a fresh random shift+shuffle."""
    epoch = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        shift = int(torch.randint(0, seq + 1, (1,), generator=g))
        n = (len(stream) - shift) // (seq + 1)
        windows = stream[shift : shift + n * (seq + 1)].view(n, seq + 1)
        perm = torch.randperm(n, generator=g)
        for i in range(0, n - batch + 1, batch):
            yield epoch, windows[perm[i : i + batch]]
        epoch += 1


def lr_at(frac: float, peak: float, warm: float = 0.03, floor: float = 0.1) -> float:
    if frac < warm:
        return peak * max(frac / warm, 0.01)
    prog = min(1.0, (frac - warm) / (1 - warm))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * prog)))


@torch.no_grad()
def quick_eval(model: DemoMoE, held: torch.Tensor, seq: int, n_windows: int = 24) -> float:
    model.eval()
    n = min(n_windows, len(held) // seq)
    x = held[: n * seq].view(n, seq)
    tot, cnt = 0.0, 0
    for i in range(0, n, 8):
        xb = x[i : i + 8]
        logits, _, _ = model(xb)
        tot += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), xb[:, 1:].reshape(-1), reduction="sum").item()
        cnt += xb[:, 1:].numel()
    model.train()
    return tot / cnt


def train(args, c: dict, stream: torch.Tensor, held_ids: torch.Tensor) -> tuple[DemoMoE, dict]:
    torch.manual_seed(args.seed)
    model = DemoMoE(c)
    model.init_weights(args.seed)
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n and not n.endswith(".gate") else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    budget = args.minutes * 60.0
    batches = make_batches(stream, args.seq, args.batch, args.seed)
    step, tokens, ce_hist, aux_hist = 0, 0, [], []
    t0 = time.time()
    last_log = last_eval = t0
    history = []
    log(f"training: budget {args.minutes} min, batch {args.batch}x{args.seq}, peak lr {args.lr}")
    # Adaptive thread count (shared machine): every --probe-every seconds run a few steps with the
    # other thread count (1 <-> --threads) and keep whichever is faster right now.
    cur_threads = args.threads
    torch.set_num_threads(cur_threads)
    dts: list[tuple[int, float]] = []
    probe, last_probe = None, t0
    thread_time = {1: 0.0, args.threads: 0.0}
    while True:
        el = time.time() - t0
        if el >= budget:
            break
        lr = lr_at(el / budget, args.lr)
        for grp in opt.param_groups:
            grp["lr"] = lr
        epoch, w = next(batches)
        x, y = w[:, :-1], w[:, 1:]
        ts = time.time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
            logits, aux, _ = model(x)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss = ce + c["router_aux_loss_coef"] * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        ce_hist.append(ce.item())
        aux_hist.append(aux.item())
        now = time.time()
        nt = torch.get_num_threads()
        dts.append((nt, now - ts))
        thread_time[nt] = thread_time.get(nt, 0.0) + now - ts
        if args.threads > 1 and probe is None and now - last_probe >= args.probe_every:
            alt = 1 if cur_threads == args.threads else args.threads
            t_cur = sorted(d for _, d in dts[-4:])[len(dts[-4:]) // 2]  # recent median, current count
            probe = (alt, step, t_cur)
            torch.set_num_threads(alt)
        elif probe is not None and step - probe[1] >= 4:
            alt, _, t_cur = probe
            t_alt = sorted(d for _, d in dts[-4:])[1]
            keep = t_alt >= 0.9 * t_cur
            log(f"thread probe: {cur_threads} threads {t_cur:.2f}s/step, {alt} threads {t_alt:.2f}s/step"
                f" -> {'keep' if keep else 'switch to'} {cur_threads if keep else alt}")
            if not keep:
                cur_threads = alt
            torch.set_num_threads(cur_threads)
            probe, last_probe = None, now
        dts = dts[-8:]
        if now - last_log >= args.log_every or step <= 3:
            rec = {
                "step": step, "min": round((now - t0) / 60, 2), "epoch": epoch, "tokens": tokens,
                "lr": round(lr, 6), "ce": round(sum(ce_hist[-20:]) / len(ce_hist[-20:]), 4),
                "aux": round(sum(aux_hist[-20:]) / len(aux_hist[-20:]), 4),
                "tok_per_s": round(tokens / (now - t0)), "threads": cur_threads,
            }
            if now - last_eval >= args.eval_every:
                rec["heldout_ce"] = round(quick_eval(model, held_ids, args.seq), 4)
                last_eval = time.time()
            history.append(rec)
            log(json.dumps(rec))
            last_log = now
    wall = time.time() - t0
    tail = max(1, len(ce_hist) // 20)  # last 5 % of steps
    stats = {
        "steps": step,
        "tokens_seen": tokens,
        "epochs": round(tokens / len(stream), 3),
        "train_minutes": round(wall / 60, 2),
        "tokens_per_second": round(tokens / wall),
        "final_train_loss": round(sum(ce_hist[-tail:]) / tail, 4),
        "final_aux_loss": round(sum(aux_hist[-tail:]) / tail, 4),
        "compute_seconds_by_threads": {str(k): round(v) for k, v in thread_time.items()},
        "history": history,
    }
    log(f"done: {step} steps, {tokens} tokens, {wall/60:.1f} min, final train CE {stats['final_train_loss']}")
    return model, stats


# ----------------------------------------------------------------------------- saving


def save_checkpoint(model: DemoMoE, c: dict, tok, out: Path, eos_id: int, im_end_id: int) -> str:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = model.hf_state_dict()
    nbytes = sum(v.numel() * 4 for v in sd.values())
    dtype = "float32" if nbytes <= MAX_CKPT_BYTES else "bfloat16"
    tdt = torch.float32 if dtype == "float32" else torch.bfloat16
    sd = {k: v.to(tdt).contiguous() for k, v in sorted(sd.items())}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)
    (out / "config.json").write_text(json.dumps(hf_config(c, dtype, eos_id), indent=2) + "\n")
    gen = {"bos_token_id": None, "eos_token_id": [im_end_id, eos_id], "pad_token_id": eos_id,
           "do_sample": False, "max_new_tokens": 128}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(c["max_position_embeddings"]), indent=2) + "\n")
    log(f"saved {out} ({dtype}, {os.path.getsize(out / 'model.safetensors') / 1e6:.1f} MB)")
    return dtype


# ----------------------------------------------------------------------------- verification


def module_from_checkpoint(out: Path) -> DemoMoE:
    from safetensors.torch import load_file

    cfg = json.loads((out / "config.json").read_text())
    c = {k: cfg[k] for k in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                             "num_experts_per_tok", "norm_topk_prob", "max_position_embeddings",
                             "rms_norm_eps", "router_aux_loss_coef")}
    c["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    m = DemoMoE(c)
    m.load_hf_state_dict({k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()})
    return m.eval()


@torch.no_grad()
def verify_and_evaluate(out: Path, seq: int) -> dict:
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoTokenizer, Qwen3MoeForCausalLM

    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts == 32, cfg
    hf = Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = module_from_checkpoint(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    held = torch.tensor(tok.encode((out / "heldout.txt").read_text(encoding="utf-8")).ids, dtype=torch.long)

    # 1) logits parity: transformers vs the training module, fp32
    x = held[: 4 * seq].view(4, seq)
    a = hf(input_ids=x).logits
    b, _, _ = ref(x)
    max_diff = (a - b).abs().max().item()
    log(f"logits parity transformers vs training module: max|diff| = {max_diff:.3e}")
    assert max_diff <= 1e-4, max_diff

    # 2) tokenizer / chat template via transformers
    hft = AutoTokenizer.from_pretrained(out)
    chat = hft.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", repr(chat)
    assert hft.eos_token == EOS and hft.pad_token == EOS
    ids = hft.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(hft.convert_tokens_to_ids(IM_START)) == 2 and ids.count(hft.convert_tokens_to_ids(IM_END)) == 1
    sample = "def f(x):\n    return x + 1\n"
    assert hft.decode(hft(sample)["input_ids"]) == sample

    # 3) held-out perplexity with transformers: non-overlapping windows, teacher-forced
    n = len(held) // seq
    windows = held[: n * seq].view(n, seq)
    nll, cnt = 0.0, 0
    gaps, loads = [[] for _ in range(cfg.num_hidden_layers)], torch.zeros(cfg.num_hidden_layers, cfg.num_experts)
    top4_mass = [[] for _ in range(cfg.num_hidden_layers)]
    t0 = time.time()
    for i in range(0, n, 8):
        xb = windows[i : i + 8]
        o = hf(input_ids=xb, output_router_logits=True)
        nll += F.cross_entropy(o.logits[:, :-1].reshape(-1, o.logits.shape[-1]), xb[:, 1:].reshape(-1), reduction="sum").item()
        cnt += xb[:, 1:].numel()
        for l, rl in enumerate(o.router_logits):
            rl = rl.float().reshape(-1, cfg.num_experts)
            top = rl.topk(cfg.num_experts_per_tok, dim=-1)
            gaps[l].append(top.values[:, 0] - top.values[:, -1])
            loads[l] += torch.bincount(top.indices.reshape(-1), minlength=cfg.num_experts).float()
            top4_mass[l].append(rl.softmax(-1).topk(cfg.num_experts_per_tok, dim=-1).values.sum(-1))
    ppl = math.exp(nll / cnt)
    log(f"held-out perplexity (transformers, {n} windows x {seq}, {cnt} predicted tokens): {ppl:.3f} "
        f"[{time.time() - t0:.0f}s]")

    per_layer = []
    for l in range(cfg.num_hidden_layers):
        g = torch.cat(gaps[l])
        frac = loads[l] / loads[l].sum()
        per_layer.append({
            "layer": l,
            "mean_top1_minus_top4_logit": round(g.mean().item(), 4),
            "mean_top4_prob_mass": round(torch.cat(top4_mass[l]).mean().item(), 4),
            "load_max_over_mean": round((frac.max() * cfg.num_experts).item(), 3),
            "load_min_over_mean": round((frac.min() * cfg.num_experts).item(), 3),
            "load_cv": round((frac.std() / frac.mean()).item(), 4),
        })
    gap_all = sum(p["mean_top1_minus_top4_logit"] for p in per_layer) / len(per_layer)
    log(f"router: mean top1-top4 logit gap {gap_all:.3f}; per layer {json.dumps(per_layer)}")
    return {
        "logits_max_abs_diff_vs_training_module": max_diff,
        "heldout_tokens": len(held),
        "heldout_windows": n,
        "heldout_predicted_tokens": cnt,
        "heldout_ppl": round(ppl, 3),
        "heldout_nll": round(nll / cnt, 4),
        "router_mean_top1_minus_top4_logit": round(gap_all, 4),
        "router_per_layer": per_layer,
    }


# ----------------------------------------------------------------------------- model card


def write_model_card(out: Path, r: dict):
    a = r["architecture"]
    t = r["training"]
    e = r["eval"]
    router_rows = "\n".join(
        f"| {p['layer']} | {p['mean_top1_minus_top4_logit']:.3f} | {p['mean_top4_prob_mass']:.3f} | "
        f"{p['load_max_over_mean']:.2f} | {p['load_min_over_mean']:.2f} |"
        for p in e["router_per_layer"]
    )
    card = f"""# lynx-edge demo MoE (tiny Qwen3-MoE, trained on Python stdlib source)

A deliberately small **fine-grained Mixture-of-Experts** language model shipped inside the
`lynx_edge` package so that the runtime, LYNX batch-aware expert selection and their tests
have a real, *trained* router to work on without any download. It is a standard
`Qwen3MoeForCausalLM` checkpoint (`model_type: qwen3_moe`); transformers loads it directly:

```python
from transformers import AutoTokenizer, Qwen3MoeForCausalLM
model = Qwen3MoeForCausalLM.from_pretrained("lynx_edge/demo")
tok = AutoTokenizer.from_pretrained("lynx_edge/demo")
```

It is a toy code model (it continues Python source); it was never trained on chat data.
The ChatML `chat_template` exists so chat plumbing can be exercised end to end.

## Architecture

| | |
|---|---|
| layers | {a['num_hidden_layers']} (all MoE) |
| hidden size | {a['hidden_size']} |
| attention | {a['num_attention_heads']} query heads, {a['num_key_value_heads']} KV heads (GQA), head_dim {a['head_dim']}, q/k RMSNorm, RoPE θ={a['rope_theta']:g} |
| experts | {a['num_experts']} routed experts, top-{a['num_experts_per_tok']}, `norm_topk_prob: true`, SwiGLU, moe_intermediate_size {a['moe_intermediate_size']}, no shared expert |
| vocabulary | {a['vocab_size']} byte-level BPE (`tokenizers`), specials `<|endoftext|>` (eos/pad), `<|im_start|>`, `<|im_end|>` |
| context | max_position_embeddings {a['max_position_embeddings']} (trained at {t['seq_len']}) |
| embeddings | tied input/output |
| parameters | {r['params_total']:,} total, {r['params_active']:,} active per token |
| checkpoint | `model.safetensors`, **{r['checkpoint_dtype']}**, {r['checkpoint_bytes'] / 1e6:.1f} MB (legacy per-expert tensor names, as `save_pretrained` writes) |

## Data

* **Corpus:** the `.py` files of the CPython {r['corpus']['python']} standard library
  (`sysconfig.get_paths()["stdlib"]`), skipping directories named `test`, `tests`, `idle_test`,
  `site-packages`, `dist-packages`, `__pycache__`; sorted relative-path order. Each file is a
  document terminated by `<|endoftext|>`.
* **Split:** a file is held out iff `int(sha256(relpath)[:8], 16) % 1000 < {HELDOUT_PER_MILLE}`.
  {r['corpus']['train_files']} training files ({r['corpus']['train_bytes'] / 1e6:.2f} MB, {r['corpus']['train_tokens']:,} tokens),
  {r['corpus']['heldout_files']} held-out files ({r['corpus']['heldout_bytes'] / 1e3:.0f} KB, {e['heldout_tokens']:,} tokens).
  The tokenizer was trained on the training split only.
* `heldout.txt` is the held-out files concatenated (sorted, separated by a blank line).

## Training

* Plain-torch re-implementation of the Qwen3-MoE forward with the same parameters
  (verified after saving: transformers' logits match it, max |diff| = {e['logits_max_abs_diff_vs_training_module']:.1e} in fp32).
* Loss: next-token cross-entropy + **{a['router_aux_loss_coef']} × Switch-Transformer load-balancing loss**
  (E·Σ f_e·P_e as in transformers' `load_balancing_loss_func`, per layer, averaged over layers).
* AdamW (β=0.9/0.95, wd 0.1 on matrices), peak lr {t['peak_lr']}, warm-up 3 % then cosine to 10 %,
  scheduled on wall-clock time so that it ends exactly at the {t['budget_minutes']}-minute budget;
  batch {t['batch']}×{t['seq_len']} tokens, grad-clip 1.0, {'bf16 autocast' if t['amp'] else 'fp32'}, seed {t['seed']}.
* Hardware: {t['hardware']} shared with other jobs, torch {t['torch']}. Up to {t['threads']} threads;
  the script probes 1 vs {t['threads']} threads every 90 s and keeps the faster (compute seconds by
  thread count: {', '.join(f"{k}: {v}" for k, v in t.get('compute_seconds_by_threads', {}).items())}).
* **{t['train_minutes']} min, {t['steps']} steps, {t['tokens_seen']:,} tokens seen** ({t['epochs']} epochs).
  Final train loss (CE, mean of the last 5 % of steps): **{t['final_train_loss']}**; final balancing loss {t['final_aux_loss']}.

Note: with f_e counting top-k assignments per token (Σ f_e = k), a perfectly balanced router
gives a balancing loss of exactly k = {a['num_experts_per_tok']}.

## Evaluation (transformers, fp32)

* **Held-out perplexity: {e['heldout_ppl']}** — `heldout.txt`, non-overlapping {t['seq_len']}-token windows
  ({e['heldout_windows']} windows, {e['heldout_predicted_tokens']:,} predicted tokens), teacher-forced, no BOS.
* Router (held-out tokens): mean gap between the top-1 and top-4 router logit **{e['router_mean_top1_minus_top4_logit']:.3f}**.

| layer | top1−top4 logit gap | top-4 prob mass | max load / mean | min load / mean |
|---|---|---|---|---|
{router_rows}

## Reproduce

```bash
python scripts/train_demo_moe.py --minutes {t['budget_minutes']:g}
```

Wall-clock-budgeted training is not bit-reproducible across machines (the number of steps
depends on throughput); the corpus, split, tokenizer and schedule shape are deterministic for a
given Python version.
"""
    (out / "README.md").write_text(card)


# ----------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=40.0, help="wall-clock training budget")
    ap.add_argument("--out", type=Path, default=REPO / "lynx_edge" / "demo")
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "demo_model.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (adaptively 1 when faster)")
    ap.add_argument("--probe-every", type=float, default=90.0, help="seconds between thread-count probes")
    ap.add_argument("--amp", action="store_true", help="bf16 autocast for matmuls (fp32 master weights)")
    ap.add_argument("--log-every", type=float, default=30.0, help="seconds")
    ap.add_argument("--eval-every", type=float, default=300.0, help="seconds")
    ap.add_argument("--eval-only", action="store_true", help="re-verify/evaluate an existing checkpoint")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    random.seed(args.seed)

    if args.eval_only:
        r = json.loads(args.results.read_text())
    else:
        root, train_docs, held_docs = load_corpus()
        held_text = "\n\n".join(t.rstrip("\n") + "\n" for _, t in held_docs)
        log(f"corpus {root}: {len(train_docs)} train files, {len(held_docs)} held-out files "
            f"({len(held_text.encode()) / 1e3:.0f} KB): {[p for p, _ in held_docs]}")
        tok = train_tokenizer([t for _, t in train_docs], args.vocab)
        eos_id, im_end_id = tok.token_to_id(EOS), tok.token_to_id(IM_END)
        enc = tok.encode_batch([t for _, t in train_docs])
        ids = []
        for e in enc:
            ids.extend(e.ids)
            ids.append(eos_id)
        stream = torch.tensor(ids, dtype=torch.long)
        held_ids = torch.tensor(tok.encode(held_text).ids, dtype=torch.long)
        log(f"tokenizer vocab {tok.get_vocab_size()}; train stream {len(stream):,} tokens "
            f"({sum(len(t.encode()) for _, t in train_docs) / len(stream):.2f} bytes/token); held-out {len(held_ids):,}")

        c = {
            "vocab_size": tok.get_vocab_size(), "hidden_size": args.hidden,
            "moe_intermediate_size": args.moe_intermediate, "num_hidden_layers": args.layers,
            "num_attention_heads": args.hidden // 64, "num_key_value_heads": max(1, args.hidden // 128),
            "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "router_aux_loss_coef": 0.01,
        }
        model, tstats = train(args, c, stream, held_ids)
        dtype = save_checkpoint(model, c, tok, args.out, eos_id, im_end_id)
        (args.out / "heldout.txt").write_text(held_text, encoding="utf-8")

        n_expert = sum(L.gate_up.numel() + L.down.numel() for L in model.layers)
        total = sum(p.numel() for p in model.parameters())
        active = total - n_expert + n_expert * c["num_experts_per_tok"] // c["num_experts"]
        r = {
            "model": "lynx_edge/demo",
            "architecture": {**c, "model_type": "qwen3_moe", "tie_word_embeddings": True},
            "params_total": total,
            "params_active": active,
            "checkpoint_dtype": dtype,
            "checkpoint_bytes": os.path.getsize(args.out / "model.safetensors"),
            "corpus": {
                "source": "CPython stdlib .py sources (sysconfig stdlib path)",
                "python": platform.python_version(),
                "train_files": len(train_docs), "heldout_files": len(held_docs),
                "train_bytes": sum(len(t.encode()) for _, t in train_docs),
                "heldout_bytes": len(held_text.encode()),
                "train_tokens": len(stream),
                "heldout_paths": [p for p, _ in held_docs],
            },
            "training": {
                "budget_minutes": args.minutes, "seq_len": args.seq, "batch": args.batch,
                "peak_lr": args.lr, "seed": args.seed, "amp": args.amp, "threads": args.threads,
                "hardware": f"{platform.machine()} CPU, {os.cpu_count()} cores",
                "torch": torch.__version__,
                **{k: v for k, v in tstats.items() if k != "history"},
                "history": tstats["history"],
            },
        }
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(r, indent=2) + "\n")

    r["eval"] = verify_and_evaluate(args.out, r["training"]["seq_len"])
    r["checkpoint_bytes"] = os.path.getsize(args.out / "model.safetensors")
    r["files_bytes"] = {p.name: p.stat().st_size for p in sorted(args.out.iterdir()) if p.is_file()}
    args.results.write_text(json.dumps(r, indent=2) + "\n")
    write_model_card(args.out, r)
    r["files_bytes"]["README.md"] = (args.out / "README.md").stat().st_size
    args.results.write_text(json.dumps(r, indent=2) + "\n")
    log(f"wrote {args.results} and {args.out / 'README.md'}")


if __name__ == "__main__":
    sys.exit(main())
