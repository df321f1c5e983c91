"""lynx-edge serve: the continuous-batching core and the OpenAI-compatible server.

References: `Engine.generate` of a separate engine on the same checkpoint, one prompt alone (batch
invariance under continuous batching, chunked prefill, queueing, staggered arrivals); the
official `openai` client and raw HTTP for the wire format. The core on a tiny random checkpoint;
the real server (uvicorn on an ephemeral port) on the demo model. Loopback only, every loop bounded.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from lynx_edge import Engine  # noqa: E402
from lynx_edge.core import EngineCore, QueueFull  # noqa: E402

KEY = "sk-test"
PROMPTS = ["def", "import os\nimport", "The quick brown fox jumps over", "class Point:\n    def __init__(self",
           "for i in range(10):\n    print(i, 'h", "x", "The lazy dog. Mixture of experts routes each token to k",
           "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"]


@pytest.fixture(scope="module")
def model_path(tiny_models):
    return tiny_models["qwen3_moe"]


@pytest.fixture(scope="module")
def ref(model_path):
    return Engine.from_pretrained(model_path, device="cpu")


def _drive(core: EngineCore, arrivals: dict[int, list], max_steps: int = 2000) -> dict[str, str]:
    """Step the core; at step s add the requests arrivals[s] = [(rid, ids, sp, lynx)]. → rid → text."""
    texts: dict[str, str] = {}
    for step in range(max_steps):
        for rid, ids, sp, lynx in arrivals.get(step, []):
            core.add_request(ids, sp, rid, lynx=lynx)
            texts[rid] = ""
        if step > max(arrivals) and not core.has_work():
            return texts
        for o in core.step():
            texts[o.request_id] += o.text
    raise AssertionError("core did not finish")


@pytest.mark.parametrize("mixed", [False, True])
def test_core_staggered_chunked_equals_generate_alone(model_path, ref, mixed):
    eng = Engine.from_pretrained(model_path, device="cpu")
    core = EngineCore(eng, max_num_seqs=3, prefill_budget=5, max_waiting=16, mixed_steps=mixed)  # queueing, chunks
    greedy = dict(max_new_tokens=10, ignore_eos=True)
    sampled = dict(max_new_tokens=10, ignore_eos=True, do_sample=True, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    arrivals: dict[int, list] = {}
    want = {}
    for i, p in enumerate(PROMPTS):
        kw = sampled if i % 3 == 2 else greedy
        arrivals.setdefault(2 * i, []).append((f"r{i}", eng.encode_prompt(p), eng.sampling_params(**kw), True))
        want[f"r{i}"] = ref.generate(p, **kw)
    assert _drive(core, arrivals) == want
    assert core.free_rows == 3 and not core.running and not core.waiting


def test_core_stops_penalty_and_abort(model_path, ref):
    eng = Engine.from_pretrained(model_path, device="cpu")
    core = EngineCore(eng, max_num_seqs=2, prefill_budget=64)
    kw = dict(max_new_tokens=12, repetition_penalty=1.3, stop_strings=["e"])
    want = ref.generate(PROMPTS[2], **kw)
    arrivals = {0: [("a", eng.encode_prompt(PROMPTS[2]), eng.sampling_params(**kw), True),
                    ("b", eng.encode_prompt(PROMPTS[1]), eng.sampling_params(max_new_tokens=400, ignore_eos=True), True)]}
    texts = {}
    reasons = {}
    for rid, ids, sp, lynx in arrivals[0]:
        core.add_request(ids, sp, rid)
        texts[rid] = ""
    for step in range(100):
        if step == 5:
            core.abort("b")
        for o in core.step():
            texts[o.request_id] += o.text
            reasons[o.request_id] = o.finish_reason
        if not core.has_work():
            break
    assert texts["a"] == want and reasons["b"] == "abort" and core.free_rows == 2


def test_core_long_prompt_does_not_stall_decode(model_path):
    """A 300-token prompt is prefilled 16 tokens per step while a running request gets one token
    every step (no step without it), and the long request's prefill spans many steps."""
    eng = Engine.from_pretrained(model_path, device="cpu")
    core = EngineCore(eng, max_num_seqs=2, prefill_budget=16)
    core.add_request(eng.encode_prompt("def"), eng.sampling_params(max_new_tokens=100, ignore_eos=True), "a")
    core.step()  # a: prefilled, first token out
    long_ids = (eng.encode_prompt(PROMPTS[-1]) * 20)[:300]
    core.add_request(long_ids, eng.sampling_params(max_new_tokens=2, ignore_eos=True), "b")
    steps = 0
    while True:
        outs = {o.request_id: o for o in core.step()}
        steps += 1
        assert len(outs["a"].token_ids) == 1 and core.last_step["prefill_tokens"] <= 16
        if "b" in outs:
            break
        assert steps < 100
    assert steps == -(-300 // 16)


def test_core_queue_bound_and_context(model_path):
    eng = Engine.from_pretrained(model_path, device="cpu")
    core = EngineCore(eng, max_num_seqs=1, max_waiting=1)
    sp = eng.sampling_params(max_new_tokens=2)
    core.add_request([5, 6], sp)
    core.add_request([5, 6], sp)  # one row + one waiting slot
    with pytest.raises(QueueFull):
        core.add_request([5, 6], sp)
    with pytest.raises(ValueError, match="context"):
        core.add_request([5] * core.ctx, sp)
    from lynx_edge.kv_cache import KVCache

    assert core.kv_bytes == KVCache.bytes_needed(eng.cfg, 1, core.ctx, eng.model.dtype)
    with pytest.raises(ValueError, match="KV cache for 10000000 sequences"):  # ~TiB: never allocated
        EngineCore(Engine.from_pretrained(model_path, device="cpu"), max_num_seqs=10_000_000)


def test_core_lynx_opt_out_is_exact(model_path, ref, mixed=False):
    """LYNX on for the engine: with every request opted in some texts change (LYNX remaps);
    those requests, opted out, decode beside LYNX rows with exact routing: = exact generate alone."""
    eng = Engine.from_pretrained(model_path, device="cpu", lynx="budget:3")  # strict: texts change
    kw = dict(max_new_tokens=10, ignore_eos=True)
    want = {f"r{i}": ref.generate(p, **kw) for i, p in enumerate(PROMPTS)}

    def run(opt_out):
        core = EngineCore(eng, max_num_seqs=8, prefill_budget=4, mixed_steps=mixed)
        return _drive(core, {i: [(f"r{i}", eng.encode_prompt(p), eng.sampling_params(**kw), f"r{i}" not in opt_out)]
                             for i, p in enumerate(PROMPTS)})

    changed = {rid for rid, t in run(set()).items() if t != want[rid]}
    assert changed and len(changed) < len(PROMPTS)  # LYNX is active, and some rows stay opted in
    texts = run(changed)
    assert {rid: texts[rid] for rid in changed} == {rid: want[rid] for rid in changed}


def test_core_mixed_steps_prefill_stays_exact_under_lynx(model_path, ref):
    """Mixed steps with LYNX on (strict budget:3): prompt chunks share the forward with remapped
    decode tokens. Reference: exact_route on the same router logits — the chunk tokens (the last P
    of each mixed forward) get exactly its experts, while some decode tokens are remapped; and
    every request's first token (from its prefill) equals exact generate's. The core's LYNX
    telemetry of mixed forwards (lynx_summary()["mixed"]) = the same sums taken from the spy."""
    from lynx_edge.routing import exact_route

    eng = Engine.from_pretrained(model_path, device="cpu", lynx="budget:3")
    route, calls = eng.model.routing.route, []

    def spy(logits, is_decode, layer):
        ids, w = route(logits, is_decode, layer)
        calls.append((logits, ids))
        return ids, w

    eng.model.routing.route = spy
    spy.begin_step = route.begin_step  # the phase hook the RoutingContext calls
    spec = eng.model.routing.spec
    core = EngineCore(eng, max_num_seqs=8, prefill_budget=4, mixed_steps=True)
    sp = eng.sampling_params(max_new_tokens=6, ignore_eos=True)
    first, mixed, remapped = {}, 0, 0
    exp = dict.fromkeys(("n", "tokens", "dec", "slots", "moved", "before", "after"), 0)
    pending = {3 * i: (f"r{i}", eng.encode_prompt(p)) for i, p in enumerate(PROMPTS)}
    for step in range(500):
        if step in pending:
            core.add_request(pending[step][1], sp, pending[step][0])
        calls.clear()
        for o in core.step():
            first.setdefault(o.request_id, o.token_ids[:1])
        B, P = core.last_step["decode_tokens"], core.last_step["prefill_tokens"]
        if B and P:
            mixed += 1
            for logits, ids in calls:
                assert logits.shape[0] == B + P
                exact = exact_route(logits, spec)[0]
                assert ids[B:].sort(-1).values.equal(exact[B:].sort(-1).values)
                remapped += int(not ids[:B].sort(-1).values.equal(exact[:B].sort(-1).values))
                exp["n"], exp["tokens"], exp["dec"] = exp["n"] + 1, exp["tokens"] + B + P, exp["dec"] + B
                exp["before"] += exact.unique().numel()
                exp["after"] += ids.unique().numel()
                exp["slots"] += B * spec.top_k
                exp["moved"] += sum(len(set(e) - set(c)) for e, c in zip(exact[:B].tolist(), ids[:B].tolist()))
        if step > max(pending) and not core.has_work():
            break
    want = {f"r{i}": [next(iter(ref.stream(p, max_new_tokens=1, ignore_eos=True))).token_ids[0]]
            for i, p in enumerate(PROMPTS)}
    assert mixed > 5 and remapped > 0 and first == want
    assert core.free_rows == 8
    got, n = core.lynx_summary()["mixed"], exp["n"]
    assert got["layer_steps"] == n and core.totals["mixed_steps"] == mixed
    assert got["tokens"] == pytest.approx(exp["tokens"] / n) and got["decode_tokens"] == pytest.approx(exp["dec"] / n)
    assert got["unique_before"] == pytest.approx(exp["before"] / n)
    assert got["unique_after"] == pytest.approx(exp["after"] / n) and exp["after"] < exp["before"]
    assert got["remap_rate_pct"] == pytest.approx(100 * exp["moved"] / exp["slots"]) and exp["moved"] > 0


@pytest.mark.parametrize("opts", [dict(int4=True, int4_group=32), dict(offload=True, expert_slots=4, profile="cpu-only")])
def test_core_int4_and_offload_equal_generate_alone(tmp_path, opts):
    """The core over an INT4 or an offloaded engine (2 rows, chunked prefill) = that engine's generate alone."""
    from conftest import make_tiny

    path = make_tiny(tmp_path / "m", "qwen3_moe", moe_intermediate_size=32)
    eng, ref = (Engine.from_pretrained(path, device="cpu", **opts) for _ in range(2))
    core = EngineCore(eng, max_num_seqs=2, prefill_budget=5)
    kw = dict(max_new_tokens=8, ignore_eos=True)
    texts = _drive(core, {0: [(f"r{i}", eng.encode_prompt(p), eng.sampling_params(**kw), True)
                              for i, p in enumerate(PROMPTS[:4])]})
    assert texts == {f"r{i}": ref.generate(p, **kw) for i, p in enumerate(PROMPTS[:4])}
    assert core.free_rows == 2


def test_metrics_report_lynx_and_unique_experts(model_path):
    """A LYNX server with mixed steps (routing recorded, as the CLI does): an 8-prompt batch opted
    in, then one opted out. /metrics has the distinct-experts histogram, the LYNX remap gauges of
    pure decode and of mixed forwards, and tokens per phase = the usage counts (12 tokens a prompt:
    the first from prefill, 11 from decode forwards); /health reports lynx on."""
    from fastapi.testclient import TestClient

    from lynx_edge.server import create_app

    eng = Engine.from_pretrained(model_path, device="cpu", lynx="budget:3", record_routing=True)
    prompt_tokens = 0
    with TestClient(create_app(eng, model_name="t", max_num_seqs=8, prefill_budget=4, mixed_steps=True)) as client:
        for lynx in (True, False):
            r = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 12, "ignore_eos": True,
                                                     "lynx": lynx})
            assert r.status_code == 200 and len(r.json()["choices"]) == 8
            assert r.json()["usage"]["completion_tokens"] == 96
            prompt_tokens += r.json()["usage"]["prompt_tokens"]
        m = client.get("/metrics").text
        assert client.get("/health").json()["lynx"] is True

    def value(name):
        return float(next(line.split()[-1] for line in m.splitlines() if line.startswith(name + " ")))

    assert value("lynx_unique_experts_per_layer_count") >= 5 and value('lynx_lynx{stat="remap_rate_pct"}') >= 0
    assert value('lynx_step_tokens_total{phase="prefill"}') == prompt_tokens
    assert value('lynx_step_tokens_total{phase="decode"}') == value('lynx_step_tokens_total{phase="decode_opted_out"}') == 88
    assert value("lynx_mixed_steps_total") > 0 and value('lynx_lynx_mixed{stat="layer_steps"}') > 0
    assert value('lynx_lynx_mixed{stat="remap_rate_pct"}') > 0


