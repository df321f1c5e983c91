"""Transparent huge pages for the CPU weights (lynx_edge/hugepages.py): which ranges are marked,
that the walk reaches the expert sinks, and that the build marks the model before loading."""
from __future__ import annotations

import torch
import pytest

from lynx_edge import Engine, hugepages

HUGE = hugepages.HUGE


def _interior(t: torch.Tensor) -> int:
    start = (t.data_ptr() + HUGE - 1) & ~(HUGE - 1)
    return max(0, ((t.data_ptr() + t.nbytes) & ~(HUGE - 1)) - start)


@pytest.fixture
def thp_on(monkeypatch):
    monkeypatch.setenv("LYNX_EDGE_THP", "1")
    hugepages._madvise.cache_clear()
    yield
    monkeypatch.undo()
    hugepages._madvise.cache_clear()


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("LYNX_EDGE_THP", raising=False)
    hugepages._madvise.cache_clear()
    try:
        assert hugepages.advise([torch.empty(32 << 20, dtype=torch.uint8)]) == 0
    finally:
        hugepages._madvise.cache_clear()


def test_advise_marks_the_whole_huge_pages_inside_big_tensors(thp_on, monkeypatch):
    if hugepages._madvise() is None:
        pytest.skip("no transparent huge pages to ask for here (not Linux, or THP never)")
    big = torch.empty(32 << 20, dtype=torch.uint8)
    assert _interior(big) >= 30 << 20
    assert hugepages.advise([big]) == _interior(big)
    assert hugepages.advise([big, big[1:]]) == _interior(big)  # one storage, marked once
    assert hugepages.advise([torch.empty(4 << 20, dtype=torch.uint8)]) == 0  # small tensors are left alone
    monkeypatch.setenv("LYNX_EDGE_THP", "0")
    hugepages._madvise.cache_clear()
    assert hugepages.advise([big]) == 0


def test_model_tensors_reach_the_packed_expert_sinks():
    """Demo --int4: the INT4 experts are not parameters; the walk still finds them (4 layers x 32
    experts x 3 x 256 x 128 nibbles, plus their scales)."""
    eng = Engine.from_pretrained("demo", device="cpu", int4=True)
    found = {t.data_ptr(): t.nbytes for t in hugepages.model_tensors(eng.model)}
    params = {p.data_ptr(): p.nbytes for p in eng.model.parameters()}
    extra = sum(n for ptr, n in found.items() if ptr not in params)
    nibbles = 4 * 32 * 3 * 256 * 128 // 2
    assert set(params) <= set(found) and nibbles <= extra <= 1.1 * nibbles


def test_the_build_marks_the_weights_before_they_stream_in(monkeypatch):
    calls = []
    real = hugepages.advise

    def spy(tensors):
        tensors = list(tensors)
        calls.append(tensors)
        return real(tensors)

    monkeypatch.setattr(hugepages, "advise", spy)
    eng = Engine.from_pretrained("demo", device="cpu", dtype="float32")
    assert len(calls) == 1
    marked = {t.data_ptr() for t in calls[0]}
    gate_up = [p for n, p in eng.model.named_parameters() if ".mlp.experts." in n]
    assert gate_up and all(p.data_ptr() in marked for p in gate_up)  # the fp32 stacked experts, 8 MiB each


def test_the_int8_head_is_marked_as_it_is_allocated(monkeypatch):
    """--int8-head quantises after the load: its codes (read whole every step; Qwen3-30B-A3B's are
    311 MB) are marked when quantize_rows allocates them, before it writes them."""
    from lynx_edge.quant.int8 import quantize_rows

    seen = []
    monkeypatch.setattr(hugepages, "advise", lambda ts: seen.extend(t.data_ptr() for t in ts) or 0)
    q, _ = quantize_rows(torch.randn(4096, 2048))
    assert seen == [q.data_ptr()]
