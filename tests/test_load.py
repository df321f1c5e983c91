"""The one-pass load (lynx_edge.build): backends chosen at build time, tensors streamed into place.

References: RTN INT4 streamed per projection must be bit-identical to quantising the stacked
16-bit experts at once (quant.int4.quantize_experts); offloaded stores hold the same bytes;
peak anonymous memory stays within the promised bound (benchmarks/load_memory.py in a
subprocess); pinning registers exactly the store's bytes.
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import make_tiny
from lynx_edge import Engine
from lynx_edge.build import LoadOptions, default_dtype, load_model
from lynx_edge.config import ConfigError, ModelConfig
from lynx_edge.loader import LoadError
from lynx_edge.models.layers import StackedExperts
from lynx_edge.offload import store as store_mod
from lynx_edge.quant.experts import Int4MoEExperts
from lynx_edge.quant.int4 import quantize_experts

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def q3(tmp_path_factory) -> Path:
    """qwen3_moe whose D and I are multiples of 32 (an INT4 group)."""
    return make_tiny(tmp_path_factory.mktemp("load") / "q3", "qwen3_moe", moe_intermediate_size=64)


def _load(path, **kw):
    cfg = ModelConfig.from_file(path / "config.json")
    return load_model(path, cfg, LoadOptions(device="cpu", dtype="float32", **kw))


def test_streamed_rtn_equals_batch_rtn(q3):
    dense, q = _load(q3), _load(q3, int4=True)
    for i in dense.cfg.moe_layer_ids:
        ref, got = dense.layers[i].mlp.experts, q.layers[i].mlp.experts
        assert isinstance(ref, StackedExperts) and isinstance(got, Int4MoEExperts)
        want = quantize_experts(ref.gate_up.data, ref.down.data, got.packed.group_size, True)
        assert torch.equal(got.packed.data, want.data)


def test_offload_int4_store_holds_the_same_blocks(q3):
    q = _load(q3, int4=True)
    off = _load(q3, int4=True, offload=True, offload_options=dict(profile="cpu-only", expert_slots=4))
    rt = off.offload
    for i in q.cfg.moe_layer_ids:
        assert torch.equal(rt.store.layers[i], q.layers[i].mlp.experts.packed.data)
    assert off.placement.experts == "int4" and off.placement.where == "host"


def test_offload_cpu_experts_run_the_engines_int4_act(q3):
    """Fiddler-style CPU experts of an INT4 store compute with the engine's int4_act (f32 here: the
    exact rows), not the process default; q16 on the same block differs, within its bound."""
    from lynx_edge.kernels import native
    from lynx_edge.offload.store import expert_mlp

    if native.lib() is None:
        pytest.skip("native kernels not built")
    off = _load(q3, int4=True, int4_act="f32", offload=True, offload_options=dict(profile="cpu-only", expert_slots=4))
    fmt, i = off.offload.store.fmt, off.cfg.moe_layer_ids[0]
    assert fmt.int4_act == "f32"
    block = off.offload.store.layers[i][1]
    x = torch.randn(3, off.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ref = expert_mlp(x.double(), *(w.double() for w in fmt.weights(block, torch.float32))).float()
    y32 = fmt.compute(block, x)
    fmt.int4_act = "q16"
    y16 = fmt.compute(block, x)
    scale = ref.abs().max().item()
    assert (y32 - ref).abs().max().item() < 2e-6 * scale
    assert 1e-8 * scale < (y16 - ref).abs().max().item() < 2e-4 * scale
    default = _load(q3, int4=True, offload=True, offload_options=dict(profile="cpu-only")).offload.store.fmt.int4_act
    assert default == native.default_int4_act()  # resolved at load on a CPU


def test_cpu_offload_serves_from_the_store_without_a_second_copy(q3):
    ref = Engine.from_pretrained(q3, device="cpu", dtype="float32")
    eng = Engine.from_pretrained(q3, device="cpu", dtype="float32", offload=True, expert_slots=3, profile="cpu-only")
    rt = eng.model.offload
    assert rt.in_place and rt.pool.numel() == 0
    prompts = ["def f(x):", "import os"]
    want = ref.generate_batch(prompts, max_new_tokens=6, ignore_eos=True)
    assert eng.generate_batch(prompts, max_new_tokens=6, ignore_eos=True) == want
    s = eng.last_stats["offload"]
    assert s["misses"] > 0 and s["bytes_h2d"] == s["copies"] * rt.store.nbytes  # counted, not copied


def test_fused_and_per_expert_checkpoints_load_the_same(q3, tmp_path):
    """transformers' fused expert tensors [E, 2I, D] / [E, D, I] stream through the same sinks."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(q3 / "model.safetensors"))
    cfg = json.loads((q3 / "config.json").read_text())
    E, L = cfg.get("num_experts") or cfg["num_local_experts"], cfg["num_hidden_layers"]
    fused = {k: v for k, v in sd.items() if ".experts." not in k}
    for i in range(L):
        p = f"model.layers.{i}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{p}.{e}.gate_proj.weight"], sd[f"{p}.{e}.up_proj.weight"]]) for e in range(E)])
        fused[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in range(E)])
    dst = tmp_path / "fused"
    dst.mkdir()
    save_file(fused, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    a, b = _load(q3, int4=True), _load(dst, int4=True)
    for i in a.cfg.moe_layer_ids:
        assert torch.equal(a.layers[i].mlp.experts.packed.data, b.layers[i].mlp.experts.packed.data)


def test_missing_expert_projection_is_named(q3, tmp_path):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(q3 / "model.safetensors"))
    del sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    dst = tmp_path / "broken"
    dst.mkdir()
    save_file(sd, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((q3 / "config.json").read_text())
    for kw in ({}, {"int4": True}):
        with pytest.raises(LoadError, match=r"layers\.1\.mlp\.experts\.3 \(up projection\)"):
            _load(dst, **kw)


def test_default_cpu_dtype_follows_the_kernels_the_checkpoint_and_its_size(monkeypatch):
    from lynx_edge.kernels import native

    cfg = ModelConfig.from_dict(json.loads((ROOT / "lynx_edge/demo/config.json").read_text()))
    fp16 = ModelConfig.from_dict({**json.loads((ROOT / "lynx_edge/demo/config.json").read_text()), "dtype": "float16",
                                  "torch_dtype": "float16"})
    cpu = torch.device("cpu")
    monkeypatch.delenv("LYNX_EDGE_CPU_DTYPE", raising=False)
    monkeypatch.setenv("LYNX_EDGE_CPU_BF16", "0")
    if native.lib() is not None:  # the native kernels read bf16 rows: a bf16 checkpoint stays bf16
        assert default_dtype(cpu, cfg, 30 << 20) == torch.bfloat16
        # a big fp16 one (a GPTQ / AWQ export) runs bf16 on them, not on torch's fp16 ops
        assert default_dtype(cpu, fp16, 20 << 30) == torch.bfloat16
    monkeypatch.setattr(native, "lib", lambda: None)  # no native kernels, no native bf16: torch's fp32 GEMMs
    assert default_dtype(cpu, fp16, 20 << 30) == torch.float16  # memory first
    assert default_dtype(cpu, cfg, 30 << 20) == torch.float32  # the demo: widening is cheap
    assert default_dtype(cpu, cfg, 20 << 30) == torch.bfloat16  # a 20 GB bf16 checkpoint stays bf16
    assert default_dtype(torch.device("cuda"), cfg, 1) == torch.bfloat16
    monkeypatch.setenv("LYNX_EDGE_CPU_BF16", "1")  # native bf16: a bf16 checkpoint stays bf16
    assert default_dtype(cpu, cfg, 30 << 20) == torch.bfloat16
    for ckpt in ("float16", "float32"):  # fp16 would lose mantissa bits as bf16; fp32 stays fp32
        c = ModelConfig.from_dict({**json.loads((ROOT / "lynx_edge/demo/config.json").read_text()), "dtype": ckpt,
                                   "torch_dtype": ckpt})
        assert default_dtype(cpu, c, 30 << 20) == torch.float32
    monkeypatch.setenv("LYNX_EDGE_CPU_DTYPE", "bfloat16")  # the choice made by hand
    assert default_dtype(cpu, cfg, 30 << 20) == torch.bfloat16
    monkeypatch.setenv("LYNX_EDGE_CPU_DTYPE", "bf8")
    with pytest.raises(ConfigError, match=r"LYNX_EDGE_CPU_DTYPE='bf8' is not a dtype; use one of float32"):
        default_dtype(cpu, cfg, 30 << 20)
    from lynx_edge.build import resolve_dtype

    with pytest.raises(ConfigError, match=r"dtype='bf8' is not a dtype; use one of float32"):  # the same check
        resolve_dtype("bf8", cpu, cfg, 30 << 20)
    assert resolve_dtype("bf16", cpu, cfg, 30 << 20) == torch.bfloat16  # a named dtype wins over the variable


def test_cpu_bf16_reads_the_cpu_flags(monkeypatch):
    from lynx_edge import cpuflags

    monkeypatch.delenv("LYNX_EDGE_CPU_BF16", raising=False)
    monkeypatch.setattr(cpuflags, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert cpuflags.cpu_bf16()
    monkeypatch.setattr(cpuflags, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16", "amx_tile"}))
    assert cpuflags.cpu_bf16()
    monkeypatch.setattr(cpuflags, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512bw"}))
    assert not cpuflags.cpu_bf16()


class _FakeCudart:
    """Stands in for torch.cuda.cudart(): records cudaHostRegister sizes, optionally refuses."""

    def __init__(self, fail_after: int | None = None):
        self.registered, self.fail_after = [], fail_after

    def cudaHostRegister(self, ptr, size, flags):
        if self.fail_after is not None and len(self.registered) >= self.fail_after:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append(size)
        return 0

    def cudaHostUnregister(self, ptr):
        return 0


def test_pinning_registers_exactly_the_store(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    fmt = store_mod.expert_format("bf16", torch.bfloat16, 64, 96)
    st = store_mod.HostExpertStore(fmt, 5, want_pin=True)
    for layer in range(3):
        st.ensure_layer(layer)
    exact = 5 * fmt.nbytes
    assert fake.registered == [exact] * 3 and st.pinned_bytes == 3 * exact
    assert exact & (exact - 1)  # not a power of two: pin_memory=True would have rounded it up
    assert st.staging is None


def test_pinning_failure_falls_back_to_pageable_with_one_warning(monkeypatch):
    fake = _FakeCudart(fail_after=1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    fmt = store_mod.expert_format("bf16", torch.bfloat16, 64, 96)
    st = store_mod.HostExpertStore(fmt, 5, want_pin=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for layer in range(3):
            st.ensure_layer(layer)
    assert st.pinned == {0: True, 1: False, 2: False} and st.pin_failed
    assert st.staging is not None  # the pinned staging ring carries the pageable layers' copies
    assert sum("pinning host memory failed" in str(x.message) for x in w) == 1


def test_load_peak_memory_within_bound(tmp_path):
    """Peak anonymous memory ≤ (final footprint + one layer's bf16 experts) × 1.1, every mode."""
    out = tmp_path / "lm.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/load_memory.py"), "--layers", "3", "--experts", "16",
           "--hidden", "256", "--inter", "512", "--modes", "plain,int4,offload-int4,gptq,fp8", "--dir", str(tmp_path),
           "--out", str(out), "--threads", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = {x["mode"]: x for x in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"plain", "int4", "offload-int4", "gptq", "fp8"}
    for mode, x in rows.items():
        assert x["peak_anon"] <= x["bound"], (mode, x)
    # INT4 keeps about a quarter of bf16 (a sixth of the fp32 the CPU default widens this one to)
    assert rows["int4"]["footprint"] < 0.5 * rows["plain"]["footprint"]


def _mapped_rss_kib(path: Path) -> int:
    """KiB of this process's mappings of `path` that are resident (/proc/self/smaps)."""
    import re

    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_released_tensors_leave_the_process_and_read_the_same(tmp_path):
    """Checkpoint.release: the whole pages of a tensor the loader is done with leave this process's
    mapping (its RSS: a 16 GB bf16 checkpoint loaded 4-bit otherwise peaks near the file's size), and
    the bytes read back unchanged if anything looks again (a private mapping nothing writes)."""
    from safetensors.torch import save_file

    from lynx_edge.checkpoint import Checkpoint

    a, b = torch.randn(512, 1024), torch.randn(300)
    save_file({"a": a, "b": b}, tmp_path / "model.safetensors")
    f = (tmp_path / "model.safetensors").resolve()
    ck = Checkpoint(tmp_path)
    assert torch.equal(ck.get("a"), a) and torch.equal(ck.get("b"), b)  # both read: 2 MiB resident
    before = _mapped_rss_kib(f)
    ck.release(["a"])
    after = _mapped_rss_kib(f)
    assert before >= 2048 and after <= 16, (before, after)  # left: b's page and a's partial edge pages
    assert torch.equal(ck.get("a"), a)


def test_the_loader_releases_every_tensor_it_reads(q3, monkeypatch):
    """load_weights hands every checkpoint tensor back (Checkpoint.release) once it is in place."""
    from lynx_edge.checkpoint import Checkpoint

    released: list[str] = []
    monkeypatch.setattr(Checkpoint, "release", lambda self, names: released.extend(names))
    _load(q3, int4=True, int4_group=32)
    ck = Checkpoint(q3)
    assert sorted(released) == sorted(ck.names())
