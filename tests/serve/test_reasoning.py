"""Reasoning split from content (raycolo/online/serving/reasoning.py, answer_reading.py),
vLLM's deepseek_r1 and qwen3 rules: hand-worked replies, the same split however a reply
is cut into deltas (alone and with hermes tool calls after the reasoning), the streamed
chunks of sse_answer against the whole message, and where a constraint starts to bind on a
reasoning deployment (after the reply's first </think>, as vLLM's)."""
from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings, strategies as st

from raycolo.engine.models import ByteTokenizer
from raycolo.online.serving.answer_reading import AnswerReading, chat_reading, constraint_after, whole_message
from raycolo.online.serving.openai_errors import OpenAIError
from raycolo.online.serving.protocol import ChatCompletionRequest, CompletionRequest
from raycolo.online.serving.reasoning import ReasoningParserKind
from raycolo.online.serving.responses import ChoiceEvent
from raycolo.online.serving.sse_stream import sse_answer
from raycolo.online.serving.tool_calls import ToolParserKind, ToolReading
from raycolo.online.serving.tool_protocol import ToolChoiceKind

R1, QWEN3 = ReasoningParserKind.DEEPSEEK_R1, ReasoningParserKind.QWEN3
HERMES_AUTO = ToolReading(ToolChoiceKind.AUTO, ToolParserKind.HERMES)

# (parser, reply, reasoning, content): hand-worked
CASES = [
    (R1, "I should add.</think>\n\n4", "I should add.", "\n\n4"),
    (R1, "<think>Hmm.</think>Yes.", "Hmm.", "Yes."),
    (R1, "Still thinking", "Still thinking", None),
    (R1, "Done.</think>", "Done.", None),
    (R1, "a < b, so </thin", "a < b, so </thin", None),
    (R1, "</think>4", "", "4"),                            # an empty reasoning is "", as vLLM's
    (R1, "", "", None),
    (QWEN3, "<think></think>4", None, "4"),
    # qwen3 with thinking on (vLLM 0.32's Qwen3 parser, run on these texts: the same split)
    (QWEN3, "<think>\nThe sum is 4.\n</think>\n\n4", "\nThe sum is 4.\n", "\n\n4"),
    (QWEN3, "4", "4", None),                            # never closed: all reasoning
    (QWEN3, "a</think>b", "a", "b"),                     # <think> in the prompt (Qwen3-2507, Qwen3.5)
    (QWEN3, "x<think>y</think>z", "xy", "z"),            # every <think> dropped
    (QWEN3, "</think>x", None, "x"),                     # an empty reasoning is null
    (QWEN3, "", None, None),
    (QWEN3, "<thinking is fun", "<thinking is fun", None),
    (QWEN3, "<think>never closed", "never closed", None),
    (QWEN3, "<thi", "<thi", None),
]


