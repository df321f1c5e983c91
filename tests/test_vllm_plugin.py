"""The vLLM plugin (lynx_edge.integrations.vllm).

Default CI, no vLLM: the adapter against lynx-edge's references — the decode mask against
arithmetic, exact mode = exact_route, only decode rows remapped = lynx_select, the custom op's
fake impl and torch.compile, inert register()/attach(), one-line setting errors, telemetry over a
fake forward context. `-m vllm`: end to end in vLLM's CPU build (the interpreter in
$LYNX_VLLM_PYTHON or .venv-vllm), each case in its own subprocess running this file as a script.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lynx_edge.integrations import vllm as lv  # noqa: E402
from lynx_edge.lynx import LynxConfig, LynxTelemetry, lynx_select  # noqa: E402
from lynx_edge.routing import RouterSpec, exact_route  # noqa: E402

SPEC = RouterSpec(num_experts=16, top_k=4, norm_topk_prob=True)


def _logits(T: int, E: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g) * 2.0


def _mask_ref(lens: list[int], T: int) -> list[bool]:
    out = [n == 1 for n in lens for _ in range(n)]
    return out + [False] * (T - len(out))


def _qsl(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("lens,T", [([1, 7, 3, 7], 18), ([1, 7, 3, 7], 24), ([1, 1, 1, 1], 4),
                                    ([5], 5), ([1, 0, 2, 1], 4), ([7, 1], 11), ([], 3)])
def test_decode_mask_matches_arithmetic(lens, T):
    got = lv.decode_mask(_qsl(lens), T)
    assert got.dtype == torch.bool and got.shape == (T,)
    assert got.tolist() == _mask_ref(lens, T)


def _ctx(lens):
    md = SimpleNamespace(query_start_loc=_qsl(lens), num_actual_tokens=sum(lens))
    return SimpleNamespace(attn_metadata={"model.layers.0.self_attn.attn": md})


def test_step_phase_from_fake_forward_context():
    mask, n = lv.step_phase(_ctx([1, 7, 3, 7]), 20)  # 2 padding rows
    assert n == 18 and mask.tolist() == _mask_ref([1, 7, 3, 7], 20)
    assert lv.step_phase(SimpleNamespace(attn_metadata=None), 4) is None  # profile / warm-up
    assert lv.step_phase(SimpleNamespace(attn_metadata=[{}, {}]), 4) is None  # micro-batched
    assert lv.step_phase(_ctx([1, 7]), 4) is None  # more tokens than rows: not this rank's


def _route(mode: str, native=None, force=None, spec=SPEC) -> lv.LayerRoute:
    return lv.LayerRoute(spec, LynxConfig.parse(mode), 0, LynxTelemetry(), native, force)


def test_exact_mode_is_exact_route():
    z = _logits(18)
    mask = lv.decode_mask(_qsl([1, 7, 3, 7]), 18)
    for is_decode in (None, mask, torch.ones(18, dtype=torch.bool)):
        w, ids = _route("off")(None, z, is_decode, 18)
        ids0, w0 = exact_route(z, SPEC)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (18, 4)
        assert torch.equal(ids, ids0.int()) and torch.equal(w, w0)


def test_only_decode_rows_are_remapped():
    lens = [1] * 12 + [3, 2]  # 12 decode tokens, two short prefill requests
    T = sum(lens) + 3  # 3 padding rows
    spec = RouterSpec(num_experts=32, top_k=4, norm_topk_prob=True)  # prefill leaves room to remap
    z = _logits(T, E=32, seed=2)
    mask = lv.decode_mask(_qsl(lens), T)
    w, ids = _route("lynx", spec=spec)(None, z, mask, sum(lens))
    n = sum(lens)
    ref = lynx_select(z[:n], mask[:n], spec, LynxConfig.parse("lynx"))
    assert torch.equal(ids[:n], ref.ids.int()) and torch.equal(w[:n], ref.weights)
    ids0, w0 = exact_route(z, spec)
    changed = (ids.long() != ids0).any(1)
    assert changed[:12].any(), "LYNX should remap some decode token here"
    assert not changed[12:].any() and torch.equal(w[12:], w0[12:])  # prefill + padding exact
    assert torch.allclose(w.sum(1), torch.ones(T), atol=1e-6)  # renormalised, k experts each


def test_untouched_rows_keep_vllms_own_result_bit_for_bit():
    """vLLM's CPU router orders top-k by logit without sorting; rows LYNX leaves alone must keep
    that order and rounding exactly, rows it changes take LYNX's."""
    def native(hidden, logits):  # a stand-in for vLLM's routing: same sets, another order
        ids, w = exact_route(logits, SPEC)
        return (w.flip(1) * (1 + 1e-7)), ids.flip(1).int()

    z = _logits(10, seed=2)
    mask = torch.ones(10, dtype=torch.bool)
    w, ids = _route("lynx", native)(None, z, mask, 10)
    nw, nids = native(None, z)
    ref = lynx_select(z, mask, SPEC, LynxConfig.parse("lynx"))
    same = (ref.ids.sort(1).values == nids.long().sort(1).values).all(1)
    assert same.any() and (~same).any()
    assert torch.equal(ids[same], nids[same]) and torch.equal(w[same], nw[same])
    assert torch.equal(ids[~same], ref.ids[~same].int()) and torch.equal(w[~same], ref.weights[~same])


