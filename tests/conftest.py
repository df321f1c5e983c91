"""Shared fixtures: tiny random HF checkpoints written by transformers' save_pretrained, and a
small byte-level BPE tokenizer with a ChatML template (trained here, no hub)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The CPU default dtype follows the CPU (build.default_dtype: bf16 where it has native bf16 math or
# the native kernels build, else fp32 for a small checkpoint); the suite pins fp32 and the torch
# paths of a CPU without native bf16, so it runs the same on every machine — tests of the choice
# itself unset the variables.
os.environ.setdefault("LYNX_EDGE_CPU_DTYPE", "float32")
os.environ.setdefault("LYNX_EDGE_CPU_BF16", "0")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB = 320
TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    "The quick brown fox jumps over the lazy dog. Mixture of experts routes each token to k experts.\n"
    "import os\nimport sys\nfor i in range(10):\n    print(i, 'héllo wörld — ünïcode ✓')\n"
) * 20


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast",
    }))


FAMILY_CONFIGS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, sliding_window=None),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=48,
                      shared_expert_intermediate_size=40, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=24, norm_topk_prob=False),
}


def greedy_logits(eng, ids: list[int], n: int = 8) -> tuple[list[int], torch.Tensor]:
    """Greedy ids and every step's logits [n + 1, V] for one prompt (prefill, then cached decode
    steps) — what the offload = resident tests compare."""
    from lynx_edge.step import decode_step, prefill

    kv = eng._cache(1)
    logits = prefill(eng.model, kv, 0, ids)
    out, toks = [logits], []
    for _ in range(n):
        tok = logits.argmax(-1)
        toks.append(int(tok))
        logits = decode_step(eng.model, kv, [0], tok)
        out.append(logits)
    return toks, torch.cat(out)


def tiny_with_reference(root: Path, transform) -> tuple[Path, Path]:
    """(a tiny qwen3_moe checkpoint, its copy whose tensors dict went through transform(t) in place):
    the reference a quantise-at-load option is compared against."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    src = make_tiny(root / "src", "qwen3_moe", hidden_size=128, moe_intermediate_size=64, head_dim=32)
    ref = root / "ref"
    shutil.copytree(src, ref)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    transform(t)
    save_file(t, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return src, ref


def q8_emulate(x: torch.Tensor, block: int = 32, levels: float = 127.0) -> torch.Tensor:
    """The native kernels' int8 activation quantisation, emulated: blocks of `block` inputs (in the
    order given; the last may be shorter), d = max|x| / 127, xq = round-half-even(x · 127/max|x|) in
    fp32 → the dequantised xq · d. 32: the INT4 kernels (Q8_0); 256: the int8 head (Q8_K). levels
    32767: the INT4 kernels' int16 activations (q16_emulate)."""
    x = x.float()
    K = x.shape[-1]
    pad = -K % block
    b = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, block))
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(levels) / amax, torch.zeros_like(amax))
    return (torch.round(b * inv) * (amax / levels)).flatten(-2)[..., :K]


@pytest.fixture
def exact_int4(monkeypatch):
    """The CPU INT4 and MXFP4 kernels on fp32 activations (exact to fp32 rounding) unless a call names
    another: for tests that check 4-bit formats or the f32 rows against fp32 references at fp32's tolerance
    (the default int16 activations are ~2^-16 off by design: tested against their emulation in
    test_cpu_native.py and against the float reference at their own bound in test_quant_checkpoints.py)."""
    from lynx_edge.kernels import native

    monkeypatch.setattr(native, "INT4_ACT", "f32")


def q16_emulate(x: torch.Tensor, group: int) -> torch.Tensor:
    """The INT4 kernels' int16 activations (act "q16"), emulated: blocks of min(group, 128) inputs,
    d = max|x| / 32767, xq = round-half-even(x · 32767/max|x|) → xq · d."""
    return q8_emulate(x, min(group, 128), 32767.0)


def decode_logits(path, prompt: list[int], steps: int = 3, prepare=None, **options) -> tuple[torch.Tensor, object]:
    """An fp32 CPU engine of `path` (Engine options as given; prepare(engine) runs before its first
    step): the prompt's logits for every position, then `steps` greedy decode steps' →
    ([len(prompt) + steps, V], the engine)."""
    from lynx_edge import Engine
    from lynx_edge.step import decode_step, prefill

    eng = Engine.from_pretrained(path, device="cpu", dtype="float32", **options)
    if prepare is not None:
        prepare(eng)
    kv = eng._cache(1)
    out = [prefill(eng.model, kv, 0, prompt, 0, logits_for="all")[0]]
    tok = out[0][-1].argmax(-1, keepdim=True)
    for _ in range(steps):
        out.append(decode_step(eng.model, kv, [0], tok).reshape(1, -1))
        tok = out[-1].argmax(-1)
    return torch.cat(out), eng


def make_tiny(path: Path, family: str, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """A random tiny checkpoint of `family` saved by transformers (legacy expert names on disk)."""
    import transformers

    cls = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe"}[family]
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
              eos_token_id=2, bos_token_id=None, pad_token_id=0)
    kw.update(FAMILY_CONFIGS[family])
    kw.update(overrides)
    config = getattr(transformers, cls + "Config")(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, cls + "ForCausalLM")(config)
    with torch.no_grad():  # sharper routers than the default init, so top-k choices are clear-cut
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.to(dtype).save_pretrained(path)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny(root / f, f) for f in FAMILY_CONFIGS}


def gpu_only(fn):
    """-m gpu, skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))


def run_interpreter_suite(test_file: str, min_passed: int) -> None:
    """Run a file's test_interp_* cases in a fresh process with TRITON_INTERPRET=1 (it must be
    set before triton is imported, so it cannot be switched on inside this process)."""
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "pytest", test_file, "-k", "test_interp_", "-q", "-o", "addopts=",
           "-m", "not slow and not gpu", "-p", "no:cacheprovider"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    passed = re.search(r"(\d+) passed", r.stdout)
    ok = r.returncode == 0 and passed and int(passed.group(1)) >= min_passed and "skipped" not in r.stdout
    assert ok, r.stdout[-6000:] + r.stderr[-3000:]


class RouteSpy:
    """Wraps an engine's routing function (begin_step etc. reach the wrapped one); each call's
    result, beside exact routing's ids for the same scores, goes through `record` into `calls`."""

    def __init__(self, inner, spec):
        self.inner, self.spec, self.calls = inner, spec, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, scores, is_decode, layer, probs=None):
        from lynx_edge.routing import exact_route

        ids, w = self.inner(scores, is_decode, layer, probs)
        self.calls.append(self.record(scores, is_decode, ids, w, exact_route(scores, self.spec, probs)[0]))
        return ids, w

    def record(self, scores, is_decode, ids, w, exact_ids):
        return scores, is_decode, ids, w, exact_ids
