"""The CPU path (issue 16): threads, the loop-free MoE block, cheap LYNX routing, bench honesty.

References: torch.get_num_threads (threads), the per-expert Python loop moe_ref_loop (MoE
results), counted dispatcher ops (op count independent of active experts), lynx_select's own
results (vectorised routing), arithmetic on the bench rows (speed-up spread).
"""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from lynx_edge import threads as thr


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    thr._explicit = None
    torch.set_num_threads(n)


# threads ---------------------------------------------------------------------------------------
def test_set_threads_explicit_wins_and_bad_values_are_one_line(restore_threads):
    assert thr.set_threads(1, explicit=True) == 1 == torch.get_num_threads()
    assert thr.default_threads() == 1
    assert thr.set_threads(None) == 1  # an Engine without threads= keeps the CLI's -t
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads"):
            thr.set_threads(bad)


@pytest.mark.parametrize("load,expect", [(0.0, 2), (0.3, 2), (1.0, 1), (7.3, 1)])
def test_default_threads_leaves_busy_cores_alone(monkeypatch, restore_threads, load, expect):
    thr._explicit = None
    monkeypatch.setattr(thr, "_cores", lambda: (2, 2))
    monkeypatch.setattr(thr.os, "getloadavg", lambda: (load, load, load))
    assert thr.default_threads() == expect


def test_engine_threads_recorded(tiny_models, restore_threads):
    from lynx_edge import Engine
    from lynx_edge.bench import run_bench

    eng = Engine.from_pretrained(tiny_models["qwen3_moe"], device="cpu", threads=1)
    assert eng.config.threads == 1 == torch.get_num_threads()
    res = run_bench(eng, [1], prompt_len=4, gen_len=2, reps=1)
    cfg = res["config"]
    assert cfg["threads"] == 1 and cfg["int4"] is False and cfg["offload"] is False and cfg["isa"]


def test_cli_threads_on_every_command(tiny_models, restore_threads):
    from lynx_edge.cli.main import app

    runner = CliRunner()
    for cmd in ("chat", "bench", "eval", "info", "quantize", "profile"):
        r = runner.invoke(app, [cmd, "--help"])
        assert "--threads" in r.stdout and "-t" in r.stdout, cmd
    r = runner.invoke(app, ["info", str(tiny_models["qwen3_moe"]), "-t", "1", "-o", "json"])
    assert r.exit_code == 0, r.output
    assert torch.get_num_threads() == 1
    r = runner.invoke(app, ["info", str(tiny_models["qwen3_moe"]), "-t", "0"])
    assert r.exit_code != 0


# loop-free MoE block ---------------------------------------------------------------------------
def _moe_case(T: int, E: int = 16, D: int = 64, I: int = 32, K: int = 4, dtype=torch.float32, seed: int = 0,
              n_active: int | None = None):
    """Random experts and routing; n_active: route every slot to the first n_active experts."""
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dtype)
    dn = (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)
    x = torch.randn(T, D, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g)
    if n_active is not None:  # distinct experts per token, A = n_active in total
        ids = (torch.arange(T)[:, None] * K + torch.arange(K)[None]) % n_active
    else:
        ids = logits.topk(K).indices
    w = torch.softmax(logits.gather(1, ids), -1)
    return x, ids, w, gu, dn