def test_server_defaults_and_template_kwargs(model_path, ref):
    """Server-wide defaults (serve's --temp/--top-k/-n flags) fill the fields a request leaves out,
    never those it sends; --chat-template-kwargs sit under the request's own. Reference:
    Engine.generate with the merged parameters; the kwargs the chat template gets (a spy)."""
    from fastapi.testclient import TestClient

    from lynx_edge.server import create_app

    eng = Engine.from_pretrained(model_path, device="cpu")
    encode, seen = eng.encode_prompt, []

    def spy(prompt, kwargs=None):
        seen.append(kwargs)
        return encode(prompt, kwargs)

    eng.encode_prompt = spy
    app = create_app(eng, model_name="t", max_num_seqs=2, template_kwargs={"flavour": "a", "depth": 1},
                     defaults={"do_sample": True, "temperature": 0.8, "top_k": 20, "max_new_tokens": 5})
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": PROMPTS[2], "seed": 3, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 5
        assert r["choices"][0]["text"] == ref.generate(PROMPTS[2], max_new_tokens=5, do_sample=True, temperature=0.8,
                                                       top_k=20, seed=3, ignore_eos=True)
        r = client.post("/v1/completions", json={"prompt": PROMPTS[3], "temperature": 0, "max_tokens": 3,
                                                 "ignore_eos": True}).json()
        assert r["choices"][0]["text"] == ref.generate(PROMPTS[3], max_new_tokens=3, ignore_eos=True)
        msgs = [{"role": "user", "content": "hi"}]
        assert client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1,
                                                         "chat_template_kwargs": {"flavour": "b"}}).status_code == 200
    assert seen[-1] == {"flavour": "b", "depth": 1}
    with pytest.raises(ValueError):
        create_app(eng, defaults={"top_p": 0.0})  # a bad default fails at start


