"""Harmony channels (gpt-oss) from generated token ids: lynx_edge/harmony.py, `lynx-edge chat`, the
OpenAI server. Reference: the real gpt-oss chat template rendered by transformers — an assistant
turn rendered as training text (thinking + content) is exactly what the model generates after the
prompt's `<|start|>assistant`, so parsing those ids must give the thinking and the content back.
The tiny gpt-oss checkpoint of test_gpt_oss is made to emit such ids (its logits forced), so chat
and the server run the real engine, template and tokenizer end to end.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lynx_edge.harmony import HarmonyParser, HarmonyTokens, is_answer
from lynx_edge.tokenizer import Tokenizer
from test_gpt_oss import TOOLS, build, write_tokenizer

THINK, ANSWER = "2+2 is 4; reply in 日本語 too.", "4 — 四 (よん)."


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("harmony-tok")
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def generated(hf_tok, msgs: list[dict], turn: dict, **kw) -> list[int]:
    """The ids a model answering `msgs` with `turn` generates, by transformers' template: the
    training rendering of the conversation minus the generation prompt."""
    prompt = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
    full = hf_tok.apply_chat_template(msgs + [turn], tokenize=False, **kw)
    assert full.startswith(prompt)
    return hf_tok.encode(full[len(prompt):], add_special_tokens=False)


USER = [{"role": "user", "content": "What is 2+2?"}]
CALL = {"role": "assistant", "content": "", "thinking": "I should call add.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
CASES = {  # turn → (role, channel, recipient, content type, text, ended by) of each message
    "thinking+answer": ({"role": "assistant", "content": ANSWER, "thinking": THINK},
                        [("assistant", "analysis", None, None, THINK, "end"),
                         ("assistant", "final", None, None, ANSWER, "return")]),
    "answer": ({"role": "assistant", "content": ANSWER}, [("assistant", "final", None, None, ANSWER, "return")]),
    "tool call": (CALL, [("assistant", "analysis", None, None, "I should call add.", "end"),
                         ("assistant", "commentary", "functions.add", "json", '{"a": 1, "b": 2}', "call")]),
}


def test_markers_found_from_the_tokenizer(tok_dir, tmp_path):
    t = HarmonyTokens.of(Tokenizer(tok_dir))
    assert (t.start, t.channel, t.message, t.end, t.ret, t.call, t.constrain) == \
        (200006, 200005, 200008, 200007, 200002, 200012, 200003)  # o200k_harmony's ids
    assert HarmonyTokens.of(Tokenizer(Path(__file__).parents[1] / "lynx_edge" / "demo")) is None
    # the same added tokens under a template that writes no channels: not Harmony
    for f in tok_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<|start|>{{ m.content }}<|end|>{% endfor %}")
    assert HarmonyTokens.of(Tokenizer(tmp_path)) is None


@pytest.mark.parametrize("case", list(CASES))
def test_parser_gives_back_what_the_template_wrote(tok_dir, hf_tok, case):
    turn, want = CASES[case]
    kw = {"tools": TOOLS} if "tool_calls" in turn else {}
    ids = generated(hf_tok, USER, turn, **kw)
    tok = Tokenizer(tok_dir)
    p = HarmonyParser(tok, HarmonyTokens.of(tok))
    pieces = [q for i in ids for q in p.push(i)] + p.flush()
    got = [(m.role, m.channel, m.recipient, m.content_type, m.text, m.ended_by) for m in p.messages]
    assert got == want
    for ch in {m[1] for m in want}:  # streamed: many pieces, joining to each channel's text
        assert "".join(t for c, t in pieces if c == ch) == "".join(m[4] for m in want if m[1] == ch)
    assert len(pieces) > len(want)
    answer, reasoning = p.split()
    assert answer == (ANSWER if case != "tool call" else "") and (reasoning == THINK) == (case == "thinking+answer")


def test_cut_generations_and_plain_text(tok_dir, hf_tok):
    tok = Tokenizer(tok_dir)
    ids = generated(hf_tok, USER, CASES["thinking+answer"][0])
    cut = ids[: ids.index(200007) - 3]  # stopped inside the analysis
    p = HarmonyParser(tok, HarmonyTokens.of(tok))
    p.feed(cut)
    p.flush()
    assert [(m.channel, m.ended_by) for m in p.messages] == [("analysis", None)]
    body = cut[cut.index(200008) + 1:]  # after <|message|>
    assert p.messages[0].text == hf_tok.decode(body)  # (a cut character decodes to U+FFFD, as transformers)
    assert p.split()[0] == "" and p.tokens == {"analysis": len(body)}
    # a model writing text with no markers after `<|start|>assistant`: shown as the answer, not lost
    p = HarmonyParser(tok, HarmonyTokens.of(tok))
    text = "Just text, no channels."
    assert p.feed(tok.encode(text, add_special_tokens=False)) == [] and p.flush() == [(None, text)]
    assert is_answer(None) and p.split() == (text, "")


# the real engine, made to say a scripted Harmony answer ---------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from lynx_edge import Engine

    return Engine.from_pretrained(build(tmp_path_factory.mktemp("gpt-oss-h") / "bf16"), device="cpu",
                                  dtype=torch.float32)


class Script:
    """Forces the model's argmax: from position `at` on, every row emits ids[pos + 1 - at]."""

    def __init__(self, eng):
        self.at, self.ids, self.orig = 0, [], eng.model.forward
        eng.model.forward = self

    @torch.inference_mode()  # the logits are inference tensors, whatever mode the caller is in
    def __call__(self, input_ids, ab, kv, is_decode, logits_for="last"):
        logits = self.orig(input_ids, ab, kv, is_decode, logits_for).clone()
        if logits.dim() == 2:
            for b, pos in enumerate(ab.positions[:, -1].tolist()):
                k = pos + 1 - self.at
                if 0 <= k < len(self.ids):
                    logits[b] = -1e9
                    logits[b, self.ids[k]] = 0.0
        return logits