@pytest.mark.parametrize("T", [1, 3, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_ref_equals_the_per_expert_loop(T, dtype):
    from lynx_edge.kernels.moe_gemm import moe_ref, moe_ref_lazy, moe_ref_loop

    x, ids, w, gu, dn = _moe_case(T, dtype=dtype, seed=T)
    y, ref = moe_ref(x, ids, w, gu, dn), moe_ref_loop(x, ids, w, gu, dn)
    # only the fp32 summation order differs (slot order vs expert order): a few ulps in fp32,
    # at most one rounding step of the final cast in bf16
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=4e-3, rtol=8e-3)
    torch.testing.assert_close(y, ref, **tol)
    # the lazy (dequantise-on-demand) reference shares the sum order: bit-identical
    assert torch.equal(moe_ref_lazy(x, ids, w, gu.shape[0], lambda e: (gu[e], dn[e])), y)
    # duplicated experts inside a token (K slots on one expert) are summed too
    dup = ids.clone()
    dup[:, 1] = dup[:, 0]
    torch.testing.assert_close(moe_ref(x, dup, w, gu, dn), moe_ref_loop(x, dup, w, gu, dn), **tol)


def test_moe_ref_catches_a_wrong_expert_weight():
    """Bug injection: one expert's gate rows perturbed, or the routing weights of two slots
    swapped, must move the result far outside the tolerance above."""
    from lynx_edge.kernels.moe_gemm import moe_ref, moe_ref_loop

    x, ids, w, gu, dn = _moe_case(8)
    ref = moe_ref_loop(x, ids, w, gu, dn)
    bad = gu.clone()
    bad[ids[0, 0], 0] += 0.5
    swapped = w[:, [1, 0, 2, 3]]
    for y in (moe_ref(x, ids, w, bad, dn), moe_ref(x, ids, swapped, gu, dn)):
        assert (y - ref).abs().max() > 1e-3


def test_moe_ref_falls_back_on_unaligned_shapes():
    from lynx_edge.kernels import moe_gemm

    x, ids, w, gu, dn = _moe_case(4, D=6, I=5)  # 6·4 bytes: not a 16-byte multiple
    assert not moe_gemm._grouped_ok(x, gu, dn)
    torch.testing.assert_close(moe_gemm.moe_ref(x, ids, w, gu, dn), moe_gemm.moe_ref_loop(x, ids, w, gu, dn),
                               atol=1e-6, rtol=1e-6)


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts every aten op dispatched (the Python-visible ops of a forward)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _moe_block(E=16, D=64, I=32, K=4):
    from lynx_edge.config import ModelConfig
    from lynx_edge.models.layers import MoEBlock, RoutingContext
    from lynx_edge.routing import RouterSpec

    cfg = ModelConfig.from_dict(dict(model_type="qwen3_moe", vocab_size=32, hidden_size=D, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                     num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                                     norm_topk_prob=True, max_position_embeddings=64))
    ctx = RoutingContext(RouterSpec(E, K, True))
    ctx.stats.record = True
    block = MoEBlock(cfg, 0, ctx, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return block, ctx


def test_cpu_moe_block_op_count_does_not_grow_with_active_experts():
    """One CPU MoE block forward dispatches the same ops whether 4 or 16 experts are active;
    bug injection: the per-expert loop (moe_ref_loop) grows and must fail this check."""
    from lynx_edge.kernels.moe_gemm import moe_ref_loop

    block, ctx = _moe_block()
    T, D = 16, 64
    g = torch.Generator().manual_seed(0)  # fixed draws: 16 tokens × top-4 cover all 16 experts
    x = torch.randn(T, D, generator=g)
    counts = {}
    for n_active in (4, 8, 16):
        # a gate that sends every token to experts < n_active (top-k distinct within each token)
        with torch.no_grad():
            block.gate.weight.zero_()
        bias = torch.full((T, 16), -1e4)
        bias[:, :n_active] = torch.randn(T, n_active, generator=g)
        route = ctx.route
        ctx.route = lambda logits, d, layer, _b=bias, _r=route: _r(logits + _b, d, layer)
        ctx.begin_step(True)
        with _CountOps() as mode:
            block(x[None], torch.ones(T, dtype=torch.bool))
        ctx.route = route
        counts[n_active] = len(mode.ops)
        assert ctx.stats.steps[-1][0].unique().numel() == n_active  # the case is what it claims
    assert len(set(counts.values())) == 1, counts
    assert counts[16] <= 60, counts  # a handful: routing + grouped GEMMs, not ops per expert

    loop_counts = {}
    for n_active in (2, 16):
        x, ids, w, gu, dn = _moe_case(T, n_active=n_active)
        with _CountOps() as mode:
            moe_ref_loop(x, ids, w, gu, dn)
        loop_counts[n_active] = len(mode.ops)
    assert loop_counts[16] > loop_counts[2]  # the check above would catch a loop


# bench: quick and honest -----------------------------------------------------------------------
def test_compare_carries_the_paired_spread_and_a_plain_verdict():
    from lynx_edge.bench import compare

    rows = [{"batch": 16, "lynx": "off", "decode_tok_s": 100.0, "unique_experts_per_layer": 28.0},
            {"batch": 16, "lynx": "on", "decode_tok_s": 110.0, "unique_experts_per_layer": 21.0},
            {"batch": 1, "lynx": "off", "decode_tok_s": 50.0, "unique_experts_per_layer": 4.0},
            {"batch": 1, "lynx": "on", "decode_tok_s": 49.0, "unique_experts_per_layer": 4.0},
            {"batch": 4, "lynx": "off", "decode_tok_s": 80.0, "unique_experts_per_layer": 12.0},
            {"batch": 4, "lynx": "on", "decode_tok_s": 60.0, "unique_experts_per_layer": 8.0}]
    paired = {(16, "off"): [100.0, 90.0, 110.0], (16, "on"): [120.0, 90.0, 120.0],
              (1, "off"): [50.0] * 3, (1, "on"): [49.0] * 3,
              (4, "off"): [80.0, 80.0, 80.0], (4, "on"): [60.0, 70.0, 50.0]}
    c = {r["batch"]: r for r in compare(rows, "off", paired)}
    assert c[16]["speedup"] == pytest.approx(120 / 110)  # the median of 1.2, 1.0, 1.09 (the means give 1.1)
    assert (c[16]["speedup_min"], c[16]["speedup_max"]) == (pytest.approx(1.0), pytest.approx(1.2))
    assert c[16]["verdict"].startswith("within noise")  # the spread touches 1.0: no claim
    assert c[1]["verdict"].startswith("slower: nothing to pool") and c[16]["unique_reduction_pct"] == pytest.approx(25.0)
    paired[1, "on"] = [49.0, 50.0, 51.0]
    assert compare(rows, "off", paired)[1]["verdict"].startswith("no change")
    assert c[4]["verdict"].startswith("slower") and c[4]["speedup_max"] == pytest.approx(0.875)
    paired[16, "on"] = [110.0, 100.0, 121.0]
    assert compare(rows, "off", paired)[0]["verdict"] == "faster"
    # one repetition hit by background load moves one ratio, not the speed-up (the means give 0.90)
    paired[16, "off"], paired[16, "on"] = [100.0, 100.0, 100.0], [115.0, 116.0, 40.0]
    assert compare(rows, "off", paired)[0]["speedup"] == pytest.approx(1.15)


def test_bench_lynx_both_alternates_modes_and_records_threads(tiny_models, tmp_path, restore_threads):
    from lynx_edge.cli.main import app

    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["bench", str(tiny_models["qwen3_moe"]), "--lynx", "both", "-p", "6", "-n", "4",
                                 "-r", "2", "-b", "1,4", "-t", "1", "--save", str(out)])
    assert r.exit_code == 0, r.output
    assert "verdict" in r.stdout and "(" in r.stdout.split("LYNX vs exact")[1]  # spread printed
    assert not any(ln.startswith("{") for ln in r.stdout.splitlines())
    data = json.loads(out.read_text())
    assert data["config"]["threads"] == 1 and data["config"]["int4"] is False and data["config"]["offload"] is False
    for c in data["compare"]:
        assert c["speedup_min"] <= c["speedup_max"] and c["verdict"]
    assert "bench: 12/12 runs" in r.stderr  # progress while it runs: 2 sizes × 2 modes × (1 + 2) runs


@pytest.mark.parametrize("cmd", ["bench", "chat"])
def test_bad_lynx_value_fails_before_the_model_loads(cmd, tmp_path):
    from lynx_edge.cli.main import app

    missing = tmp_path / "no-such-model"  # would fail to load: the --lynx error must come first
    r = CliRunner().invoke(app, [cmd, str(missing), "--lynx", "fast"])
    assert r.exit_code == 2, r.output
    assert "fast" in r.output and "lynx-mass:TAU" in r.output and "budget:M" in r.output
    assert ("both" in r.output) == (cmd == "bench")


def test_boolean_options_are_plain_flags():
    """No flag shows a type (typer 0.2x prints `<bool>` beside every flag, --help too) or a --no- twin,
    in any command's help, except chat's --raw/--no-raw, whose default follows the model (raw for the
    demo), so both switches exist, and --no-repack, a flag of its own (llama.cpp's name; no --repack
    twin); options that take a value keep theirs."""
    from lynx_edge.cli.main import app

    cmds = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert {"chat", "bench", "info", "quantize", "serve"} <= set(cmds)
    for cmd in [[]] + [[c] for c in cmds]:
        r = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0 and "--help" in r.stdout, (cmd, r.output)
        bad = [ln for ln in r.stdout.splitlines()
               if "<bool>" in ln or "--no-" in ln.replace("--no-raw", "").replace("--no-repack", "") or "--repack" in ln]
        assert not bad, (cmd, bad)
        if cmd in (["chat"], ["bench"], ["info"]):
            assert any("--int4 " in ln for ln in r.stdout.splitlines()), cmd
        if cmd == ["bench"]:
            assert "<f32|q16|q8>" in r.stdout and "<int>" in r.stdout  # value types still shown
        if cmd and cmd[0] in ("chat", "bench", "info", "quantize", "serve", "eval"):
            usage = next(ln for ln in r.stdout.splitlines() if "Usage:" in ln)
            assert "MODEL" in usage, usage  # the argument named as the docs name it


# LYNX cheap on CPU -----------------------------------------------------------------------------
LYNX_CASES = ["lynx", "on", "lynx-mass:0.5", "lynx-mass:0", "budget:6", "budget:1", "lynx,j=2", "lynx,j=0,beta=2",
              "lynx,protect_top1=false", "lynx-mass:1,alpha=0.5", "lynx,min_batch=8"]


@pytest.mark.parametrize("mode", LYNX_CASES)
@pytest.mark.parametrize("E,K,norm", [(32, 4, True), (8, 2, False), (64, 8, True), (16, 1, False)])
def test_cpu_lynx_fast_path_is_bit_identical(mode, E, K, norm):
    """The compiled decision path (lynx_host; host phase, all decode) against lynx_select's
    device-mask path (the same rule in torch ops), on random and tie-heavy logits: ids, weights
    and counts equal; the displaced-mass stat (summed in float64 there, fp32 in torch) to 2e-6."""
    from lynx_edge import lynx
    from lynx_edge.routing import RouterSpec

    spec, cfg = RouterSpec(E, K, norm), lynx.LynxConfig.parse(mode)
    g = torch.Generator().manual_seed(E * 31 + K)
    for T in (2, 3, 9, 16, 33):
        for ties in (False, True):
            z = torch.randn(T, E, generator=g) * 2
            if ties:  # coarse logits: many exact ties and equal gaps
                z = (z * 2).round() / 2
            fast = lynx.lynx_select(z, True, spec, cfg)
            ref = lynx.lynx_select(z, torch.ones(T, dtype=torch.bool), spec, cfg)
            assert torch.equal(fast.ids, ref.ids), (mode, T, ties)
            assert torch.equal(fast.weights, ref.weights), (mode, T, ties)
            assert torch.equal(fast.vec[:6], ref.vec[:6]), (mode, T, ties, fast.vec, ref.vec)
            torch.testing.assert_close(fast.vec[6], ref.vec[6], rtol=2e-6, atol=1e-7)  # torch sums in fp32


def test_cpu_lynx_fast_path_catches_a_wrong_rule(monkeypatch):
    """Bug injection: a critical-set threshold one step too loose must change the results."""
    from lynx_edge import lynx
    from lynx_edge.routing import RouterSpec

    spec, cfg = RouterSpec(32, 4, True), lynx.LynxConfig.parse("lynx")
    z = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)) * 2
    ref = lynx.lynx_select(z, torch.ones(16, dtype=torch.bool), spec, cfg)
    monkeypatch.setattr(cfg, "j", 2)  # the fast path reads cfg.j; the reference ran with j = 1
    assert not torch.equal(lynx.lynx_select(z, True, spec, cfg).ids, ref.ids)