def test_metrics_offload_counters(tmp_path):
    """An offloaded server (4 device expert slots of 16): /metrics carries the runtime's own
    counters (cache hits/misses, hit rate, host→device bytes) as the runtime reports them."""
    from conftest import make_tiny
    from fastapi.testclient import TestClient

    from lynx_edge.server import create_app

    path = make_tiny(tmp_path / "m", "qwen3_moe", moe_intermediate_size=32)
    eng = Engine.from_pretrained(path, device="cpu", offload=True, expert_slots=4, profile="cpu-only")
    with TestClient(create_app(eng, model_name="t", max_num_seqs=2)) as client:
        r = client.post("/v1/completions", json={"prompt": PROMPTS[:2], "max_tokens": 6, "ignore_eos": True})
        assert r.status_code == 200
        m = client.get("/metrics").text
    got = {line.split('"')[1]: float(line.split()[-1]) for line in m.splitlines() if line.startswith("lynx_offload{")}
    want = eng.model.offload.stats()
    assert want["misses"] > 0 and want["bytes_h2d"] > 0
    for k in ("hits", "misses", "hit_rate", "bytes_h2d", "decode_bytes_h2d"):
        assert got[k] == pytest.approx(want[k]), k


# the real server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_path():
    from lynx_edge.hub import resolve_model

    return resolve_model("demo")


