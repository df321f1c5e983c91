"""The memory plan (`lynx-edge info`, plan_memory) against arithmetic recomputed here from the
real config.json of Mixtral-8x7B-Instruct and Qwen3-30B-A3B (tests/fixtures, copied from the
published repos): non-expert bytes, KV, INT4 block bytes, device slots, host steady state and
load peak, exact pinned bytes and what pin_memory=True's next_pow2 rounding would have pinned.
Also the verdicts (does not fit, tight, pinned limited) and that `info` exits 0 with the plan."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from lynx_edge.cli.main import app
from lynx_edge.config import ConfigError, ModelConfig
from lynx_edge.offload import memory
from lynx_edge.offload.plan import PlanError, QuantInfo, make_plan, plan_memory
from lynx_edge.offload.options import OffloadOptions
from lynx_edge.offload.profile import ProfileError, load_profile, profile_from_dict, to_toml

FIX = Path(__file__).resolve().parent / "fixtures"
MIXTRAL, QWEN3 = FIX / "mixtral-8x7b-instruct", FIX / "qwen3-30b-a3b"
GIB = 2**30
runner = CliRunner()


def info(*args, **env):
    return runner.invoke(app, ["info", *[str(a) for a in args]], env=env or None)


@pytest.fixture
def memlock(monkeypatch):
    """Fake RLIMIT_MEMLOCK: memlock(None) = unlimited, memlock(n) = n bytes."""
    import resource

    def set_limit(n):
        lim = resource.RLIM_INFINITY if n is None else n
        monkeypatch.setattr(memory._resource, "getrlimit", lambda which: (lim, lim))
    set_limit(None)
    return set_limit


# ---------------------------------------------------------------------- arithmetic references
def align(n: int) -> int:
    return (n + 127) // 128 * 128


def int4_block(D: int, I: int, G: int = 128, sym: bool = True) -> int:
    """One INT4 expert: 4-bit codes, fp16 scales per group (+ uint8 zeros when asymmetric)."""
    n = align(2 * I * D // 2) + align(D // G * 2 * I * 2) + align(D * I // 2) + align(I // G * D * 2)
    return n + (0 if sym else align(D // G * 2 * I) + align(I // G * D))


def ref(c: dict) -> dict:
    """Everything the plan sizes, from config.json fields only (bf16 model)."""
    D, V, L, E, K = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c.get("num_local_experts", c.get("num_experts")), c["num_experts_per_tok"]
    I = c.get("moe_intermediate_size", c["intermediate_size"])
    H, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim", D // H)
    qk = 2 * hd if c["model_type"] == "qwen3_moe" else 0
    per_layer = 2 * D * H * hd + 2 * D * Hkv * hd + 2 * D + E * D + qk  # q,o,k,v, norms, router, q/k norm
    params_ne = 2 * V * D + D + L * per_layer
    return dict(D=D, I=I, L=L, E=E, K=K, Hkv=Hkv, hd=hd, ne=2 * params_ne, params_ne=params_ne,
                expert_params=3 * D * I, layer16=E * 3 * D * I * 2)


def kv(r: dict, ctx: int, batch: int = 1) -> int:
    return 2 * r["L"] * batch * r["Hkv"] * ctx * r["hd"] * 2


def next_pow2(n: int) -> int:
    return 2 ** math.ceil(math.log2(n))


def res(plan: dict, key: str) -> dict:
    return next(r for r in plan["resources"] if r["key"] == key)


# ---------------------------------------------------------------------- the CLI on real configs
@pytest.mark.parametrize("fixture", [MIXTRAL, QWEN3])
def test_offload_int4_on_rtx4090_matches_arithmetic(fixture, memlock):
    r = info(fixture, "--offload", "--int4", "--profile", "rtx4090-24gb", "-o", "json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["memory"]
    c = ref(json.loads((fixture / "config.json").read_text()))
    eb = int4_block(c["D"], c["I"])
    total = c["L"] * c["E"]
    assert plan["expert_bytes"] == eb and plan["expert_format"] == "int4" and plan["total_experts"] == total
    # GPU: non-expert + KV(4096) + 1 GiB reserve + K scratch slots, the rest of 24 GiB is slots
    fixed = c["ne"] + kv(c, 4096) + 1 * GIB
    slots = min(total, (24 * GIB - fixed - c["K"] * eb) // eb)
    scratch = 0 if slots == total else c["K"]
    gpu = res(plan, "gpu")
    assert plan["expert_slots"] == slots
    assert gpu["steady_bytes"] == gpu["peak_bytes"] == fixed + (slots + scratch) * eb
    assert gpu["available_bytes"] == 24 * GIB and gpu["verdict"] == "fits"
    # host: the pinned store + a 2-slot staging ring; load peak = 1.1 × (that + one 16-bit layer)
    store = total * eb + 2 * eb
    host = res(plan, "host")
    assert host["steady_bytes"] == store and host["available_bytes"] == 64 * GIB
    assert host["peak_bytes"] == int(1.1 * (store + c["layer16"])) and host["verdict"] == "fits"
    pinned = res(plan, "pinned")
    assert pinned["steady_bytes"] == store and pinned["verdict"] == "fits" and pinned["available_bytes"] is None
    assert plan["pinned_pow2_bytes"] == c["L"] * next_pow2(c["E"] * eb) + next_pow2(2 * eb)
    page = res(plan, "page_cache")  # no safetensors in the fixture: the bf16 checkpoint's size
    assert page["steady_bytes"] == c["ne"] + total * c["expert_params"] * 2 and page["verdict"] == "info"
    assert plan["fits"] is True


def test_issue_figures_for_mixtral(memlock):
    """The issue's numbers: bf16 experts 84 GiB would pin 128 GiB; INT4 21.7 GiB → 32 GiB."""
    cfg = ModelConfig.from_file(MIXTRAL / "config.json")
    for int4, store_gib, pow2_gib in ((False, 84.0, 128), (True, 21.66, 32)):
        p = plan_memory(cfg, device="cuda", dtype=torch.bfloat16, offload=True, int4=int4, ctx=4096,
                        profile="rtx4090-24gb")
        experts = p.total_experts * p.expert_bytes
        assert experts / GIB == pytest.approx(store_gib, abs=0.01)
        staging = next_pow2(2 * p.expert_bytes)
        assert p.pinned_pow2_bytes - staging == pow2_gib * GIB