def test_cpu_lynx_routing_is_a_handful_of_ops():
    """LYNX routing of one decode layer at B=16 computes no more torch ops than exact routing (6:
    softmax, sort, slice, gather, sum, div): with the native kernels none (one lynx_route call into
    three fresh outputs), else the softmax, then one compiled call (lynx_host); the rest are
    zero-copy numpy views (detach / lift_fresh)."""
    from lynx_edge.kernels import native
    from lynx_edge.lynx import LynxRouter
    from lynx_edge.routing import RouterSpec

    router = LynxRouter(RouterSpec(32, 4, True), "on")
    router.begin_step(True)
    z = torch.randn(16, 32, generator=torch.Generator().manual_seed(2)) * 2
    router(z, torch.ones(16, dtype=torch.bool), 0)  # the first call per layer allocates its telemetry sums
    with _CountOps() as mode:
        router(z, torch.ones(16, dtype=torch.bool), 0)
    compute = [op for op in mode.ops if op.split(".")[1] not in ("detach", "lift_fresh", "ones", "empty")]
    assert compute == ([] if native.lib() is not None else ["aten._softmax.default"]), (compute, mode.ops)


# attention: no mask, slice KV writes when rows share positions ----------------------------------
@pytest.mark.parametrize("window", [None, 4])
def test_attention_without_mask_equals_the_masked_path(window):
    """Decode rows at equal positions and a prefill from 0 skip the mask and write the cache by
    slices; same outputs and cache as the general path (bool mask, index_put writes)."""
    from lynx_edge.config import ModelConfig
    from lynx_edge.models.layers import Attention, AttnBatch, Rope

    cfg = ModelConfig.from_dict(dict(model_type="qwen3_moe", vocab_size=32, hidden_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=64,
                                     use_sliding_window=window is not None, sliding_window=window, max_window_layers=0))
    attn, rope = Attention(cfg, 0, torch.float32, "cpu"), Rope(cfg, "cpu")
    g = torch.Generator().manual_seed(0)
    for p in attn.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    B, S = 3, 16

    def run(x, start, fast, cache):
        T = x.shape[1]
        pos = torch.arange(start, start + T)[None].expand(B, T)
        ab = AttnBatch(positions=pos, rows=slice(0, B), kv_len=start + T, start=start if fast else None)
        ab.cos, ab.sin = rope.cos_sin(pos, torch.float32)
        return attn(x, ab, cache)

    caches = {f: (torch.zeros(B, 2, S, 16), torch.zeros(B, 2, S, 16)) for f in (True, False)}
    x = torch.randn(B, 6, 64, generator=g)
    outs = {f: run(x, 0, f, caches[f]) for f in caches}  # prefill from 0: causal
    torch.testing.assert_close(outs[True], outs[False], atol=1e-6, rtol=1e-6)
    for step in range(6, 9):  # decode at equal positions
        x = torch.randn(B, 1, 64, generator=g)
        outs = {f: run(x, step, f, caches[f]) for f in caches}
        torch.testing.assert_close(outs[True], outs[False], atol=1e-6, rtol=1e-6)
    assert torch.equal(caches[True][0], caches[False][0]) and torch.equal(caches[True][1], caches[False][1])
    mask, causal = attn.attend(AttnBatch(positions=torch.zeros(B, 1), rows=slice(0, B), kv_len=9, start=8), 1)
    assert (mask is None) == (window is None)  # a window shorter than the keys still masks


