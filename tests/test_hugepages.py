"""Transparent huge pages for the CPU weights (lynx_edge/hugepages.py): which ranges are marked,
that the walk reaches the expert sinks, that the build marks the model before loading when
EngineConfig.huge_pages asks (or $LYNX_EDGE_THP where it is None), and that serve asks."""
from __future__ import annotations

import torch
import pytest

from lynx_edge import Engine, hugepages

HUGE = hugepages.HUGE


def _interior(t: torch.Tensor) -> int:
    start = (t.data_ptr() + HUGE - 1) & ~(HUGE - 1)
    return max(0, ((t.data_ptr() + t.nbytes) & ~(HUGE - 1)) - start)


def test_advise_marks_the_whole_huge_pages_inside_big_tensors():
    if hugepages._madvise() is None:
        pytest.skip("no transparent huge pages to ask for here (not Linux, or THP never)")
    big = torch.empty(32 << 20, dtype=torch.uint8)
    assert _interior(big) >= 30 << 20
    assert hugepages.advise([big]) == _interior(big)
    assert hugepages.advise([big, big[1:]]) == _interior(big)  # one storage, marked once
    assert hugepages.advise([torch.empty(4 << 20, dtype=torch.uint8)]) == 0  # small tensors are left alone


@pytest.mark.parametrize("env, default, want", [(None, False, False), (None, True, True), ("1", False, True),
                                                ("0", True, False)])
def test_env_default(monkeypatch, env, default, want):
    if env is None:
        monkeypatch.delenv("LYNX_EDGE_THP", raising=False)
    else:
        monkeypatch.setenv("LYNX_EDGE_THP", env)
    assert hugepages.env_default(default) is want


def test_model_tensors_reach_the_packed_expert_sinks():
    """Demo --int4: the INT4 experts are not parameters; the walk still finds them (4 layers x 32
    experts x 3 x 256 x 128 nibbles, plus their scales)."""
    eng = Engine.from_pretrained("demo", device="cpu", int4=True)
    found = {t.data_ptr(): t.nbytes for t in hugepages.model_tensors(eng.model)}
    params = {p.data_ptr(): p.nbytes for p in eng.model.parameters()}
    extra = sum(n for ptr, n in found.items() if ptr not in params)
    nibbles = 4 * 32 * 3 * 256 * 128 // 2
    assert set(params) <= set(found) and nibbles <= extra <= 1.1 * nibbles


@pytest.fixture
def advised(monkeypatch):
    """The tensors each hugepages.advise call was given (then marked as usual)."""
    calls, real = [], hugepages.advise

    def spy(tensors):
        tensors = list(tensors)
        calls.append(tensors)
        return real(tensors)

    monkeypatch.setattr(hugepages, "advise", spy)
    monkeypatch.delenv("LYNX_EDGE_THP", raising=False)
    return calls


def test_the_build_marks_the_weights_before_they_stream_in(advised, monkeypatch):
    eng = Engine.from_pretrained("demo", device="cpu", dtype="float32", huge_pages=True)
    assert len(advised) == 1
    marked = {t.data_ptr() for t in advised[0]}
    gate_up = [p for n, p in eng.model.named_parameters() if ".mlp.experts." in n]
    assert gate_up and all(p.data_ptr() in marked for p in gate_up)  # the fp32 stacked experts, 8 MiB each
    Engine.from_pretrained("demo", device="cpu", dtype="float32")  # off unless asked
    monkeypatch.setenv("LYNX_EDGE_THP", "1")
    Engine.from_pretrained("demo", device="cpu", dtype="float32", huge_pages=False)  # the option wins
    assert len(advised) == 1
    Engine.from_pretrained("demo", device="cpu", dtype="float32")  # None: the environment's word
    assert len(advised) == 2


def test_the_int8_head_is_marked_as_it_is_allocated(advised):
    """--int8-head quantises after the load: its codes (read whole every step; Qwen3-30B-A3B's are
    311 MB) are marked when quantize_rows allocates them, before it writes them."""
    from lynx_edge.quant.int8 import quantize_rows

    q, _ = quantize_rows(torch.randn(4096, 2048), huge_pages=True)
    assert [[t.data_ptr() for t in ts] for ts in advised] == [[q.data_ptr()]]
    quantize_rows(torch.randn(4096, 2048))
    assert len(advised) == 1


@pytest.mark.parametrize("env, want", [(None, True), ("0", False)])
def test_serve_asks_for_huge_pages_unless_told_not_to(monkeypatch, env, want):
    """A server decodes for hours: serve loads with huge_pages on, unless $LYNX_EDGE_THP=0."""
    from typer.testing import CliRunner

    from lynx_edge.cli import serve as serve_cli
    from lynx_edge.cli.main import app

    seen = {}

    class Loaded(Exception):
        pass

    def load(model, **kw):
        seen.update(kw)
        raise Loaded

    monkeypatch.setattr(serve_cli, "load_engine", load)
    env_vars = {"COLUMNS": "200"} if env is None else {"COLUMNS": "200", "LYNX_EDGE_THP": env}
    if env is None:
        monkeypatch.delenv("LYNX_EDGE_THP", raising=False)
    r = CliRunner().invoke(app, ["serve", "demo"], env=env_vars)
    assert "Loaded" in r.output and seen["huge_pages"] is want, r.output  # stopped after the load