@pytest.mark.parametrize("reply", ["<think>a</think>b", "a</think>b", "b", "", "</think>x"])
def test_qwen3_with_thinking_off_is_all_content_as_written(reply):
    """``chat_template_kwargs: {"enable_thinking": false}``: vLLM 0.32's Qwen3 parser gives
    (None, the reply) for each of these; streamed the same, however cut."""
    off = AnswerReading(reasoning=QWEN3, thinking=False)
    message, _ = whole_message(off, reply)
    assert (message["reasoning"], message["content"]) == (None, reply)
    reader = off.reader()
    deltas = [reader.feed(c) for c in reply] + [reader.finish()]
    assert "".join(d.content for d in deltas) == reply and not any(d.reasoning for d in deltas)
    body = ChatCompletionRequest.model_validate({**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert chat_reading(body, None, QWEN3).thinking is False and chat_reading(body, None, R1).thinking is True


@pytest.mark.parametrize("kind, reply, reasoning, content", CASES)
def test_reasoning_and_content_as_each_parser_splits_them(kind, reply, reasoning, content):
    message, called = whole_message(AnswerReading(reasoning=kind), reply)
    assert (message["reasoning"], message["content"], called) == (reasoning, content, False)
    dropped, _ = whole_message(AnswerReading(reasoning=kind, include_reasoning=False), reply)
    assert dropped["reasoning"] is None and dropped["content"] == content


def test_tool_calls_are_read_from_the_content_after_the_reasoning():
    reply = 'I need the weather.</think>Let me look.<tool_call>{"name": "w", "arguments": {"c": "Oslo"}}</tool_call>'
    message, called = whole_message(AnswerReading(HERMES_AUTO, R1), reply)
    assert message["reasoning"] == "I need the weather." and message["content"] == "Let me look." and called
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("w", {"c": "Oslo"})]
    # a call inside the reasoning is no call
    message, called = whole_message(AnswerReading(HERMES_AUTO, R1), '<tool_call>{"name": "w"}</tool_call></think>ok')
    assert not called and message["content"] == "ok"


TEXTS = [reply for _, reply, _, _ in CASES] + [
    'Why.</think>So.<tool_call>{"name": "w", "arguments": {}}</tool_call>']


@given(st.sampled_from([(None, R1), (None, QWEN3), (HERMES_AUTO, R1), (HERMES_AUTO, QWEN3)]),
       st.sampled_from(TEXTS), st.lists(st.integers(0, 90), max_size=8))
@settings(max_examples=300, deadline=None)
def test_a_streamed_reply_splits_as_the_whole_one_however_it_is_cut(mode, text, cuts):
    tools, kind = mode
    reading = AnswerReading(tools, kind)
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    reader = reading.reader()
    deltas = [reader.feed(p) for p in pieces] + [reader.finish()]
    whole, _ = whole_message(reading, text)
    assert "".join(d.reasoning for d in deltas) == (whole["reasoning"] or "")
    assert "".join(d.content for d in deltas) == (whole["content"] or "")
    for d in deltas[:-1]:        # no piece of a closing tag is ever shown as reasoning
        assert not any(d.reasoning.endswith("</think>"[:n]) for n in range(2, 9)) or d.reasoning.endswith(">")


def _events(pieces: list[str], finish: str):
    async def gen():
        count = 0
        for i, p in enumerate(pieces):
            count += 1
            yield ChoiceEvent(p, finish if i == len(pieces) - 1 else None, count, [], ())
    return gen()


def test_streamed_chunks_carry_reasoning_content_and_calls_as_openai_clients_join_them():
    tok = ByteTokenizer(512)
    pieces = ["Why", " so.</th", "ink>So", '.<tool_call>{"name": "w", ', '"arguments": {}}</tool_call>']
    reading = AnswerReading(HERMES_AUTO, R1)

    async def collect():
        return [line async for line in sse_answer([_events(pieces, "stop")], tok, "chatcmpl-1", True, "m", 3,
                                                  False, 1, reading=reading)]

    lines = asyncio.run(collect())
    chunks = [json.loads(x[len("data: "):]) for x in lines if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant"}
    assert "".join(d.get("reasoning", "") for d in deltas) == "Why so."
    assert "".join(d.get("content", "") for d in deltas) == "So."
    calls = [tc for d in deltas for tc in d.get("tool_calls", ())]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("w", "{}")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and lines[-1] == "data: [DONE]\n\n"
    assert not any("<" in d.get("reasoning", "") + d.get("content", "") for d in deltas)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "w"}}