def test_fused_qkv_is_one_gemm_with_the_same_result():
    """After the first forward q/k/v are views of one fused weight (no extra memory) and the
    output equals the three-GEMM path (fusion switched off) bit for bit."""
    from lynx_edge.config import ModelConfig
    from lynx_edge.models.layers import Attention, AttnBatch, Rope

    cfg = ModelConfig.from_dict(dict(model_type="olmoe", vocab_size=32, hidden_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                     num_experts_per_tok=2, intermediate_size=16, max_position_embeddings=64,
                                     clip_qkv=0.5))
    g = torch.Generator().manual_seed(3)
    attns = [Attention(cfg, 0, torch.float32, "cpu") for _ in range(2)]
    for p, q in zip(attns[0].parameters(), attns[1].parameters()):
        p.data.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        q.data.copy_(p.data)
    attns[1]._qkv = ()  # the unfused path
    rope, B, T = Rope(cfg, "cpu"), 2, 5
    x = torch.randn(B, T, 64, generator=g)
    pos = torch.arange(T)[None].expand(B, T)
    outs = []
    for a in attns:
        ab = AttnBatch(positions=pos, rows=slice(0, B), kv_len=T, start=0)
        ab.cos, ab.sin = rope.cos_sin(pos, torch.float32)
        outs.append(a(x, ab, (torch.zeros(B, a.Hkv, 8, a.hd), torch.zeros(B, a.Hkv, 8, a.hd))))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)  # same math, one GEMM
    w = attns[0]._fused().weight
    assert attns[0].k_proj.weight.data_ptr() == w[attns[0].H * attns[0].hd :].data_ptr()
    with _CountOps() as mode:
        attns[0]._fused()
    assert mode.ops == []