def test_forced_mode_weights_are_renormalised_probs():
    z = _logits(5, seed=3)
    w, ids = _route("off", force=(3, 7, 11, 2))(None, z, None, 5)
    p = torch.softmax(z, -1)[:, [3, 7, 11, 2]]
    assert ids.tolist() == [[3, 7, 11, 2]] * 5 and torch.allclose(w, p / p.sum(1, keepdim=True), atol=1e-7)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A fake `vllm.forward_context` and a fresh per-process state for the custom op."""
    box = SimpleNamespace(ctx=None)
    mod = types.ModuleType("vllm.forward_context")
    mod.get_forward_context = lambda: box.ctx
    mod.is_forward_context_available = lambda: box.ctx is not None
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.forward_context", mod)
    monkeypatch.setattr(lv, "_STATE", lv.WorkerState())
    return box


def test_custom_op_fake_impl_and_compile(fake_vllm):
    key = lv._STATE.add(_route("lynx"))
    z = _logits(6, seed=4)
    hid = torch.zeros(6, 8)
    torch.library.opcheck(torch.ops.lynx_edge.vllm_route.default, (hid, z, key, 4),
                          test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fw, fi = torch.ops.lynx_edge.vllm_route(mode.from_tensor(hid), mode.from_tensor(z), key, 4)
    assert fw.shape == fi.shape == (6, 4) and fw.dtype == torch.float32 and fi.dtype == torch.int32
    calls = []
    real = lv._STATE.layers[key]
    lv._STATE.layers[key] = lambda *a: calls.append(1) or real(*a)
    fn = torch.compile(lambda h, g: lv._custom_routing(h, g, 4, True, key=key), backend="eager",
                       fullgraph=True)  # fullgraph: no graph break around the opaque op
    for step in range(3):
        fake_vllm.ctx = _ctx([1] * 6)  # a new forward each time
        w, ids = fn(hid, z)
        ref = lynx_select(z, torch.ones(6, dtype=torch.bool), SPEC, LynxConfig.parse("lynx"))
        assert torch.equal(ids, ref.ids.int()) and torch.equal(w, ref.weights)
    assert len(calls) == 3  # the op runs every step, not once at trace time


def test_telemetry_matches_lynx_edge_over_fake_steps(fake_vllm):
    keys = [lv._STATE.add(lv.LayerRoute(SPEC, LynxConfig.parse("on"), ly, lv._STATE.telemetry))
            for ly in (0, 1)]
    ref = LynxTelemetry()
    steps = [[7, 5], [1] * 8, [1] * 8, [1] * 6 + [4]]  # prefill, 2 decode steps, a mixed step
    for s, lens in enumerate(steps):
        fake_vllm.ctx = _ctx(lens)
        T = sum(lens)
        mask = lv.decode_mask(_qsl(lens), T)
        ref.begin_step()
        for ly, key in enumerate(keys):
            z = _logits(T, seed=10 * s + ly)
            lv._custom_routing(torch.zeros(T, 8), z, 4, True, key=key)
            ref.record(ly, lynx_select(z, mask, SPEC, LynxConfig.parse("on"), ly))
    got, want = lv._STATE.summary(), ref.summary()
    assert got["decode_steps"] == 2 and got["steps"] == 4 and got["decode_layer_steps"] == 4
    for k in ("unique_before", "unique_after", "reduction_pct", "remap_rate_pct"):
        assert got[k] == want[k], k
    assert got["unique_after"] < got["unique_before"]
    lv.reset_stats()
    assert lv.collect_stats()["decode_layer_steps"] == 0


def test_no_metadata_means_exact_and_no_telemetry(fake_vllm):
    key = lv._STATE.add(_route("lynx"))
    z = _logits(8, seed=5)
    for ctx in (None, SimpleNamespace(attn_metadata=None)):
        fake_vllm.ctx = ctx
        w, ids = lv._custom_routing(None, z, 4, True, key=key)
        ids0, w0 = exact_route(z, SPEC)
        assert torch.equal(ids, ids0.int()) and torch.equal(w, w0)
    assert lv._STATE.summary()["steps"] == 0


def test_register_and_attach_are_inert_without_the_setting():
    finders = list(sys.meta_path)
    assert lv.register() is None  # vLLM is not installed here: nothing happens
    assert sys.meta_path == finders
    model = torch.nn.Linear(2, 2)
    for extra in (None, {}, {"other": 1}):
        assert lv.attach(model, SimpleNamespace(additional_config=extra)) == 0
    assert "vllm.model_executor" not in " ".join(sys.modules)


@pytest.mark.parametrize("extra,msg", [
    ({"lynx": "onn"}, "additional_config['lynx']: bad LYNX mode 'onn'"),
    ({"lynx": 1}, "additional_config['lynx'] must be a string"),
    ({"lynx": "lynx,j=x"}, "additional_config['lynx']: bad value for LYNX knob j"),
    ({"lynx_test_force_experts": [1, 1, 2, 3]}, "additional_config['lynx_test_force_experts'] must be"),
])
def test_bad_setting_is_one_clear_line(extra, msg, caplog):
    with pytest.raises(ValueError) as e:
        lv.parse_setting(extra)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)
    assert lv.attach(torch.nn.Linear(2, 2), SimpleNamespace(additional_config=extra)) == 0
    assert msg in caplog.text and "Traceback" not in caplog.text


def test_setting_parses_any_lynx_config_string():
    cfg, force = lv.parse_setting({"lynx": "on"})
    assert (cfg.mode, cfg.j, force) == ("lynx-mass:0.2", 0, None)
    cfg, force = lv.parse_setting({"lynx_test_force_experts": [0, 5, 9, 1]})
    assert cfg.kind == "off" and force == (0, 5, 9, 1)


# ---- -m vllm: end to end in vLLM's CPU build, one subprocess per case ------------------------

DEMO = ROOT / "lynx_edge" / "demo"
FORCED = [3, 7, 11, 20]


def _vllm_python():
    py = os.environ.get("LYNX_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(py).exists():
        return None
    probe = "import importlib.util as u, sys; sys.exit(not (u.find_spec('vllm') and u.find_spec('lynx_edge')))"
    return py if subprocess.run([py, "-c", probe], timeout=120).returncode == 0 else None


def _run_case(case: str, timeout: int = 900) -> dict:
    py = _vllm_python()
    if py is None:
        pytest.skip("vLLM is not importable (set LYNX_VLLM_PYTHON or build .venv-vllm, see .ci/run)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([py, __file__, case], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-4000:] + r.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def _prompts(n: int, length: int = 24) -> list[list[int]]:
    """n windows of the demo model's held-out text, as token ids."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(DEMO / "tokenizer.json")).encode((DEMO / "heldout.txt").read_text()).ids
    return [ids[i * 97: i * 97 + length] for i in range(n)]