@pytest.fixture(scope="module")
def demo_ref(demo_path):
    return Engine.from_pretrained(demo_path, device="cpu", ctx_size=512)


@pytest.fixture(scope="module")
def server(demo_path):
    import uvicorn

    from lynx_edge.server import create_app

    eng = Engine.from_pretrained(demo_path, device="cpu", ctx_size=512)
    app = create_app(eng, model_name="demo", api_key=KEY, max_num_seqs=8, prefill_budget=16, max_waiting=64)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio: TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started
    yield app, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(timeout=20)
    assert not th.is_alive()
    assert not app.state.worker.thread.is_alive()  # graceful shutdown ended the core thread


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def test_openai_chat_and_completion(server, demo_ref):
    app, url = server
    client = _client(url)
    msgs = [{"role": "user", "content": "Write a for loop"}]
    r = client.chat.completions.create(model="demo", messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == demo_ref.generate(msgs, max_new_tokens=8, ignore_eos=True)
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == len(demo_ref.encode_prompt(msgs))
    assert r.choices[0].finish_reason == "length"
    c = client.completions.create(model="demo", prompt=PROMPTS[3], max_tokens=6, seed=3, temperature=0.8,
                                  top_p=0.9, extra_body={"top_k": 40, "repetition_penalty": 1.1, "ignore_eos": True})
    assert c.choices[0].text == demo_ref.generate(PROMPTS[3], max_new_tokens=6, do_sample=True, temperature=0.8,
                                             top_p=0.9, top_k=40, repetition_penalty=1.1, seed=3, ignore_eos=True)
    assert [m.id for m in client.models.list().data] == ["demo"]
    s = client.completions.create(model="demo", prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=["e", "o"])
    assert s.choices[0].text == demo_ref.generate(PROMPTS[2], max_new_tokens=12, stop_strings=["e", "o"])


def test_openai_streaming_with_usage(server, demo_ref):
    app, url = server
    client = _client(url)
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=7,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    text, usage, reasons = "", None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            reasons.append(ch.finish_reason)
    assert text == demo_ref.generate([{"role": "user", "content": "hi"}], max_new_tokens=7, ignore_eos=True)
    assert usage.completion_tokens == 7 and reasons[-1] == "length"


def varied_prompts(n: int) -> list[str]:
    """n prompts of n different lengths (3 .. ~250 characters), cut from PROMPTS at shifting offsets."""
    src = "\n".join(PROMPTS) * 3
    return [src[(13 * i) % 200:][: 3 + 8 * i] for i in range(n)]


def test_concurrent_staggered_requests_equal_generate_alone(server, demo_ref):
    """The issue's batch invariance: 32 concurrent requests of 32 prompt lengths, arriving staggered
    (8 rows: queueing and chunked prefill too), streamed and not, half of them sampled with their
    own seeds (decoding side by side); each text = Engine.generate of that prompt alone."""
    app, url = server
    client = _client(url)
    prompts = varied_prompts(32)
    greedy = dict(temperature=0)
    sampled = lambda i: dict(temperature=0.9, top_p=0.9, seed=100 + i)  # noqa: E731
    got: dict[int, str] = {}

    def one(i):
        time.sleep(0.01 * i)
        kw = dict(model="demo", prompt=prompts[i], max_tokens=10, extra_body={"ignore_eos": True},
                  **(sampled(i) if i % 4 >= 2 else greedy))
        if i % 2:
            s = client.completions.create(stream=True, **kw)
            got[i] = "".join(c.choices[0].text for c in s if c.choices)
        else:
            got[i] = client.completions.create(**kw).choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    want = {i: demo_ref.generate(p, max_new_tokens=10, ignore_eos=True,
                            **(dict(do_sample=True, temperature=0.9, top_p=0.9, seed=100 + i) if i % 4 >= 2 else {}))
            for i, p in enumerate(prompts)}
    assert got == want


def _wait_free(app, timeout=15.0):
    core = app.state.core
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if core.free_rows == core.max_num_seqs and not core.waiting and not core.has_work():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_frees_row(server):
    app, url = server
    assert _wait_free(app)
    body = {"model": "demo", "prompt": "def", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 3:
                        break  # leave mid-stream
    assert app.state.core.running or app.state.core.free_rows == app.state.core.max_num_seqs
    assert _wait_free(app), app.state.core.counts()
    m = httpx.get(url + "/metrics").text
    assert 'lynx_requests_total{finish_reason="abort"}' in m


def _post(url, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(url + path, content=raw if raw is not None else json.dumps(body), headers=headers, timeout=30)


@pytest.mark.parametrize("body,raw,key,status,param", [
    (None, b"{not json", KEY, 400, None),
    ({"model": "nope", "prompt": "x"}, None, KEY, 404, "model"),
    ({"model": "demo", "prompt": "x", "max_tokens": -1}, None, KEY, 400, "max_tokens"),
    ({"model": "demo", "prompt": "x", "temperature": -0.5}, None, KEY, 400, "temperature"),
    ({"model": "demo", "prompt": "x", "top_p": 0}, None, KEY, 400, "top_p"),
    ({"model": "demo", "prompt": 5}, None, KEY, 400, "prompt"),
    ({"model": "demo", "prompt": [5] * 600}, None, KEY, 413, "prompt"),
    ({"model": "demo", "prompt": [10**6]}, None, KEY, 400, "prompt"),
    ({"model": "demo", "prompt": "x"}, None, "wrong", 401, None),
    (None, b'{"prompt": "' + b"x" * (17 << 20) + b'"}', KEY, 413, None),
])
def test_bad_requests_get_openai_errors(server, body, raw, key, status, param):
    app, url = server
    r = _post(url, "/v1/completions", body, key=key, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param
    assert httpx.get(url + "/health").status_code == 200  # still serving


def test_chat_bad_messages_and_unknown_route(server):
    app, url = server
    assert _post(url, "/v1/chat/completions", {"model": "demo", "messages": []}).status_code == 400
    r = httpx.get(url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json()


def test_queue_full_is_429_with_retry_after(server, monkeypatch):
    app, url = server

    def full(*a, **k):
        raise QueueFull("the waiting queue is full (32 requests)")

    monkeypatch.setattr(app.state.core, "add_request", full)
    r = _post(url, "/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"


def test_health_models_metrics(server):
    app, url = server
    h = httpx.get(url + "/health").json()
    assert h["status"] == "ok" and h["max_num_seqs"] == 8
    assert httpx.get(url + "/v1/models").status_code == 401  # the API key guards /v1
    m = httpx.get(url + "/metrics").text
    for name in ("lynx_requests_total", "lynx_generation_tokens_total", "lynx_queue_waiting", "lynx_ttft_seconds_bucket",
                 "lynx_tpot_seconds_bucket", "lynx_free_rows"):
        assert name in m, name


def test_cli_serve_subprocess_sigterm_exits_0(model_path):
    """`lynx-edge serve` in its own process: answers, then SIGTERM shuts it down gracefully (exit 0)."""
    import os
    import signal
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {**os.environ, "LYNX_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "lynx_edge", "serve", str(model_path), "--port", str(port),
                             "--max-num-seqs", "2", "--ctx-size", "128", "--device", "cpu", "-n", "3", "--temp", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        r = _post(url, "/v1/completions", {"prompt": "def", "ignore_eos": True})  # -n 3, --temp 0: the defaults
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["max_model_len"] == 128
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_async_client_n_and_seeded_sampling(server, demo_ref):
    """AsyncOpenAI, n=2 (seeds s, s+1) and streaming chat, concurrently: each = Engine.generate alone."""
    import asyncio

    app, url = server
    kw = dict(max_new_tokens=8, do_sample=True, temperature=1.0, top_p=0.95, ignore_eos=True)

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, timeout=60, max_retries=0)
        nreq = client.completions.create(model="demo", prompt=PROMPTS[2], max_tokens=8, n=2, seed=11,
                                         temperature=1.0, top_p=0.95, extra_body={"ignore_eos": True})

        async def chat():
            s = await client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "yo"}],
                                                     max_tokens=8, seed=5, temperature=1.0, top_p=0.95, stream=True,
                                                     extra_body={"ignore_eos": True})
            return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

        return await asyncio.gather(nreq, chat())

    r, text = asyncio.run(main())
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [
        demo_ref.generate(PROMPTS[2], seed=11, **kw), demo_ref.generate(PROMPTS[2], seed=12, **kw)]
    assert r.usage.completion_tokens == 16
    assert text == demo_ref.generate([{"role": "user", "content": "yo"}], seed=5, **kw)


def test_load_with_faults_leaks_nothing(server, demo_ref):
    """The issue's load: 64 concurrent streaming clients (bounded) on 8 rows: 54 good streams,
    6 that disconnect mid-stream, 3 bad requests and one over-long prompt. Every good request
    completes correctly; rows, queue and streams return to their start; /health answers."""
    import asyncio

    app, url = server
    assert _wait_free(app)
    headers = {"Authorization": f"Bearer {KEY}"}
    prompts = varied_prompts(16)
    good = {i: prompts[i % len(prompts)] for i in range(54)}

    async def stream(h, prompt, leave_after=None):
        body = {"model": "demo", "prompt": prompt, "max_tokens": 8 if leave_after is None else 300,
                "temperature": 0, "stream": True, "ignore_eos": True}
        text, events = "", 0
        async with h.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                text += json.loads(line[6:])["choices"][0]["text"]
                if leave_after is not None and events >= leave_after:
                    return None
        return text

    async def bad(h, raw, status, key=KEY):
        r = await h.post(url + "/v1/completions", content=raw,
                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        assert r.status_code == status and "error" in r.json()

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as h:
            jobs = [stream(h, p) for p in good.values()]
            jobs += [stream(h, PROMPTS[i], leave_after=1 + i) for i in range(6)]
            jobs += [bad(h, b"{oops", 400), bad(h, b'{"prompt": "x", "max_tokens": -3}', 400),
                     bad(h, b'{"prompt": "x"}', 401, key="wrong"),
                     bad(h, json.dumps({"prompt": [7] * 700}).encode(), 413)]
            assert len(jobs) == 64
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=120)

    results = asyncio.run(main())
    want = {p: demo_ref.generate(p, max_new_tokens=8, ignore_eos=True) for p in set(good.values())}
    assert results[:54] == [want[p] for p in good.values()]
    assert _wait_free(app), app.state.core.counts()
    assert app.state.worker.in_flight() == 0
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_offload_plan_counts_kv_for_max_num_seqs(tmp_path, monkeypatch):
    """Serving B rows: the load's memory plan and offload plan hold the KV cache of B rows (not 1),
    so under one device budget the expert slots shrink by what the extra rows take. Reference:
    KVCache.bytes_needed and offload_slots on the plan's own numbers."""
    from conftest import make_tiny

    from lynx_edge.kv_cache import KVCache
    from lynx_edge.offload import memory

    plan_memory, checked = memory.plan_memory, []

    def spy(*a, **k):
        checked.append(k["batch"])
        return plan_memory(*a, **k)

    monkeypatch.setattr(memory, "plan_memory", spy)
    offload_slots = memory.offload_slots
    path = make_tiny(tmp_path / "m", "qwen3_moe", moe_intermediate_size=32)
    plans = {}
    for b in (1, 16):
        eng = Engine.from_pretrained(path, device="cpu", offload=True, profile="cpu-only", ctx_size=256,
                                     gpu_budget_gib=0.0025, max_num_seqs=b)
        plans[b] = p = eng.model.offload.plan
        assert p.batch == b and p.kv_bytes == KVCache.bytes_needed(eng.cfg, b, 256, eng.model.dtype)
        fixed = p.non_expert_bytes + p.kv_bytes + p.reserve_bytes
        assert p.expert_slots == offload_slots(p.budget_bytes, fixed, p.scratch_slots, p.expert_bytes,
                                               p.num_moe_layers * p.num_experts)
    assert plans[16].expert_slots < plans[1].expert_slots and checked == [1, 16]


def test_cli_bench_serve_json(model_path):
    """`lynx-edge bench --serve -o json`: per LYNX mode and concurrency one row from real streaming
    clients (a process of their own) against the real server. References: every request's tokens
    (ignore_eos: clients × 2 requests × -n) and the server's own counters (decode batch ≤ c,
    experts per layer within [top-k, E])."""
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app

    r = CliRunner().invoke(app, ["bench", str(model_path), "--serve", "-b", "1,3", "-n", "4", "-p", "8", "-r", "1",
                                 "--lynx", "both", "-o", "json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout.strip().splitlines()[-1])
    rows = {(x["lynx"], x["concurrency"]): x for x in result["rows"]}
    assert set(rows) == {("off", 1), ("off", 3), ("on", 1), ("on", 3)}
    for (mode, c), x in rows.items():
        assert x["requests"] == 2 * c and x["output_tokens"] == 2 * c * 4
        assert 1 <= x["mean_decode_batch"] <= c and 2 <= x["unique_experts_per_layer"] <= 8
        assert x["throughput_tok_s"] > 0 and 0 < x["ttft_p50_ms"] <= x["ttft_p90_ms"] and x["rss_peak_mib"] > 0
    assert rows[("off", 1)]["mean_decode_batch"] == 1 and {c["concurrency"] for c in result["compare"]} == {1, 3}


def test_pad_checkpoint_same_outputs(tmp_path, model_path, ref):
    """The zero-padded checkpoint (the padded demo of the serving benchmark): wider experts on disk,
    the same routing and greedy text as the original (reference: the original engine), a clear
    error for a narrower size."""
    from safetensors import safe_open

    from lynx_edge.padded import pad_checkpoint

    out = pad_checkpoint(model_path, tmp_path / "padded", 96)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if ".mlp.experts.0." in k}
    assert shapes and all(96 in s for s in shapes.values())
    eng = Engine.from_pretrained(out, device="cpu", record_routing=True)
    assert eng.cfg.moe_intermediate_size == 96
    ref.model.routing.stats.record = True
    for p in PROMPTS[:3]:
        texts, steps = [], []
        for e in (ref, eng):
            e.model.routing.stats.clear()
            texts.append(e.generate(p, max_new_tokens=8, ignore_eos=True))
            steps.append([[ids.tolist() for ids in s.values()] for s in e.model.routing.stats.steps])
        assert texts[0] == texts[1] and steps[0] == steps[1]
    ref.model.routing.stats.record = False
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        pad_checkpoint(model_path, tmp_path / "narrow", 8)