CONSTRAINED = [({"response_format": {"type": "json_object"}}, "response_format"),
               ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
               ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice")]


def test_a_constraint_binds_after_the_replys_first_end_of_reasoning_unless_the_prompt_ended_it(hf_checkpoints):
    """vLLM 0.32's rule (is_reasoning_end on the prompt): looking back, </think> first says
    ended (bind from the start), <think> first says not (bind after the reply's first
    </think>); qwen3 stops at a ChatML turn boundary and then reads enable_thinking;
    include_reasoning false binds from the start; a tokenizer without the tags as tokens
    is a 400 naming the constraint's field."""
    from raycolo.engine.models import load_tokenizer

    tok = load_tokenizer(str(hf_checkpoints["qwen2"]))
    think, close = (tok.tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    hi = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    off = hi + tok.encode("<think>\n\n</think>\n\n")                  # Qwen3's template, thinking off
    # a finished turn's reasoning kept in the history, then a new turn (a tool-call loop)
    history = tok.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\ncall<|im_end|>\n") + hi
    for extra, param in CONSTRAINED:
        body = ChatCompletionRequest.model_validate({**CHAT, **extra})
        for kind, ids, want in ((R1, hi, close), (R1, hi + [think], close), (R1, off, None),
                                (R1, off + [think, 5], close), (R1, history, None),
                                (QWEN3, hi, close), (QWEN3, off, None), (QWEN3, history, close)):
            assert constraint_after(kind, body, tok, ids) == want, (kind, tok.decode(ids))
        params = body.sampling_params(16, 0)
        assert params.model_copy(update={"structured_after_token": close}).structured_outputs == body.constraint()
        with pytest.raises(OpenAIError) as err:
            constraint_after(R1, body, ByteTokenizer(300), hi)
        assert err.value.status == 400 and err.value.param == param and "</think>" in err.value.message
        assert constraint_after(None, body, ByteTokenizer(300), hi) is None            # no reasoning parser
        quiet = ChatCompletionRequest.model_validate({**CHAT, **extra, "include_reasoning": False})
        assert constraint_after(R1, quiet, tok, hi) is None                            # vLLM: from the start
        no_thinking = ChatCompletionRequest.model_validate({**CHAT, **extra,
                                                           "chat_template_kwargs": {"enable_thinking": False}})
        assert constraint_after(QWEN3, no_thinking, tok, hi) is None       # a turn boundary, thinking off
        assert constraint_after(R1, no_thinking, tok, hi) == close         # deepseek_r1 reads no kwargs
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "structured_outputs": {"regex": "a"}})
    assert constraint_after(R1, completion, tok, hi) == close               # completions: as a thinking chat


def test_auto_without_a_tool_call_parser_is_a_400_and_a_reader_is_made_only_where_needed():
    chat = CHAT
    with pytest.raises(OpenAIError) as err:               # "auto" without a tool-call parser
        chat_reading(ChatCompletionRequest.model_validate({**chat, "tools": [TOOL]}), None, None)
    assert err.value.param == "tool_choice"
    assert chat_reading(ChatCompletionRequest.model_validate(chat), None, None) is None
    reading = chat_reading(ChatCompletionRequest.model_validate({**chat, "include_reasoning": False}), None, QWEN3)
    assert reading == AnswerReading(None, QWEN3, False)


def test_an_assistants_reasoning_reaches_the_template_as_reasoning_content():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "4", "reasoning": "2+2"},
        {"role": "assistant", "content": "5", "reasoning_content": "old name"}]})
    assert [m.template_dict().get("reasoning_content") for m in body.messages] == [None, "2+2", "old name"]
    with pytest.raises(Exception, match="only an assistant message carries reasoning"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": "hi", "reasoning": "x"}]})


def test_a_whole_chat_choice_carries_reasoning_content_and_the_finish_reason():
    from raycolo.online.serving.responses import choice

    whole = ChoiceEvent('Why.</think>So.<tool_call>{"name": "w", "arguments": {}}</tool_call>', "stop", 9, None, ())
    out = choice(ByteTokenizer(512), True, 0, whole, reading=AnswerReading(HERMES_AUTO, R1))
    message = out["message"]
    assert (message["reasoning"], message["content"], out["finish_reason"]) == ("Why.", "So.", "tool_calls")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["w"]
    plain = choice(ByteTokenizer(512), True, 0, whole)            # no reading: the text as it came
    assert plain["message"] == {"role": "assistant", "content": whole.delta} and plain["finish_reason"] == "stop"


def test_a_continued_message_whose_prompt_ended_the_reasoning_is_continued_as_content(hf_checkpoints):
    """vLLM reads the prompt (``is_reasoning_end``): a continued assistant message after
    Qwen3's closed ``<think>\\n\\n</think>`` is content; one inside an open ``<think>`` is
    still reasoning; a chat that continues nothing reads as before."""
    from raycolo.engine.models import load_tokenizer

    tok = load_tokenizer(str(hf_checkpoints["qwen2"]))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Dear"}]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "add_generation_prompt": False,
                                                 "continue_final_message": True})
    hi = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    closed = hi + tok.encode("<think>\n\n</think>\n\nDear")
    opened = hi + tok.encode("<think>\nDear")
    for kind in (QWEN3, R1):
        assert chat_reading(body, None, kind, tok, closed).thinking is False
        assert chat_reading(body, None, kind, tok, opened).thinking is True
        assert chat_reading(body, None, kind, ByteTokenizer(300), closed).thinking is True     # no <think> tokens
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": messages[:1]})
    assert chat_reading(plain, None, QWEN3, tok, closed).thinking is True