@pytest.mark.parametrize("fixture,total,active", [(MIXTRAL, 46.7e9, 12.9e9), (QWEN3, 30.5e9, 3.3e9)])
def test_parameter_counts_match_published_figures(fixture, total, active):
    r = info(fixture, "--profile", "rtx4090-24gb", "-o", "json")
    p = json.loads(r.stdout)["params"]
    assert p["total"] == pytest.approx(total, rel=0.02) and p["active"] == pytest.approx(active, rel=0.02)
    c = ref(json.loads((fixture / "config.json").read_text()))
    assert p["non_expert"] == c["params_ne"]


def test_plain_bf16_mixtral_does_not_fit_a_4090_but_info_exits_0(memlock):
    r = info(MIXTRAL, "--profile", "rtx4090-24gb")
    assert r.exit_code == 0, r.output
    assert "does not fit" in r.stdout and "--offload" in r.stdout
    plan = json.loads(info(MIXTRAL, "--profile", "rtx4090-24gb", "-o", "json").stdout)["memory"]
    c = ref(json.loads((MIXTRAL / "config.json").read_text()))
    gpu = res(plan, "gpu")
    dense = align(2 * c["I"] * c["D"] * 2) + align(c["D"] * c["I"] * 2)  # gate_up then down, bf16
    need = c["ne"] + kv(c, 4096) + GIB + c["L"] * c["E"] * dense
    assert gpu["steady_bytes"] == need and gpu["verdict"] == "does not fit" and not plan["fits"]
    assert "--offload" in gpu["hint"] and f"a GPU budget of {math.ceil(need / GIB * 10) / 10:.1f} GiB" in gpu["hint"]
    assert "does not fit" in plan["summary"] and "\n" not in plan["summary"]


