"""The routing hook's family-rule inputs (routing.py): selection scores with −inf for experts the
family's own rule excludes, probabilities the weights come from, and routed_scaling_factor.
Reference: the rule written out with plain torch ops (DeepSeek-V2's group-limited greedy)."""
import pytest
import torch

from lynx_edge.lynx import LynxConfig, lynx_select
from lynx_edge.routing import RouterSpec, exact_route

E, K, G, TG = 16, 4, 4, 2  # experts, top-k, groups, groups kept


def group_limited(logits: torch.Tensor):
    """→ (scores with the experts outside each token's best TG groups at −inf, softmax over all)."""
    probs = logits.softmax(-1)
    gs = probs.view(len(logits), G, E // G).amax(-1)  # [T, G]
    keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(TG, -1).indices, True)
    mask = keep.repeat_interleave(E // G, 1)
    return logits.masked_fill(~mask, float("-inf")), probs


def test_exact_route_with_family_probs_and_scaling():
    torch.manual_seed(0)
    logits = torch.randn(9, E) * 3
    scores, probs = group_limited(logits)
    spec = RouterSpec(E, K, False, routed_scaling_factor=2.5)
    ids, w = exact_route(scores, spec, probs)
    want = probs.masked_fill(~torch.isfinite(scores), 0).topk(K, -1)  # DeepSeek-V2 as transformers writes it
    assert torch.equal(ids.sort(-1).values, want.indices.sort(-1).values)
    torch.testing.assert_close(w, probs.gather(1, ids) * 2.5, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["lynx", "budget:4"])
def test_lynx_never_picks_an_excluded_expert(kind):
    torch.manual_seed(1)
    spec = RouterSpec(E, K, False, routed_scaling_factor=2.0)
    for trial in range(20):
        logits = torch.randn(16, E) * 2
        scores, probs = group_limited(logits)
        r = lynx_select(scores, True, spec, LynxConfig.parse(kind), probs=probs)
        finite = torch.isfinite(scores).gather(1, r.ids)
        assert finite.all(), trial  # never an expert outside the token's groups
        assert all(len(set(row.tolist())) == K for row in r.ids)  # k distinct
        assert torch.equal(r.ids[:, 0], exact_route(scores, spec, probs)[0][:, 0])  # top-1 kept
        ids0 = exact_route(scores, spec, probs)[0]
        assert len(r.ids.unique()) <= len(ids0.unique())  # the union never grows
        same = (r.ids == ids0).all(1)  # untouched tokens: the exact weights, scaled
        torch.testing.assert_close(r.weights[same], probs.gather(1, ids0)[same] * 2.0, rtol=0, atol=0)


def test_unscaled_family_is_unchanged():
    """Without family probs or scaling, results are the softmax router's bit for bit."""
    torch.manual_seed(2)
    logits = torch.randn(12, E)
    spec = RouterSpec(E, K, True)
    a = lynx_select(logits, True, spec, LynxConfig())
    b = lynx_select(logits, True, spec, LynxConfig(), probs=logits.softmax(-1))
    assert torch.equal(a.ids, b.ids)
    torch.testing.assert_close(a.weights, b.weights, rtol=1e-6, atol=1e-7)


def test_every_family_module_provides_the_hooks():
    from lynx_edge.models import FAMILIES

    hooks = ("MODEL_TYPE", "DEFAULTS", "parse", "attention", "mlp", "router_spec", "cache_spec", "RENAMES",
             "EXPERT_PARTS")
    for name, fam in FAMILIES.items():
        missing = [h for h in hooks if not hasattr(fam, h)]
        assert not missing and fam.MODEL_TYPE == name, (name, missing)


@pytest.mark.parametrize("kind", ["lynx", "on", "budget:3"])
def test_compiled_cpu_path_equals_torch_path_with_family_rules(kind, monkeypatch):
    """The compiled CPU decode path (lynx_host) takes −inf scores and family probs as the torch
    path does: same ids and weights, and slots with no admissible candidate stay."""
    from lynx_edge import lynx

    spec = RouterSpec(E, K, False, routed_scaling_factor=2.0)
    cfg = LynxConfig.parse(kind)
    g = torch.Generator().manual_seed(3)
    for trial in range(10):
        scores, probs = group_limited(torch.randn(16, E, generator=g) * 2)
        fast = lynx_select(scores, True, spec, cfg, probs=probs)
        monkeypatch.setattr(lynx, "CPU_HOST_PATH", False)
        ref = lynx_select(scores, True, spec, cfg, probs=probs)
        monkeypatch.setattr(lynx, "CPU_HOST_PATH", True)
        assert torch.equal(fast.ids, ref.ids), trial
        assert torch.equal(fast.weights, ref.weights), trial
        assert torch.equal(fast.vec[:6], ref.vec[:6]), trial