def _llm(extra=None, eager=True, multiproc=False):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiproc else "0"
    from vllm import LLM

    kw = dict(model=str(DEMO), dtype="float32", enforce_eager=eager, max_model_len=256,
              max_num_seqs=16, seed=0)
    if not multiproc:
        kw["distributed_executor_backend"] = "uni"
    else:  # callables are not shipped to other processes: stats through a worker extension
        kw["worker_extension_cls"] = "lynx_edge.integrations.vllm.LynxWorkerExtension"
    return LLM(**kw, **({"additional_config": extra} if extra else {}))


def _generate(llm, prompts, n):
    """Greedy: → (token ids, their logprobs) per prompt."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return toks, lps


def _stats(llm) -> dict:
    return llm.collective_rpc(lv.collect_stats)[0]


def case_exact() -> dict:
    import gc

    prompts = _prompts(4)
    llm = _llm()
    base = _generate(llm, prompts, 16)
    del llm
    gc.collect()
    llm = _llm({"lynx": "off"})
    got = _generate(llm, prompts, 16)
    return {"tokens_equal": got[0] == base[0], "logprobs_equal": got[1] == base[1], "stats": _stats(llm)}


def _hf_logprobs(seqs, n, force):
    """transformers' greedy check: log-probs of each sequence's last n tokens, teacher-forced,
    with every MoE gate forced to `force` (weights = renormalised softmax probs) if given."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()

    def forced(gate, hidden):
        h = hidden.reshape(-1, gate.hidden_dim)
        logits = F.linear(h, gate.weight)
        ids = torch.tensor(force).expand(h.shape[0], -1)
        w = torch.softmax(logits, -1, dtype=torch.float32).gather(1, ids)
        return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), ids

    if force:
        for layer in model.model.layers:
            gate = layer.mlp.gate
            gate.forward = types.MethodType(forced, gate)
    out = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1)
            pos = range(len(s) - n - 1, len(s) - 1)
            out.append(([int(lp[p].argmax()) for p in pos], [float(lp[p, s[p + 1]]) for p in pos]))
    return out