def test_runs_without_the_triton_extra():
    """The README's main-job install has no `triton` extra: every module imports and the demo
    generates with Triton absent (import blocked in a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "import lynx_edge.models, lynx_edge.quant.experts, lynx_edge.offload.runtime, lynx_edge.server.app\n"
            "from lynx_edge import Engine\n"
            "eng = Engine.from_pretrained('demo', threads=1)\n"
            "eng.set_lynx('on')\n"
            "print(len(eng.generate_batch(['def f(x):', 'import os'], max_new_tokens=3, ignore_eos=True)))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows(dtype):
    """The CPU cos/sin table: rows equal the direct formula (to 1 ulp of fp32: torch's vectorised and
    scalar cos may differ in the last bit), blocks already built never change as it grows, and a
    position reads the same row whatever batch asks for it. A wrong block offset is caught."""
    from lynx_edge.config import ModelConfig
    from lynx_edge.models.layers import Rope

    cfg = ModelConfig.from_dict({"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4,
                                 "num_hidden_layers": 1, "vocab_size": 32, "num_experts": 4,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 64})
    rope = Rope(cfg, torch.device("cpu"))
    pos = torch.tensor([[3], [700], [255], [256]])
    cos, sin = rope.cos_sin(pos, dtype, bound=701)
    ref_c, ref_s = rope._cos_sin(pos, dtype)
    torch.testing.assert_close(cos, ref_c, rtol=0, atol=2e-7 if dtype == torch.float32 else 4e-3)
    torch.testing.assert_close(sin, ref_s, rtol=0, atol=2e-7 if dtype == torch.float32 else 4e-3)
    first = rope._table[dtype][0].clone()
    rope.cos_sin(torch.tensor([[2000]]), dtype, bound=2001)  # grows the table by whole blocks
    assert rope._table[dtype][0].shape[0] == 2048 and torch.equal(rope._table[dtype][0][: first.shape[0]], first)
    alone = rope.cos_sin(torch.tensor([[700]]), dtype, bound=701)[0]
    assert torch.equal(alone[0], cos[1])
    rope._table[dtype] = tuple(t.roll(1, 0) for t in rope._table[dtype])  # bug: rows one position off
    assert not torch.allclose(rope.cos_sin(pos, dtype, bound=701)[0], ref_c, atol=1e-3)


@pytest.mark.parametrize("native_bf16", ["0", "1"])
def test_bf16_prefill_paths_follow_the_cpu(monkeypatch, native_bf16):
    """Past the decode-sized batches, bf16 projections and experts take the path that measured
    faster for the CPU: widened to fp32 without native bf16 math, torch's bf16 GEMMs with it
    (cpuflags.cpu_bf16). Both agree with an fp64 reference within bf16 output rounding; decode-sized
    batches keep the native kernel either way (batch-invariant)."""
    from lynx_edge.kernels import native
    from lynx_edge.kernels.moe_gemm import moe_ref
    from lynx_edge.models import layers

    monkeypatch.setenv("LYNX_EDGE_CPU_BF16", native_bf16)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 256, generator=g).bfloat16()
    w = (torch.randn(96, 256, generator=g) / 16).bfloat16()
    ref = x.double() @ w.double().T
    y = layers.linear(x, w)
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 2 ** -8  # one bf16 rounding of the output
    want = torch.nn.functional.linear(x, w) if native_bf16 == "1" else torch.nn.functional.linear(x.float(), w.float()).bfloat16()
    assert torch.equal(y, want)
    assert torch.equal(layers.linear(x[:16], w), native.linear(x[:16], w))  # decode-sized: the native kernel
    E, K, D, I = 8, 4, 64, 32
    monkeypatch.setattr(layers, "GROUPED_BF16_MIN", D * I)  # these small experts count as big
    gu = (torch.randn(E, 2 * I, D, generator=g) / 8).bfloat16()
    dn = (torch.randn(E, D, I, generator=g) / 6).bfloat16()
    xs = torch.randn(160, D, generator=g).bfloat16()  # 640 slots: past NATIVE_SLOTS
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(160)])
    wts = torch.softmax(torch.randn(160, K, generator=g), -1)
    out = layers.cpu_moe(xs, ids, wts, gu, dn)
    fast = moe_ref(xs, ids, wts, gu, dn) if native_bf16 == "1" else native.moe_dense(xs, ids, wts, gu, dn)
    assert torch.equal(out, fast)
    monkeypatch.setattr(layers, "GROUPED_BF16_MIN", D * I + 1)  # small experts: the native kernel
    assert torch.equal(layers.cpu_moe(xs, ids, wts, gu, dn), native.moe_dense(xs, ids, wts, gu, dn))
    ref = native.moe_dense(xs.float(), ids, wts, gu.float(), dn.float())  # fp32 activations and sums
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2 ** -6  # bf16 h and output roundings (~5e-3)
