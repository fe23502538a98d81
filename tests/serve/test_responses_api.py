"""OpenAI's Responses API as raycolo serves it (raycolo/online/serving/responses_protocol.py
and responses_api.py): the chat request a body comes to, its 400s, and the answer and
events a chat answer becomes, against hand-worked cases and the official ``openai``
client's own types (the deployment's route: tests/serve/checkpoints/test_generation.py)."""
from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from raycolo.online.serving.openai_errors import OpenAIError, from_validation
from raycolo.online.serving.responses_api import ResponseEvents, whole_response
from raycolo.online.serving.responses_protocol import ResponsesRequest

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object",
                                                                    "properties": {"city": {"type": "string"}}}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_a_conversation_of_items_is_the_chat_it_stands_for():
    """Items an earlier response gave are sent back as they came: a reasoning item goes to
    the next assistant turn, a function call right after an assistant message joins its
    turn, a call's output is a tool message; instructions come first."""
    body = request(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me see.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Bergen"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "wet"}]},
    ], tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=7,
        temperature=0, text={"format": {"type": "json_object"}}, parallel_tool_calls=False)
    chat = body.chat_body()
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me see.", "reasoning": "Look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Bergen"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        {"role": "tool", "tool_call_id": "call_2", "content": "wet"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather",
                                                               "parameters": WEATHER["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat["max_completion_tokens"], chat["temperature"], chat["parallel_tool_calls"]) == (7, 0, False)
    assert chat["response_format"] == {"type": "json_object"}
    schema = request(text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"},
                                      "strict": True}}).chat_body()["response_format"]
    assert schema == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True}}
    assert request(stream=True).chat_body()["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("fields, param", [
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "no spaces", "arguments": "{}"}]}, "input[0].name"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": "1"}, "temperature"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
])
def test_a_body_that_breaks_a_rule_is_a_400_naming_its_field(fields, param):
    with pytest.raises(ValidationError) as exc:
        request(**fields)
    err = from_validation(exc.value)
    assert err.status == 400 and err.param == param, (err.param, err.message)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "w"}}}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"role": "user", "content": "\ud800"}]}, "input"),
])
def test_a_chat_rule_it_breaks_names_the_responses_field(fields, param):
    with pytest.raises((OpenAIError, ValidationError)) as exc:
        request(**fields).chat_request()
    err = exc.value if isinstance(exc.value, OpenAIError) else from_validation(exc.value)
    assert err.status == 400 and err.param.split("[")[0] == param, (err.param, err.message)


ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
          "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}}


def test_a_whole_chat_answer_becomes_a_response_the_openai_client_reads():
    from openai.types.responses import Response

    said = {**ANSWER, "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Cold.", "reasoning": "It is winter."}}]}
    body = request(metadata={"k": "v"})
    out = Response.model_validate(whole_response(body, said))
    assert out.status == "completed" and out.output_text == "Cold." and out.metadata == {"k": "v"}
    assert [o.type for o in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == "It is winter."
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == (9, 5, 14)
    called = {**ANSWER, "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}}]}
    out = Response.model_validate(whole_response(request(tools=[WEATHER]), called))
    assert [o.type for o in out.output] == ["function_call"]
    assert (out.output[0].call_id, out.output[0].name, json.loads(out.output[0].arguments)) == \
        ("call_9", "get_weather", {"city": "Oslo"})
    cut = {**ANSWER, "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant",
                                                                                       "content": "Col"}}]}
    out = Response.model_validate(whole_response(request(max_output_tokens=5), cut))
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"