def case_forced() -> dict:
    prompts, n = _prompts(2), 8
    llm = _llm({"lynx_test_force_experts": FORCED})
    toks, lps = _generate(llm, prompts, n)
    seqs = [p + t for p, t in zip(prompts, toks)]
    ref = _hf_logprobs(seqs, n, FORCED)
    plain = _hf_logprobs(seqs, n, None)
    return {"greedy_equal": [r[0] for r in ref] == toks,
            "max_logprob_diff": max(abs(a - b) for r, lp in zip(ref, lps) for a, b in zip(r[1], lp)),
            "plain_hf_agrees": [r[0] for r in plain] == toks, "stats": _stats(llm)}


def case_lynx16() -> dict:
    llm = _llm({"lynx": "on"})
    _generate(llm, _prompts(16), 24)
    return {"stats": _stats(llm)}


def case_multiproc() -> dict:
    llm = _llm({"lynx": "on"}, multiproc=True)
    _generate(llm, _prompts(4), 8)
    stats = llm.collective_rpc("lynx_stats")[0]
    return {"stats": stats, "frontend_pid": os.getpid(), "frontend_layers": len(lv._STATE.layers)}


def case_compiled() -> dict:
    llm = _llm({"lynx": "on"}, eager=False)
    _generate(llm, _prompts(4), 12)
    return {"stats": _stats(llm)}


@pytest.mark.vllm
def test_vllm_exact_mode_is_bit_identical():
    r = _run_case("exact")
    assert r["tokens_equal"] and r["logprobs_equal"]
    assert r["stats"]["layers"] == [0, 1, 2, 3] and r["stats"]["decode_steps"] == 15  # hook ran


@pytest.mark.vllm
def test_vllm_forced_experts_equal_transformers():
    r = _run_case("forced")
    assert r["greedy_equal"] and r["max_logprob_diff"] < 2e-5, r
    assert not r["plain_hf_agrees"]  # forcing changed the output: the hook acts


@pytest.mark.vllm
def test_vllm_lynx_on_demo_batch16():
    s = _run_case("lynx16")["stats"]
    assert 20.0 <= s["reduction_pct"] <= 35.0, s
    assert s["decode_steps"] == 23 and s["decode_layer_steps"] == 4 * 23
    assert s["unique_after"] < s["unique_before"] <= 32


@pytest.mark.vllm
def test_vllm_default_multiprocess_attaches_in_the_worker():
    r = _run_case("multiproc")
    assert r["stats"]["pid"] != r["frontend_pid"] and r["frontend_layers"] == 0
    assert r["stats"]["layers"] == [0, 1, 2, 3] and r["stats"]["decode_steps"] == 7


@pytest.mark.vllm
def test_vllm_without_enforce_eager():
    s = _run_case("compiled")["stats"]
    assert s["decode_steps"] == 11 and s["decode_layer_steps"] == 4 * 11  # the op ran every step
    assert s["unique_after"] < s["unique_before"]


if __name__ == "__main__":
    print("RESULT " + json.dumps(globals()["case_" + sys.argv[1]]()), flush=True)
