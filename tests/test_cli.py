"""The `lynx-edge` CLI on tiny models: typer's CliRunner for every command, `chat` through a real
pseudo-terminal. References: safetensors tensor sizes (parameter counts), Engine.generate (chat
answers), the bench stats' own identities (tok/s = B·1000/TPOT)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lynx_edge.cli.chat import ChatSession, read_message
from lynx_edge.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: str, **env):
    return runner.invoke(app, [str(a) for a in args], env=env or None)


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_library_warnings_print_as_one_line(tiny_models):
    """A warning raised under a command (here: float16 asked for on a CPU, where the native kernels have
    no fp16 rows) reaches the user as one `warning:` line, not Python's file:line and source echo."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "lynx_edge", "chat", str(tiny_models["mixtral"]), "-p", "hi", "--temp", "0",
                        "-n", "2", "--dtype", "float16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "float16 on a CPU" in x]
    assert lines == ["warning: float16 on a CPU decodes on torch's ops (the native kernels have no fp16 rows): "
                     "bfloat16 or float32 are ~10x faster"], r.stderr
    assert "RuntimeWarning" not in r.stderr and "warnings.warn" not in r.stderr


# info / modelinfo ------------------------------------------------------------------------------
def checkpoint_numel(model_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


def test_version_and_help():
    r = invoke("--version")
    assert r.exit_code == 0 and r.stdout.startswith("lynx-edge ")
    r = invoke("--help")
    assert r.exit_code == 0 and all(c in r.stdout for c in ("chat", "bench", "eval", "info", "quantize", "profile"))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_info_param_counts_match_the_checkpoint(tiny_models, family):
    r = invoke("info", tiny_models[family], "-o", "json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    p, c = data["params"], data["config"]
    assert c["family"] == family and c["experts"] == 8 and c["top_k"] == 2
    assert p["total"] == checkpoint_numel(tiny_models[family])
    assert p["total"] == p["expert"] + p["non_expert"]
    assert p["active"] == p["non_expert"] + p["expert"] * c["top_k"] // c["experts"]
    assert p["expert_bytes_per_expert"] == 4 * p["params_per_expert"]  # float32 checkpoint


def test_info_table_and_plan(tiny_models):
    r = invoke("info", tiny_models["qwen2_moe"])
    assert r.exit_code == 0, r.output
    assert "qwen2_moe" in r.stdout and "active per token" in r.stdout and "shared_expert_intermediate" in r.stdout
    assert "memory plan (dry run)" in r.stdout and "host RAM" in r.stdout
    r = invoke("info", tiny_models["mixtral"], "--profile", "laptop-rtx4060-8gb", "--int4", "--offload", "-o", "json")
    plan = json.loads(r.stdout)["memory"]  # the numbers are checked in test_info_plan.py
    assert plan["expert_format"] == "int4" and plan["machine"] == "profile laptop-rtx4060-8gb"
    assert plan["total_experts"] == 8 * 2 and plan["expert_slots"] == 16 and plan["fits"]
    r = invoke("info", tiny_models["mixtral"], "--profile", "no-such-profile")
    assert r.exit_code == 1 and r.stderr.startswith("error: unknown profile") and "lynx-edge profile" in r.stderr
    # the CPU flags chat / bench / serve take: the plan counts the non-expert weights as they hold them
    # (the bytes themselves: test_int4_attn.py's test_memory_plan_counts_the_flags_as_built)
    ne = {}
    for flags in ((), ("--int4-attn", "--int8-head")):
        r = invoke("info", tiny_models["qwen3_moe"], "--device", "cpu", *flags, "-o", "json")
        assert r.exit_code == 0, r.output
        plan = json.loads(r.stdout)["memory"]
        ne[flags] = plan["resources"][0]["parts"]["non-expert weights"]
        assert any("--int4-attn" in n for n in plan["notes"]) == bool(flags)
    assert ne[("--int4-attn", "--int8-head")] < ne[()]


# errors ----------------------------------------------------------------------------------------
def test_unknown_model_is_one_red_line(tmp_path):
    r = invoke("chat", tmp_path / "nope", "-p", "hi")
    assert r.exit_code != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "nope" in lines[0] and " — " in lines[0]
    r = invoke("info", tmp_path / "nope", LYNX_DEBUG="1")
    assert r.exit_code != 0 and "Traceback" in r.stderr and r.stderr.strip().splitlines()[-1].startswith("error:")


def test_bad_config_and_bad_options(tmp_path, tiny_models):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    r = invoke("info", tmp_path)
    assert r.exit_code == 1 and "unsupported model_type" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = invoke("bench", tiny_models["mixtral"], "-b", "1,x")
    assert r.exit_code == 2  # click's usage error


def test_quantize_writes_a_loadable_gptq_checkpoint(tmp_path):
    from conftest import make_tiny

    from lynx_edge import Engine
    from lynx_edge.quant.experts import Int4MoEExperts

    src = make_tiny(tmp_path / "src", "qwen3_moe", moe_intermediate_size=32)
    r = invoke("quantize", src, "-o", tmp_path / "q", "-g", "32", "--method", "rtn")
    assert r.exit_code == 0, r.output
    eng = Engine.from_pretrained(tmp_path / "q")
    assert isinstance(eng.model.layers[0].mlp.experts, Int4MoEExperts)


def test_offload_and_int4_flags_reach_the_engine(tiny_models):
    plain = invoke("chat", tiny_models["mixtral"], "-p", "hi", "--temp", "0", "-n", "6")
    off = invoke("chat", tiny_models["mixtral"], "-p", "hi", "--temp", "0", "-n", "6", "--offload")
    assert plain.exit_code == 0 and off.exit_code == 0, off.output
    assert plain.stdout.splitlines()[0] == off.stdout.splitlines()[0]  # offloading is exact


def test_scheduler_steps_default_is_the_engines():
    """The CLI's --num-scheduler-steps default (cli/options, kept torch-free) is EngineConfig's."""
    from lynx_edge.cli.options import SCHEDULER_STEPS
    from lynx_edge.engine import EngineConfig

    assert SCHEDULER_STEPS == EngineConfig().num_scheduler_steps == 64


def test_int4_bytes_note_counts_what_every_decode_token_reads():
    """--int4 alone on a CPU: the note counts the 16-bit weights each decode token reads (the
    demo's non-expert tensors, fp32 there, with the tied embedding as the head) and names the
    flags that shrink them; none once attention and head are packed too."""
    from lynx_edge import Engine
    from lynx_edge.cli.common import int4_bytes_note
    from lynx_edge.hub import resolve_model
    from lynx_edge.modelinfo import dense_decode_bytes
    from safetensors import safe_open

    demo = resolve_model("demo")
    non_expert = 0
    for f in demo.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            non_expert += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys() if ".experts." not in k)
    int4 = Engine.from_pretrained("demo", device="cpu", dtype="float32", int4=True)
    assert 0 <= dense_decode_bytes(int4.model) - 4 * non_expert <= 256  # + the rope buffer (128 B)
    line = int4_bytes_note(int4)
    # 4 layers x top-4 x 3 x 256 x 128 weights at half a byte = 0.786 MB; 7.48 MB fp32 besides: 90%
    assert "experts 4-bit: 0.786 MB" in line and "7.48 MB (90%" in line and "--int4-attn --int8-head" in line
    assert "--int4-act q8" in line  # int16 activations (the default): the int8 option is named too
    head = Engine.from_pretrained("demo", device="cpu", dtype="float32", int4=True, int8_head=True, int4_act="q8")
    assert "attention still float32" in int4_bytes_note(head) and "--int8-head" not in int4_bytes_note(head)
    assert "--int4-act" not in int4_bytes_note(head)
    packed = Engine.from_pretrained("demo", device="cpu", int4=True, int4_attn=True, int8_head=True)
    assert int4_bytes_note(packed) is None and int4_bytes_note(Engine.from_pretrained("demo", device="cpu")) is None


# bench -----------------------------------------------------------------------------------------
def test_bench_json_numbers_agree(tiny_models):
    r = invoke("bench", tiny_models["mixtral"], "-p", "8", "-n", "5", "-r", "2", "-b", "1,3", "-o", "json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout.strip().splitlines()[-1])
    assert data["config"]["prompt_len"] == 8 and data["config"]["reps"] == 2
    rows = {row["batch"]: row for row in data["rows"]}
    assert sorted(rows) == [1, 3] and all(row["lynx"] == "off" for row in rows.values())
    for b, row in rows.items():
        # per run tok/s = B·1000/TPOT and B·p/prefill_s exactly; with 2 runs, mean ± std gives
        # both runs back (x = m ± s/√2), so the means must agree exactly too.
        for rate, time_key, work in (("decode_tok_s", "tpot_ms", b * 1000.0), ("prefill_tok_s", "prefill_s", b * 8)):
            m, s = row[time_key], row[time_key + "_std"] / math.sqrt(2)
            assert row[rate] == pytest.approx(work / 2 * (1 / (m + s) + 1 / (m - s)), rel=1e-6)
        assert 2.0 <= row["unique_experts_per_layer"] <= min(8, 2 * b)
    assert rows[1]["unique_experts_per_layer"] == 2.0  # one token, exact routing: exactly top-k


def test_bench_bf16_act_is_recorded_and_checked(tiny_models):
    """--bf16-act reaches the engine and the saved config (bf16 where the build has the rows, else
    what ran: f32); a bad value fails before any load, naming the valid ones."""
    from lynx_edge.kernels import native

    for act in ("f32", "bf16"):
        r = invoke("bench", tiny_models["qwen3_moe"], "--dtype", "bfloat16", "--bf16-act", act, "-p", "4", "-n", "2",
                   "-r", "1", "-b", "1", "-o", "json")
        assert r.exit_code == 0, r.output
        ran = act if act == "f32" or (native.lib() is not None and native.bf16_dp()) else "f32"
        assert json.loads(r.stdout.strip().splitlines()[-1])["config"]["bf16_act"] == ran
    r = invoke("bench", tiny_models["qwen3_moe"], "--bf16-act", "q8")
    assert r.exit_code != 0 and "f32" in r.output and "bf16" in r.output


def test_bench_library_identity_per_run(tiny_models):
    from lynx_edge import Engine
    from lynx_edge.bench import measure, metrics, synthetic_prompts

    eng = Engine.from_pretrained(tiny_models["olmoe"], record_routing=True)
    prompts = synthetic_prompts(eng, 2, 6, seed=1)
    assert prompts == synthetic_prompts(eng, 2, 6, seed=1) and all(len(p) == 6 for p in prompts)
    stats = measure(eng, prompts, 4)
    m = metrics(stats)
    assert stats["completion_tokens"] == 8 and stats["decode_steps"] == 3
    assert m["decode_tok_s"] == pytest.approx(2 * 1000.0 / m["tpot_ms"], rel=1e-9)


def test_bench_lynx_both_side_by_side(tiny_models):
    r = invoke("bench", tiny_models["qwen3_moe"], "--lynx", "both", "-p", "6", "-n", "4", "-r", "1", "-b", "1,4",
               "-o", "json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout.strip().splitlines()[-1])
    rows = {(row["batch"], row["lynx"]): row for row in data["rows"]}
    assert set(rows) == {(1, "off"), (1, "on"), (4, "off"), (4, "on")}
    assert all("remap_pct" in rows[b, "on"] and "remap_pct" not in rows[b, "off"] for b in (1, 4))
    for c in data["compare"]:
        off, on = rows[c["batch"], "off"], rows[c["batch"], "on"]
        assert c["speedup"] == pytest.approx(on["decode_tok_s"] / off["decode_tok_s"])
        u0, u1 = off["unique_experts_per_layer"], on["unique_experts_per_layer"]
        assert c["unique_reduction_pct"] == pytest.approx(100 * (u0 - u1) / u0)
    assert data["quality"] is None and data["quality_note"]  # tiny models have no heldout.txt


@pytest.mark.skipif(not has_module("lynx_edge.offload.projection"), reason="no projection in this build")
def test_bench_simulate_projects_each_run(tiny_models):
    m = tiny_models["mixtral"]
    r = invoke("bench", m, "-p", "4", "-n", "4", "-r", "1", "-b", "1,2", "--simulate", "laptop-rtx4060-8gb",
               "--shape", "mixtral-8x7b", "-o", "json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["config"]["simulate"]["label"] == "projected"
    for row in data["rows"]:
        assert row["proj_tok_s"] > 0 and 0 <= row["proj_hit_rate_pct"] <= 100 and row["proj_bytes_per_token"] >= 0
    r = invoke("bench", m, "-p", "4", "-n", "4", "-r", "1", "-b", "1", "--simulate", "h200", "--shape", "gpt-5")
    assert r.exit_code == 1 and "unknown shape 'gpt-5'" in r.stderr


@pytest.mark.skipif(not has_module("lynx_edge.offload.profile"), reason="no calibration in this build")
def test_profile_writes_a_loadable_profile(tmp_path):
    from lynx_edge.offload.profile import load_profile

    out = tmp_path / "me.toml"
    r = invoke("profile", "-o", out, "--name", "me", "--size-mb", "4", "--device", "cpu")
    assert r.exit_code == 0, r.output
    prof = load_profile(out)
    assert prof.name == "me" and prof.cpu_mem_gbps > 0 and f"profile me → {out}" in r.stdout


def test_bench_table_csv_and_plot(tiny_models, tmp_path):
    m = tiny_models["mixtral"]
    r = invoke("bench", m, "-p", "4", "-n", "3", "-r", "1", "-b", "2")
    assert r.exit_code == 0, r.output
    assert "decode tok/s" in r.stdout and not any(ln.startswith("{") for ln in r.stdout.splitlines())  # no JSON under the table
    r = invoke("bench", m, "-p", "4", "-n", "3", "-r", "1", "-b", "1", "-o", "csv")
    header, row = r.stdout.strip().splitlines()
    assert header.startswith("batch,lynx,prefill_tok_s") and row.startswith("1,off,")
    png = tmp_path / "b.png"
    r = invoke("bench", m, "-p", "4", "-n", "3", "-r", "1", "-b", "1", "--plot", png)
    if has_module("matplotlib"):
        assert r.exit_code == 0 and png.stat().st_size > 0
    else:
        assert r.exit_code == 1 and "matplotlib" in r.stderr and not png.exists()


# eval ------------------------------------------------------------------------------------------
@pytest.mark.skipif(not has_module("lynx_edge.eval"), reason="no lynx_edge.eval in this build")
def test_eval_renders_lynx_vs_exact(tiny_models, tmp_path):
    import random

    from conftest import TEXT

    words, rng = TEXT.split(" "), random.Random(0)
    text = tmp_path / "heldout.txt"  # not periodic, so the windows differ
    text.write_text(" ".join(rng.choice(words) for _ in range(600)))
    args = ["eval", tiny_models["mixtral"], "--file", text, "-b", "1,4", "--seqs", "4", "--seq-len", "24",
            "--prefill-len", "8"]
    r = invoke(*args, "-o", "json")
    assert r.exit_code == 0, r.output
    rows = {row["batch"]: row for row in json.loads(r.stdout)["rows"]}
    one, four = rows[1], rows[4]
    # one token per step: LYNX has no batch to pool over, so it is exact routing
    assert one["unique_lynx"] == one["unique_exact"] == 2.0 and one["greedy_agreement_pct"] == 100.0
    assert one["ppl_change_pct"] == pytest.approx(0.0, abs=1e-9)
    assert four["unique_exact"] > 2.0 and four["unique_lynx"] <= four["unique_exact"]
    assert four["reduction_pct"] == pytest.approx(100 * (1 - four["unique_lynx"] / four["unique_exact"]))
    assert four["ppl_change_pct"] == pytest.approx(100 * (four["ppl_lynx"] / four["ppl_exact"] - 1))
    r = invoke(*args)
    assert r.exit_code == 0 and "greedy agree %" in r.stdout and "reduction %" in r.stdout
    r = invoke("eval", tiny_models["mixtral"], "--file", tmp_path / "missing.txt")
    assert r.exit_code == 1 and "missing.txt: no such file" in r.stderr


# chat ------------------------------------------------------------------------------------------
def test_chat_one_turn_matches_engine_generate(tiny_models):
    from lynx_edge import Engine

    m = tiny_models["qwen2_moe"]
    r = invoke("chat", m, "-p", "def add(a, b):", "--system", "be brief", "--temp", "0", "-n", "8")
    assert r.exit_code == 0, r.output
    eng = Engine.from_pretrained(m)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    assert r.stdout == eng.generate(msgs, max_new_tokens=8) + "\n"
    assert "decode" in r.stderr and "experts/layer" in r.stderr
    # one sequence: LYNX has no batch to pool votes over, so its answer is the exact one
    r2 = invoke("chat", m, "-p", "def add(a, b):", "--system", "be brief", "--temp", "0", "-n", "8", "--lynx", "on")
    assert r2.exit_code == 0 and r2.stdout == r.stdout and "remap 0.0%" in r2.stderr


def test_chat_raw_completion(tiny_models):
    """--raw: no chat template, the model continues the text as written (ollama's raw); the embedded
    demo, a code-continuation model never trained on chat, chats raw by default (--no-raw: ChatML)."""
    from lynx_edge import Engine

    m = tiny_models["qwen2_moe"]
    eng = Engine.from_pretrained(m)
    r = invoke("chat", m, "-p", "def add(a, b):", "--temp", "0", "-n", "8", "--raw")
    assert r.exit_code == 0, r.output
    assert r.stdout == eng.generate("def add(a, b):", max_new_tokens=8) + "\n"
    assert "raw completion" in r.stderr
    demo = Engine.from_pretrained("demo", device="cpu")
    raw = demo.generate("def add(a, b):", max_new_tokens=8)
    chat = demo.generate([{"role": "user", "content": "def add(a, b):"}], max_new_tokens=8)
    assert raw != chat  # the two modes differ on this prompt, so the checks below can fail
    r = invoke("chat", "demo", "-p", "def add(a, b):", "-n", "8")
    assert r.exit_code == 0 and r.stdout == raw + "\n" and "chat runs it as raw completion" in r.stderr
    r = invoke("chat", "demo", "-p", "def add(a, b):", "-n", "8", "--no-raw")
    assert r.exit_code == 0 and r.stdout == chat + "\n" and "--raw runs it as raw completion" in r.stderr


def test_read_message_multiline():
    def reader(lines):
        it = iter(lines)
        return lambda prompt: next(it)

    assert read_message(reader(["hello"])) == "hello"
    assert read_message(reader(["one \\", "two\\", "three"])) == "one \ntwo\nthree"
    assert read_message(reader(['"""', "a", "  b", '"""'])) == "a\n  b"
    assert read_message(reader(['"""x', 'y"""'])) == "x\ny"
    assert read_message(reader(['"""inline"""'])) == "inline"


class _StubEngine:
    """Streams two chunks, then Ctrl-C arrives (what a user pressing it mid-answer causes)."""

    ctx = 64
    config = type("C", (), {"lynx": "off"})()

    def __init__(self):
        self.calls, self.resets = [], 0
        self.last_stats = {}

    def stream(self, messages, **kw):
        from lynx_edge.engine import Chunk

        self.calls.append([dict(m) for m in messages])
        self.last_stats = {"completion_tokens": 2, "decode_tok_s": 5.0, "stopped": True}  # as Engine sets it
        yield Chunk("Hel", [1])
        yield Chunk("lo", [2])
        raise KeyboardInterrupt

    def encode_prompt(self, messages):
        return list(range(10 * len(messages)))

    def reset(self):
        self.resets += 1


def test_ctrl_c_keeps_the_session(capsys):
    eng = _StubEngine()
    s = ChatSession(eng, "sys", {"max_new_tokens": 4})
    assert s.turn("q1") == "Hello"
    assert s.messages[-1] == {"role": "assistant", "content": "Hello"}
    s.turn("q2")  # the conversation goes on, with the partial answer in its history
    assert [m["role"] for m in eng.calls[1]] == ["system", "user", "assistant", "user"]
    out = capsys.readouterr()
    assert "Hello" in out.out and "(stopped)" in out.out + out.err
    assert "2 tokens" in out.out + out.err and s.last["stopped"]  # a stopped answer keeps its stats
    s.reset()
    assert s.messages == [{"role": "system", "content": "sys"}] and eng.resets == 1


_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\r")


class Pty:
    """A child process on a pseudo-terminal; expect() waits for a regex in the cleaned output."""

    def __init__(self, argv: list[str], env: dict, sigint_ignored: bool = False):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child: become the program
            try:
                if sigint_ignored:  # as a shell without job control starts a background command
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.raw, self.pos, self.exit_code = b"", 0, None

    @property
    def text(self) -> str:
        return _ANSI.sub("", self.raw.decode("utf-8", "replace"))

    def expect(self, pattern: str, timeout: float = 60.0) -> str:
        end = time.monotonic() + timeout
        while True:
            m = re.compile(pattern).search(self.text, self.pos)
            if m:
                self.pos = m.end()
                return m.group(0)
            left = end - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"timed out waiting for {pattern!r}; transcript:\n{self.text}")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        try:
            data = os.read(self.fd, 65536) if ready else b""
        except OSError:  # EIO: the child closed the terminal
            return False
        self.raw += data
        return bool(data) or not ready

    def send(self, line: str) -> None:
        os.write(self.fd, line.encode() + b"\r")

    def wait(self, timeout: float = 30.0) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self._read(0.2)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exit_code = os.waitstatus_to_exitcode(status)
                return self.exit_code
        raise AssertionError(f"chat did not exit; transcript:\n{self.text}")

    def close(self) -> None:
        """Kill the child (by its pid, only while it is still ours to reap) and free the terminal."""
        if self.exit_code is None:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
            self.exit_code = -9
        os.close(self.fd)


def test_ctrl_c_works_when_started_with_sigint_ignored(tiny_models):
    """Started from a background job of a non-interactive shell (SIGINT inherited as ignored),
    chat on a terminal still turns Ctrl-C into "stop / clear the line"."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
    p = Pty([sys.executable, "-m", "lynx_edge", "chat", str(tiny_models["mixtral"]), "--temp", "0", "-n", "4"], env,
            sigint_ignored=True)
    try:
        p.expect(r"> ")
        time.sleep(0.5)
        os.write(p.fd, b"\x03")
        p.expect(r"Ctrl-D or /exit to quit")
        p.send("/exit")
        assert p.wait() == 0
    finally:
        p.close()


def test_chat_in_a_pseudo_terminal(tiny_models):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
    p = Pty([sys.executable, "-m", "lynx_edge", "chat", str(tiny_models["mixtral"]), "--temp", "0", "-n", "6"], env)
    try:
        p.expect(r"lynx-edge chat .*lynx off")
        p.expect(r"> ")
        time.sleep(0.5)  # let the child settle into input() before the interrupt arrives
        os.write(p.fd, b"\x03")  # Ctrl-C at the prompt: the terminal sends SIGINT; the session stays
        p.expect(r"Ctrl-D or /exit to quit")
        p.expect(r"> ")
        p.send("what is a mixture of experts?")
        p.expect(r"decode [\d.]+ tok/s \([\d.]+ ms/tok\) · 2\.00 experts/layer · \d+ tokens")
        p.expect(r"> ")
        p.send("/stats")
        p.expect(r"turns\s*│\s*1")
        p.expect(r"context tokens\s*│\s*[1-9]\d* / 512")
        p.send("/reset")
        p.expect(r"conversation cleared")
        p.send("/stats")
        p.expect(r"context tokens\s*│\s*0 / 512")
        p.send("/exit")
        assert p.wait() == 0
    finally:
        p.close()
    assert "what is a mixture of experts?" in p.text  # the terminal echoed the question