def test_plan_check_raises_one_line_with_the_whole_plan(memlock):
    cfg = ModelConfig.from_file(MIXTRAL / "config.json")
    p = plan_memory(cfg, device="cuda", dtype=torch.bfloat16, offload=False, int4=False, ctx=4096, profile="rtx4090-24gb")
    with pytest.raises(PlanError) as ei:
        p.check()
    assert isinstance(ei.value, ConfigError) and "\n" not in str(ei.value)
    assert str(ei.value).startswith("mixtral (plain) does not fit profile rtx4090-24gb: GPU memory needs")
    assert "memory plan" in ei.value.plan_text and "host RAM" in ei.value.plan_text
    ok = plan_memory(cfg, device="cuda", dtype=torch.bfloat16, offload=True, int4=True, ctx=4096, profile="rtx4090-24gb")
    ok.check()  # fits: no exception
    assert json.loads(json.dumps(ok.report()))["fits"] is True


def test_memlock_limit_gives_the_pinned_verdict(memlock):
    memlock(2 * GIB)
    r = info(QWEN3, "--offload", "--int4", "--profile", "rtx4090-24gb", "-o", "json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["memory"]
    pinned = res(plan, "pinned")
    assert pinned["verdict"] == "limited" and pinned["available_bytes"] == 2 * GIB
    assert "pinned memory limited to 2.00 GiB: the rest is pageable + staging ring, slower" in pinned["note"]
    assert "ulimit -l" in pinned["hint"] and plan["fits"]  # a verdict, never an abort
    memlock(100 * GIB)
    assert res(json.loads(info(QWEN3, "--offload", "--int4", "--profile", "rtx4090-24gb", "-o", "json").stdout)["memory"],
               "pinned")["verdict"] == "fits"


def test_device_cuda_without_cuda_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = info(MIXTRAL, "--device", "cuda")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA is not available" in lines[0] and "--profile" in lines[0]
    assert "AssertionError" not in r.output
    r = info(MIXTRAL, "--device", "cuda", "--profile", "cpu-only")
    assert r.exit_code == 1 and "has no GPU" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = info(MIXTRAL, "--device", "tpu")
    assert r.exit_code == 1 and "--device 'tpu'" in r.stderr


def test_offline_alias_fails_fast_in_one_line(monkeypatch, tmp_path):
    from lynx_edge import modelinfo

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the online path, with the hub unreachable
    monkeypatch.setattr(modelinfo, "_reachable", lambda url, timeout=3.0: False)
    t0 = time.perf_counter()
    r = info("mixtral-8x22b", HF_HUB_CACHE=str(tmp_path))
    assert time.perf_counter() - t0 < 5
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "unreachable" in lines[0] and "hf download" in lines[0]


# ---------------------------------------------------------------------- hints and other modes
def test_ctx_hint_makes_the_gpu_fit(memlock):
    cfg = ModelConfig.from_file(MIXTRAL / "config.json")
    kw = dict(device="cuda", dtype=torch.bfloat16, offload=True, int4=True, batch=8, profile="laptop-rtx4060-8gb")
    p = plan_memory(cfg, ctx=32768, **kw)
    gpu = p.resource("gpu")
    assert gpu.verdict == "does not fit" and "--ctx-size" in gpu.hint
    ctx = int(gpu.hint.split("--ctx-size ")[1].split()[0])
    assert 256 <= ctx < 32768
    assert plan_memory(cfg, ctx=ctx, **kw).resource("gpu").ok
    assert not plan_memory(cfg, ctx=ctx + 512, **kw).resource("gpu").ok  # the hint is the largest 256-multiple


def test_cpu_device_and_host_hints(memlock):
    cfg = ModelConfig.from_file(MIXTRAL / "config.json")
    c = ref(json.loads((MIXTRAL / "config.json").read_text()))
    p = plan_memory(cfg, device="cpu", dtype=torch.float32, offload=False, int4=False, ctx=4096, profile="cpu-only")
    host = p.resource("host")
    need = 2 * c["ne"] + 2 * kv(c, 4096) + c["L"] * c["E"] * 3 * c["D"] * c["I"] * 4  # fp32 everything
    assert [r.key for r in p.resources] == ["host", "page_cache"] and host.steady_bytes == need
    assert host.peak_bytes == int(1.1 * (need + c["layer16"])) and host.verdict == "does not fit"
    assert "--int4 --dtype bfloat16" in host.hint and f"{math.ceil((host.peak_bytes - 32 * GIB) / GIB)} GiB more RAM" in host.hint
    p2 = plan_memory(cfg, device="cpu", dtype=torch.bfloat16, offload=False, int4=True, ctx=4096, profile="cpu-only")
    assert p2.resource("host").ok


def test_verdict_thresholds():
    assert memory.verdict(90, 100) == "fits" and memory.verdict(91, 100) == "tight"
    assert memory.verdict(100, 100) == "tight" and memory.verdict(101, 100) == "does not fit"
    assert memory.next_pow2(3 * GIB) == 4 * GIB and memory.next_pow2(4 * GIB) == 4 * GIB


def test_unified_memory_profile_counts_one_pool(memlock):
    cfg = ModelConfig.from_file(QWEN3 / "config.json")
    p = plan_memory(cfg, device="cuda", dtype=torch.bfloat16, offload=False, int4=True, ctx=4096, profile="jetson-orin-64gb")
    assert [r.key for r in p.resources] == ["unified", "page_cache"]
    u = p.resource("unified")
    assert u.available_bytes == 64 * GIB and u.steady_bytes == sum(u.parts.values())


def test_gptq_checkpoint_experts_are_int4(memlock):
    r = info(FIX / "gptq_tiny", "-o", "json", "--device", "cpu")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    plan, c = out["memory"], json.loads((FIX / "gptq_tiny" / "config.json").read_text())
    assert plan["mode"] == "gptq-4bit" and plan["expert_format"] == "int4"
    assert plan["expert_bytes"] == int4_block(c["hidden_size"], c["moe_intermediate_size"], 32, sym=False)
    assert "asymmetric" in out["config"]["quantization"]
    assert out["params"]["expert_bytes_per_expert"] == out["params"]["params_per_expert"] // 2
    size = sum(f.stat().st_size for f in (FIX / "gptq_tiny").glob("*.safetensors"))
    assert res(plan, "page_cache")["steady_bytes"] == size  # the real files' size when present


@pytest.mark.parametrize("qc,field", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits = 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size = 100"),
    ({"quant_method": "fp8"}, "weight_block_size = None"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt = 'e5m2'"),
    ({"quant_method": "bitsandbytes"}, "quant_method = 'bitsandbytes'"),
])
def test_bad_quantization_config_is_one_line(tmp_path, qc, field):
    c = json.loads((QWEN3 / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, "quantization_config": qc}))
    r = info(tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and field in lines[0] and "quantization_config" in lines[0]


def test_fp8_checkpoint_info(tmp_path, memlock):
    """Qwen3-30B-A3B-FP8's config (the real one plus its FP8 block): `info` on a CPU plans the
    experts at one byte per weight plus block scales and says so."""
    c = json.loads((QWEN3 / "config.json").read_text())
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps({**c, "quantization_config": qc}))
    r = info(tmp_path, "--device", "cpu", "-o", "json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    D, I = c["hidden_size"], c["moe_intermediate_size"]
    assert out["memory"]["expert_format"] == "fp8"
    assert out["memory"]["expert_bytes"] == 3 * D * I + 4 * (2 * I // 128 * D // 128 + D // 128 * I // 128)
    assert out["params"]["expert_bytes_per_expert"] == out["params"]["params_per_expert"]
    assert "experts FP8" in out["config"]["quantization"]


def test_awq_checkpoint_is_planned_as_int4(memlock):
    r = info(FIX / "awq_tiny", "-o", "json", "--device", "cpu")
    assert r.exit_code == 0, r.output
    plan, c = json.loads(r.stdout)["memory"], json.loads((FIX / "awq_tiny" / "config.json").read_text())
    qc = c["quantization_config"]
    assert plan["mode"] == "awq-4bit" and plan["expert_format"] == "int4"
    assert plan["expert_bytes"] == int4_block(c["hidden_size"], c["moe_intermediate_size"], qc["group_size"],
                                              sym=not qc.get("zero_point", True))


def test_make_plan_leaves_host_memory_to_the_memory_plan():
    cfg = ModelConfig.from_file(QWEN3 / "config.json")
    plan = make_plan(cfg, OffloadOptions(expert_slots=1), torch.bfloat16, "cpu", load_profile("cpu-only"), host_available=1000)
    assert any("host memory" in w for w in plan.warnings)
    with pytest.raises(PlanError, match="does not hold"):  # the impossible device budget still raises
        make_plan(cfg, OffloadOptions(gpu_budget_gib=0.5, ctx=4096), torch.bfloat16, "cpu", load_profile("rtx4090-24gb"))


# ---------------------------------------------------------------------- profiles carry host RAM
def test_profiles_carry_host_memory():
    expect = {"rtx4090-24gb": 64, "rtx3060-12gb": 32, "laptop-rtx4060-8gb": 32, "jetson-orin-64gb": 64,
              "cpu-only": 32, "h200": 2048}
    for name, gib in expect.items():
        assert load_profile(name).host_memory_gib == gib
    import tomllib

    data = tomllib.loads(to_toml(load_profile("rtx4090-24gb")))
    for bad, msg in ((0, "impossible"), (-4, "impossible"), ("lots", "must be a number")):
        with pytest.raises(ProfileError, match=f"\\[host\\] memory_gib.*{msg}|{msg}"):
            profile_from_dict({**data, "host": {"memory_gib": bad}}, "x.toml")
    del data["host"]
    assert profile_from_dict(data).host_memory_gib is None  # optional: plans then use this host's RAM
    with pytest.raises(ProfileError, match=r"unknown key \[host\] ram_gib"):
        profile_from_dict({**data, "host": {"ram_gib": 8}}, "x.toml")


def test_info_plans_in_the_dtype_the_engine_loads(memlock, monkeypatch):
    """No --dtype on a CPU: info plans in the dtype Engine.from_pretrained picks (build.default_dtype):
    the checkpoint's bf16 for a 30B model (only its config here: sized from its parameters), fp32
    for the 29 MB demo on a CPU without native bf16 or the native kernels, bf16 with either; --dtype
    still wins."""
    from lynx_edge import Engine
    from lynx_edge.kernels import native

    monkeypatch.delenv("LYNX_EDGE_CPU_DTYPE", raising=False)
    monkeypatch.setenv("LYNX_EDGE_NATIVE", "0")  # info runs in a subprocess: no native kernels there
    monkeypatch.setattr(native, "lib", lambda: None)  # nor here
    monkeypatch.setenv("LYNX_EDGE_CPU_BF16", "1")
    assert json.loads(info("demo", "--device", "cpu", "-o", "json").stdout)["memory"]["dtype"] == "bf16"
    assert Engine.from_pretrained("demo", device="cpu").model.placement.dtype == "bfloat16"
    monkeypatch.setenv("LYNX_EDGE_CPU_BF16", "0")
    assert json.loads(info(QWEN3, "--device", "cpu", "-o", "json").stdout)["memory"]["dtype"] == "bf16"
    assert json.loads(info(QWEN3, "--device", "cpu", "--dtype", "float32", "-o", "json").stdout)["memory"]["dtype"] == "fp32"
    assert json.loads(info("demo", "--device", "cpu", "-o", "json").stdout)["memory"]["dtype"] == "fp32"
    assert Engine.from_pretrained("demo", device="cpu").model.placement.dtype == "float32"
    cfg = ModelConfig.from_file(QWEN3 / "config.json")
    assert memory.choose_dtype(None, "cpu", cfg, file_bytes=1 << 30) == torch.float32  # a small checkpoint on disk
    assert memory.choose_dtype(None, "cuda", cfg) == torch.bfloat16


def test_info_names_mxfp4_experts_as_mxfp4():
    """gpt-oss-20b's published config (quantization_config mxfp4): its experts are fp4 e2m1 with e8m0
    scales, not INT4."""
    q = json.loads(info(FIX / "real" / "gpt-oss-20b", "-o", "json").stdout)["config"]["quantization"]
    assert q.endswith("experts MXFP4") and "e2m1" in q and "INT4" not in q