def chunks(*deltas, finish="stop", usage=(9, 4)) -> list[str]:
    """The chat route's data lines for ``deltas`` (one choice), as sse_answer writes them."""
    lines = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    lines += [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    lines += [{"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
              {"choices": [], "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]}}]
    return [f"data: {json.dumps(x)}\n\n" for x in lines] + ["data: [DONE]\n\n"]


def events_of(body: ResponsesRequest, lines: list[str]) -> list[dict]:
    async def run():
        async def gen():
            for line in lines:
                yield line.encode()
        return [e async for e in ResponseEvents(body).events(gen())]

    out = []
    for event in asyncio.run(run()):
        name, data = event.split("\n")[:2]
        parsed = json.loads(data.removeprefix("data: "))
        assert name == f"event: {parsed['type']}"
        out.append(parsed)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_streamed_chunks_become_the_responses_events_in_openais_order():
    """Hand-worked: reasoning, text, then a call; every event parses as the openai client's
    own event type; the last carries the whole response."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    lines = chunks({"reasoning": "Hm"}, {"reasoning": "m."}, {"content": "Co"}, {"content": "ld."},
                   {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": ""}}]},
                   {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                   {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}, finish="tool_calls")
    events = events_of(request(tools=[WEATHER]), lines)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)
    last = events[-1]["response"]
    assert [o["type"] for o in last["output"]] == ["reasoning", "message", "function_call"]
    assert last["output"][1]["content"][0]["text"] == "Cold."
    assert (last["output"][2]["call_id"], last["output"][2]["arguments"]) == ("call_1", '{"city": "Oslo"}')
    assert last["usage"]["output_tokens"] == 4 and last["status"] == "completed"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]


def test_a_cut_answer_is_incomplete_and_a_failure_after_the_200_is_response_failed():
    events = events_of(request(), chunks({"content": "Col"}, finish="length"))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["output"][-1]["status"] == "incomplete"
    failed = chunks({"content": "Co"})[:2] + [f"data: {json.dumps({'error': {'message': 'boom'}})}\n\n"]
    events = events_of(request(), failed)
    assert [e["type"] for e in events][-2:] == ["response.output_item.done", "response.failed"]
    assert events[-1]["response"]["error"]["message"] == "boom"
    empty = events_of(request(), chunks())
    assert empty[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_whole_and_streamed_answers_have_the_same_items():
    """A reasoning-only answer (cut while thinking) has no message item, whole or
    streamed; an empty one has an empty message; the cut item is incomplete."""
    cut = {**ANSWER, "choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": None, "reasoning": "Hmm"}}]}
    whole = whole_response(request(), cut)
    streamed = events_of(request(), chunks({"reasoning": "Hmm"}, finish="length"))[-1]["response"]
    for out in (whole, streamed):
        assert [(o["type"], o["status"]) for o in out["output"]] == [("reasoning", "incomplete")]
    empty = {**ANSWER, "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant",
                                                                                       "content": ""}}]}
    assert [o["type"] for o in whole_response(request(), empty)["output"]] == ["message"]


def test_reasoning_goes_to_its_own_turn_and_an_unfinished_message_is_continued():
    call = {"type": "function_call", "name": "f", "arguments": "{}"}
    body = request(input=[
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "R1"}]}, {**call, "call_id": "a"},
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "lost"}]},
        {"role": "user", "content": "again"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "R2"}]}, {**call, "call_id": "b"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "R3"}]}, {**call, "call_id": "c"},
        {"type": "message", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "So "}, {"type": "refusal", "refusal": "no"}]}])
    turns = [(m["role"], m.get("reasoning"), [c["id"] for c in m.get("tool_calls", [])]) for m in body.messages()]
    assert turns == [("user", None, []), ("assistant", "R1", ["a"]), ("tool", None, []), ("user", None, []),
                     ("assistant", "R2", ["b"]), ("assistant", "R3", ["c"]), ("assistant", None, [])]
    assert body.messages()[-1]["content"] == "So no"
    chat = body.chat_body()
    assert (chat["add_generation_prompt"], chat["continue_final_message"]) == (False, True)
    assert "continue_final_message" not in request(input=[{"role": "assistant", "content": "x",
                                                           "status": "completed"}]).chat_body()
    with pytest.raises(ValidationError) as exc:
        request(input=[{"role": "user", "content": [{"type": "refusal", "text": "no"}]}])
    err = from_validation(exc.value)
    assert err.param == "input[0].content[0]" and "needs its refusal" in err.message


def test_a_chat_routes_error_names_the_responses_field():
    from raycolo.online.serving.responses_protocol import responses_error

    for chat_param, param in (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                              ("structured_outputs", "text.format"), ("response_format", "text.format")):
        err = responses_error(OpenAIError(400, f"{chat_param}: too long", param=chat_param, code="c",
                                          headers={"x": "1"}))
        assert (err.status, err.param, err.message, err.code, err.headers) == (400, param, f"{param}: too long", "c",
                                                                               {"x": "1"})
    busy = OpenAIError(429, "busy", headers={"Retry-After": "1"})
    assert responses_error(busy) is busy