@pytest.fixture
def script(engine):
    s = Script(engine)
    yield s
    engine.model.forward = s.orig


def test_chat_shows_the_answer_and_sends_back_the_final_channel(engine, script, hf_tok, capsys):
    from lynx_edge.cli.chat import ChatSession

    kw = {"reasoning_effort": "low"}
    s = ChatSession(engine, None, {"do_sample": False, "max_new_tokens": 80}, kw)
    assert s.harmony is not None
    script.at, script.ids = len(engine.encode_prompt(USER, kw)), generated(hf_tok, USER, CASES["thinking+answer"][0], **kw)
    assert s.turn(USER[0]["content"]) == ANSWER
    out = capsys.readouterr()
    n_think = len(hf_tok.encode(THINK, add_special_tokens=False))
    assert ANSWER in out.out and THINK not in out.out + out.err
    assert f"(reasoning hidden: {n_think} tokens · --show-reasoning shows it)" in out.out
    assert s.messages[-1] == {"role": "assistant", "content": ANSWER}  # the final channel only
    # turn 2: what the engine is sent = transformers' rendering of the conversation with the whole
    # assistant turn (thinking included): the template drops the earlier analysis itself
    q2, think2, answer2 = "And 3+3?", "Add three and three.", "6"
    conv = USER + [{"role": "assistant", "content": ANSWER, "thinking": THINK}, {"role": "user", "content": q2}]
    sent = hf_tok.encode(hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, **kw),
                         add_special_tokens=False)
    assert engine.encode_prompt(s.messages + [conv[-1]], kw) == sent
    s.show_reasoning = True
    script.at, script.ids = len(sent), generated(hf_tok, conv, {"role": "assistant", "content": answer2,
                                                                "thinking": think2}, **kw)
    assert s.turn(q2) == answer2
    out = capsys.readouterr()
    assert f"{think2}\n{answer2}\n" in out.out and "reasoning hidden" not in out.out
    assert s.last["cached_prompt_tokens"] > len(engine.encode_prompt(USER, kw))  # turn 1's prompt (and more) reused


def test_server_content_and_reasoning_content(engine, script, hf_tok):
    from fastapi.testclient import TestClient

    from lynx_edge.server.app import create_app

    script.at = len(engine.encode_prompt(USER))
    script.ids = generated(hf_tok, USER, CASES["thinking+answer"][0])
    body = {"messages": USER, "max_tokens": 80, "temperature": 0}
    with TestClient(create_app(engine, model_name="t", max_num_seqs=2)) as client:
        r = client.post("/v1/chat/completions", json={**body, "n": 2})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert c["message"] == {"role": "assistant", "content": ANSWER, "reasoning_content": THINK}
            assert c["finish_reason"] == "stop"
        r = client.post("/v1/chat/completions", json={**body, "stream": True})
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == THINK
        assert "".join(d.get("content", "") for d in deltas) == ANSWER
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        # completions stay raw text: the markers dropped, their words left (what chat used to show)
        r = client.post("/v1/completions", json={"prompt": engine.encode_prompt(USER), "max_tokens": 80,
                                                 "temperature": 0})
        assert r.json()["choices"][0]["text"] == f"analysis{THINK}assistantfinal{ANSWER}"


def test_chat_cli_flags(engine):
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app

    path = str(engine.model_dir)
    r = CliRunner().invoke(app, ["chat", path, "-p", "hi", "-n", "4", "--temp", "0", "--reasoning-effort", "high",
                                 "--verbose-prompt", "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    assert "Reasoning: high" in r.stderr and "(cut at the token limit" in r.stderr
    r = CliRunner().invoke(app, ["chat", path, "-p", "hi", "--reasoning-effort", "extreme"])
    assert r.exit_code == 2 and "use low, medium, high" in r.output
