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
