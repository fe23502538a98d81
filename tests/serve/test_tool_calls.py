"""Function calling's pure parts (raycolo/online/serving/tool_protocol.py, tool_calls.py):
the request's rules (vLLM's), the schemas of forced calls (vLLM's, written out here by
hand), the chat rendering against transformers' ``apply_chat_template(tools=...)``, and the
calls read from text: hand-worked cases, and a streamed answer equal to the whole one
however the text is cut."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from raycolo.online.serving.openai_errors import from_validation
from raycolo.online.serving.protocol import ChatCompletionRequest
from raycolo.online.serving.text import chat_prompt_ids, render_plain
from raycolo.online.serving.tool_calls import ToolCallReader, ToolParserKind, ToolReading, join, read_whole
from raycolo.online.serving.tool_protocol import ToolChoiceKind, template_tools
from raycolo.engine.models import ByteTokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
HERMES, LLAMA3, PYTHONIC = ToolParserKind.HERMES, ToolParserKind.LLAMA3_JSON, ToolParserKind.PYTHONIC
MISTRAL, QWEN3_CODER = ToolParserKind.MISTRAL, ToolParserKind.QWEN3_CODER
AUTO, REQUIRED, NAMED = ToolChoiceKind.AUTO, ToolChoiceKind.REQUIRED, ToolChoiceKind.NAMED


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**CHAT, **fields})


def refusal(**fields) -> dict:
    with pytest.raises(ValidationError) as err:
        request(**fields)
    return from_validation(err.value).body()["error"]


@pytest.mark.parametrize("fields, param, words", [
    (dict(tools=[]), "tools", "at least 1"),
    (dict(tools=[WEATHER, WEATHER]), "tools", "two tools are named 'get_weather'"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice", "needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "'nope' is not among the tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice.function", "required"),
    (dict(tools=[WEATHER], tool_choice="maybe"), "tool_choice", "'none', 'auto' or 'required'"),
    (dict(tools=[WEATHER], tool_choice=7), "tool_choice", '"required" or {"type": "function"'),
    (dict(tools=[WEATHER], tool_choice="required", structured_outputs={"regex": "a+"}), "tool_choice",
     "not both"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
          response_format={"type": "json_object"}), "tool_choice", "not both"),
    (dict(tools=[{"type": "function", "function": {"name": "two words"}}]), "tools[0].function.name", "pattern"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}],
          tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", "tool_choice: cannot force a call: "
     "the parameters of 'f': xgrammar would not enforce uniqueItems"),
    (dict(tools=[{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string", "description": "x" * 200} for j in range(30)}}}}
        for i in range(12)], tool_choice="required"), "tool_choice", "longer than the 65,536 characters"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type", "'function'"),
    (dict(tools=[WEATHER], tool_choice="required", min_tokens=2), "min_tokens", "min_tokens"),
    (dict(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]), "messages[0]", "tool_call_id"),
    (dict(messages=[{"role": "tool", "content": "x", "tool_calls": []}]), "messages[0]", "tool_calls"),
    (dict(messages=[{"role": "assistant"}]), "messages[0]", "content"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f"}}]}]), "messages[0].tool_calls[0].function.arguments", "required"),
])
def test_tool_requests_break_vllms_rules_as_400s_naming_the_field(fields, param, words):
    err = refusal(**fields)
    assert err["param"] == param and words in err["message"], err


def test_tool_choice_defaults_and_forced_calls_are_vllms_schemas():
    """The schemas written out from vllm/tool_parsers/utils.py (vLLM 0.32): a named
    function's parameters (an empty object where it has none), and for "required" an
    array of {name, parameters} objects, at most one without parallel calls, $defs hoisted."""
    assert request().tool_kind == ToolChoiceKind.NONE and request().constraint() is None
    assert request(tools=[WEATHER]).tool_kind == AUTO and request(tools=[WEATHER]).constraint() is None
    assert request(tools=[WEATHER], tool_choice="none").constraint() is None
    named = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.constraint().json_schema) == WEATHER["function"]["parameters"]
    empty = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(empty.constraint().json_schema) == {"type": "object", "properties": {}}
    shared = {"type": "function", "function": {"name": "put", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/place"}}, "$defs": {"place": {"type": "string"}}}}}
    forced = request(tools=[WEATHER, TIME, shared], tool_choice="required", parallel_tool_calls=False)
    item = lambda name, params: {"properties": {"name": {"type": "string", "enum": [name]},   # noqa: E731
                                                "parameters": params}, "required": ["name", "parameters"]}
    assert json.loads(forced.constraint().json_schema) == {
        "type": "array", "minItems": 1, "maxItems": 1, "$defs": {"place": {"type": "string"}},
        "items": {"type": "object", "anyOf": [
            item("get_weather", WEATHER["function"]["parameters"]),
            item("get_time", {"type": "object", "properties": {}}),
            item("put", {"type": "object", "properties": {"at": {"$ref": "#/$defs/place"}}})]}}
    assert "maxItems" not in json.loads(request(tools=[WEATHER], tool_choice="required").constraint().json_schema)
    assert shared["function"]["parameters"]["$defs"]        # the request's tool is left as it was


HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "content": "-3 C", "tool_call_id": "call-1"}]


def as_vllm_sends(tools: list[dict]) -> list[dict]:
    """Tools as vLLM 0.32 hands them to the template (``ChatCompletionToolsParam.model_dump()``,
    written out): description and parameters always, null where not given."""
    return [{"type": "function", "function": {"name": t["function"]["name"],
                                              "description": t["function"].get("description"),
                                              "parameters": t["function"].get("parameters")}} for t in tools]


def test_chats_with_tools_render_as_transformers_renders_them(hf_checkpoints):
    """The Qwen2.5-style template (tests/support/hf_checkpoints.py): tools in the system
    turn, a call in the assistant's, the result in a user turn; the template gets each
    call's arguments as an object (vLLM's and transformers' convention)."""
    from transformers import AutoTokenizer

    from raycolo.engine.models import load_tokenizer

    path = hf_checkpoints["qwen2"]
    hf = AutoTokenizer.from_pretrained(path)
    ours = load_tokenizer(str(path))
    body = request(messages=HISTORY, tools=[WEATHER, TIME])
    reference = [dict(m) for m in HISTORY]
    reference[2] = {**HISTORY[2], "content": "", "tool_calls": [{**HISTORY[2]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    want = hf.apply_chat_template(reference, tools=as_vllm_sends([WEATHER, TIME]), add_generation_prompt=True,
                                  tokenize=False)
    assert "<tools>" in want and '"arguments": {"city": "Oslo"}' in want and "<tool_response>\n-3 C" in want
    got = chat_prompt_ids(ours, [m.template_dict() for m in body.messages], tools=template_tools(body.tools))
    assert got == hf(want, add_special_tokens=False)["input_ids"]
    # arguments that are not a JSON object reach the template as {} (vLLM's rule)
    odd = request(messages=[{**HISTORY[2], "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[1, 2"}}]}])
    assert odd.messages[0].template_dict()["tool_calls"][0]["function"]["arguments"] == {}


def test_the_plain_template_shows_tools_and_calls_in_the_hermes_form():
    text = render_plain([m.template_dict() for m in request(messages=HISTORY).messages], tools=as_vllm_sends([TIME]))
    assert text == ('<|tools|>\n[{"type": "function", "function": {"name": "get_time", "description": null, '
                    '"parameters": null}}]\n'
                    "<|system|>\nBe brief.\n<|user|>\nWeather in Oslo?\n"
                    '<|assistant|>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
                    "<|tool|>\n-3 C\n<|assistant|>\n")
    tok = ByteTokenizer(512)
    assert chat_prompt_ids(tok, [("user", "hi")], tools=[TIME]) == tok.encode(render_plain([("user", "hi")],
                                                                                          tools=[TIME]))


def calls_of(answer) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer.tool_calls]


# hand-worked: (parser, text, content, calls)
AUTO_CASES = [
    (HERMES, "It is cold.", "It is cold.", []),
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me look.\n", [("get_weather", {"city": "Oslo"})]),
    (HERMES, '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
             '{"x": [1, "é"]}}</tool_call>', None, [("a", {}), ("b", {"x": [1, "é"]})]),
    (HERMES, "a <tool_call>not json</tool_call>", "a <tool_call>not json</tool_call>", []),
    (HERMES, 'a <tool_call>{"name": "a", "arguments": {', 'a <tool_call>{"name": "a", "arguments": {', []),
    (HERMES, "less < than <tool_ca", "less < than <tool_ca", []),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    (LLAMA3, '<|python_tag|>{"name": "a", "arguments": {"n": 1}}; {"name": "b", "arguments": {}}', None,
     [("a", {"n": 1}), ("b", {})]),
    (LLAMA3, ' {"name": "a"} and more', ' {"name": "a"} and more', []),
    (LLAMA3, '{"city": "Oslo"}', '{"city": "Oslo"}', []),
    (LLAMA3, "The answer is {1}.", "The answer is {1}.", []),
    (LLAMA3, "<|python", "<|python", []),
    (PYTHONIC, '[get_weather(city="Oslo"), get_time()]', None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (PYTHONIC, '<|python_start|>[ab(x=[1, -2.5, {"k": null}], y=True)]<|python_end|>', None,
     [("ab", {"x": [1, -2.5, {"k": None}], "y": True})]),
    (PYTHONIC, "[a.b()]", "[a.b()]", []),                 # vLLM's names: no dots
    (PYTHONIC, "Sure: [f()]", "Sure: [f()]", []),
    (PYTHONIC, "[f(1)]", "[f(1)]", []),                   # positional arguments: no call
    (PYTHONIC, "[f(x=g())]", "[f(x=g())]", []),
    (PYTHONIC, "[1, 2]", "[1, 2]", []),
    (PYTHONIC, "[f(x=1)", "[f(x=1)", []),
    (MISTRAL, "It is cold.", "It is cold.", []),
    # before tokenizer v11: one JSON list; arguments given as text are kept as written (vLLM's)
    (MISTRAL, 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
              '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}]', "Let me look.",
     [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]),
    (MISTRAL, '[TOOL_CALLS] {"name": "f", "arguments": {"n": [1, "é"]}}', None, [("f", {"n": [1, "é"]})]),
    (MISTRAL, '[TOOL_CALLS][TOOL_CALLS][{"name": "f"}]', None, [("f", {})]),
    (MISTRAL, 'a [TOOL_CALLS][{"x": 1}]', 'a [TOOL_CALLS][{"x": 1}]', []),
    # from v11 on: name[ARGS]{...} or name{...}, one per tag; text after the arguments dropped (vLLM's)
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time{}', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (MISTRAL, 'Sure.[TOOL_CALLS]f{"a": 1} and then some', "Sure.", [("f", {"a": 1})]),
    (MISTRAL, "[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
    (MISTRAL, "[TOOL_CALLS]f[ARGS][1, 2]", "[TOOL_CALLS]f[ARGS][1, 2]", []),
    (MISTRAL, '[TOOL_CALLS]f[ARGS]{"a": ', '[TOOL_CALLS]f[ARGS]{"a": ', []),
    (MISTRAL, "less [TOOL_CA", "less [TOOL_CA", []),
    # Qwen3-Coder's XML calls; values typed by WEATHER_SCHEMAS below (hand-worked), text where no schema says
    (QWEN3_CODER, "It is cold.", "It is cold.", []),
    (QWEN3_CODER, "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n"
                  "</tool_call>", "Let me look.\n", [("get_weather", {"city": "Oslo", "days": 3, "metric": True})]),
    (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
                  "<parameter=where>\n{\"lat\": 59.9, \"lon\": 10}\n</parameter>\n<parameter=note>\n two lines\nkept \n"
                  "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     None, [("get_weather", {"days": "three", "where": {"lat": 59.9, "lon": 10}, "note": " two lines\nkept "}),
            ("get_time", {})]),
    (QWEN3_CODER, "<function=get_time><parameter=tz>CET<parameter=fmt>24h</function>", None,
     [("get_time", {"tz": "CET", "fmt": "24h"})]),                      # no <tool_call>; unclosed parameters
    (QWEN3_CODER, "<tool_call>\n<function=not a name>\n</function>", "<tool_call>\n<function=not a name>\n</function>",
     []),
    (QWEN3_CODER, "a <tool_call>\n<function=get_time>\n<parameter=tz>\nCET",
     "a <tool_call>\n<function=get_time>\n<parameter=tz>\nCET", []),
    (QWEN3_CODER, "x < y <tool_ca", "x < y <tool_ca", []),
]
WEATHER_SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "where": {"anyOf": [{"type": "object"}, {"type": "null"}]}, "note": {"type": "string"}}},
    "get_time": {"type": "object", "properties": {"tz": {"type": "string"}}}}


@pytest.mark.parametrize("parser, text, content, calls", AUTO_CASES)
def test_auto_reads_the_calls_of_each_parsers_format(parser, text, content, calls):
    reading = ToolReading(AUTO, parser, schemas=WEATHER_SCHEMAS)
    answer = read_whole(reading.reader(), text)
    assert answer.content == content and calls_of(answer) == calls
    assert reading.finish_reason(answer.called, "length") == ("tool_calls" if calls else "length")


def test_forced_calls_read_the_whole_text():
    named = read_whole(ToolCallReader(NAMED, function="get_weather"), '{"city": "Oslo"}')
    assert named.content == "" and calls_of(named) == [("get_weather", {"city": "Oslo"})]
    required = read_whole(ToolCallReader(REQUIRED), '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", '
                                                    '"parameters": {}}]')
    assert required.content == "" and calls_of(required) == [("a", {"x": 1}), ("b", {})]
    cut = read_whole(ToolCallReader(REQUIRED), '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "par')
    assert calls_of(cut) == [("a", {"x": 1})]
    assert ToolReading(REQUIRED).finish_reason(True, "stop") == "tool_calls"
    assert ToolReading(REQUIRED).finish_reason(True, "length") == "length"
    assert ToolReading(NAMED, function="f").finish_reason(True, "stop") == "stop"     # vLLM's and OpenAI's


def streamed(reader: ToolCallReader, pieces: list[str]) -> tuple[str, list[dict]]:
    deltas = [reader.feed(p) for p in pieces] + [reader.finish()]
    for d in deltas:            # a call's id and name come once, with its first piece
        assert all((c.id is None) == (c.name is None) for c in d.calls)
    return join(deltas)


WHOLE_TEXTS = [t for _, t, _, _ in AUTO_CASES] + ['{"city": "Oslo"}', '[{"name": "a", "parameters": {"x": 1}}]']


@given(st.sampled_from([(AUTO, HERMES), (AUTO, LLAMA3), (AUTO, PYTHONIC), (AUTO, MISTRAL), (AUTO, QWEN3_CODER),
                        (REQUIRED, None), (NAMED, None)]),
       st.sampled_from(WHOLE_TEXTS), st.lists(st.integers(0, 120), max_size=8))
@settings(max_examples=400, deadline=None)
def test_streamed_calls_equal_the_whole_answers_however_the_text_is_cut(mode, text, cuts):
    kind, parser = mode
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    content, calls = streamed(ToolCallReader(kind, parser, "f", schemas=WEATHER_SCHEMAS), pieces)
    whole = read_whole(ToolCallReader(kind, parser, "f", schemas=WEATHER_SCHEMAS), text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
    assert content == (whole.content or "")
    assert len({c["id"] for c in calls}) == len(calls)


def test_hermes_content_never_shows_part_of_a_tag():
    reader = ToolCallReader(AUTO, HERMES)
    shown = [reader.feed(p).content for p in ["Hi <", "tool", "_call>", '{"name": "a", "arguments": {}}', "</tool_call>"]]
    assert shown == ["Hi ", "", "", "", ""]


def test_mistral_content_never_shows_part_of_its_tag_and_its_ids_are_mistrals():
    reader = ToolCallReader(AUTO, MISTRAL)
    shown = [reader.feed(p).content for p in ["Hi [", "TOOL", "_CALLS]", 'f[ARGS]{"x": 1}']]
    assert shown == ["Hi ", "", "", ""]
    last = reader.finish()
    assert [(c.name, c.arguments) for c in last.calls] == [("f", '{"x": 1}')]
    written = read_whole(ToolCallReader(AUTO, MISTRAL), '[TOOL_CALLS]f[ARGS]{"a":1,  "b":[2]} ok').tool_calls
    assert written[0]["function"]["arguments"] == '{"a":1,  "b":[2]}'        # as written, as vLLM keeps it
    ids = [c["id"] for c in read_whole(ToolCallReader(AUTO, MISTRAL), "[TOOL_CALLS]a{}[TOOL_CALLS]b{}").tool_calls]
    assert len(set(ids)) == 2 and all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids)


def test_auto_and_none_take_any_parameters_object_as_openai_does():
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}
    assert request(tools=[odd], tool_choice="none").constraint() is None
    assert request(tools=[odd]).tool_kind == AUTO


def test_hostile_text_is_content_or_no_call_never_an_exception():
    deep = "[" * 100000
    assert request(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
        "function": {"name": "f", "arguments": deep}}]}]).messages[0].template_dict()["tool_calls"][0][
        "function"]["arguments"] == {}
    block = f"<tool_call>{deep}</tool_call>"
    assert read_whole(ToolCallReader(AUTO, HERMES), block).content == block
    assert read_whole(ToolCallReader(AUTO, LLAMA3), "{" + '"a":' * 50000).tool_calls == []
    assert read_whole(ToolCallReader(AUTO, PYTHONIC), "[f(x=" + "[" * 50000 + ")]").tool_calls == []
    assert read_whole(ToolCallReader(AUTO, MISTRAL), "[TOOL_CALLS]" + "[" * 100000).tool_calls == []
    assert read_whole(ToolCallReader(AUTO, MISTRAL), "[TOOL_CALLS]f" + '{"a":' * 50000).tool_calls == []
    deep_xml = "<function=get_weather><parameter=where>" + "[" * 100000 + "</function>"
    assert calls_of(read_whole(ToolCallReader(AUTO, QWEN3_CODER, schemas=WEATHER_SCHEMAS), deep_xml)) == \
        [("get_weather", {"where": "[" * 100000})]          # too deep to decode: the text as it came
    from raycolo.online.serving.xml_tool_calls import typed_value

    for depth in (400, 700, 990, 5000):      # parsed, or too deep to check: the text; never an exception
        nested = "[" * depth + "]" * depth
        assert typed_value(nested, {"type": "integer"}) in (nested, json.loads(nested) if depth < 900 else nested)
    many = "<function=f>" + "<parameter=p>x" * 20000 + "</function>"
    assert calls_of(read_whole(ToolCallReader(AUTO, QWEN3_CODER), many)) == [("f", {"p": "x"})]
    nested = '[{"name": "a", "parameters": ' + '{"x": ' * 5000 + "1" + "}" * 5000 + "}]"
    assert read_whole(ToolCallReader(REQUIRED), nested).tool_calls == []        # too deep to decode: no call


def test_a_reply_found_to_be_content_stays_content_whatever_comes_next():
    for parser, pieces in ((PYTHONIC, ["Sure: ", "[f()]"]), (LLAMA3, ["I think ", '{"name": "a", "arguments": {}}'])):
        content, calls = streamed(ToolCallReader(AUTO, parser), pieces)
        assert (content, calls) == ("".join(pieces), [])


def test_without_parallel_calls_only_the_first_is_read():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    reading = ToolReading(AUTO, HERMES, parallel=False)
    assert calls_of(read_whole(reading.reader(), text)) == [("a", {})]
    _, calls = streamed(reading.reader(), [text[:50], text[50:]])
    assert [c["function"]["name"] for c in calls] == ["a"]


def test_required_without_a_whole_call_keeps_the_generations_finish_reason():
    answer = read_whole(ToolCallReader(REQUIRED), '[{"name": "a", "param')     # a stop string cut it
    assert answer.tool_calls == [] and ToolReading(REQUIRED).finish_reason(answer.called, "stop") == "stop"


def test_required_calls_come_out_whole_however_the_array_is_cut():
    big = [{"name": "a", "parameters": {"s": 'x"}{]' * 50, "n": list(range(300))}}, {"name": "b", "parameters": {}}]
    text = json.dumps(big)
    _, calls = streamed(ToolCallReader(REQUIRED), [text[i:i + 4] for i in range(0, len(text), 4)])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(x["name"], x["parameters"]) for x in big]


@pytest.mark.parametrize("text, schema, value", [
    ("5", {"type": "integer"}, 5), ("5.0", {"type": "number"}, 5), ("2.5", {"type": ["number", "null"]}, 2.5),
    ("null", {"type": ["integer", "null"]}, None), ("1", {"type": "boolean"}, True), ("FALSE", {"type": "bool"}, False),
    ("[1, 2]", {"type": "array"}, [1, 2]), ("[1e999]", {"type": "array"}, "[1e999]"), ("inf", {"type": "number"}, "inf"),
    ("5", {"enum": ["5", "6"]}, "5"), ("5", {"enum": [5, 6]}, 5), ("abc", {"type": "integer"}, "abc"),
    ('{"a": 1}', {"type": "integer"}, {"a": 1}),         # fits none of its types: JSON where it parses (vLLM's)
    ("5", {}, "5"), ("5", "not a schema", "5"), ("x", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "x"),
])
def test_xml_values_are_typed_by_their_schema_as_vllm_types_them(text, schema, value):
    from raycolo.online.serving.xml_tool_calls import typed_value

    got = typed_value(text, schema)
    assert got == value and type(got) is type(value)


def test_qwen3_coder_calls_go_out_as_each_closes_and_auto_lists_every_parser():
    reader = ToolCallReader(AUTO, QWEN3_CODER, schemas=WEATHER_SCHEMAS)
    pieces = ["Hi <", "tool_call>\n<function=get_time>", "<parameter=tz>CET</parameter></function>", "\n</tool_call>"]
    deltas = [reader.feed(p) for p in pieces]
    assert [d.content for d in deltas] == ["Hi ", "", "", ""]
    assert [[(c.name, c.arguments) for c in d.calls] for d in deltas] == [[], [], [("get_time", '{"tz": "CET"}')], []]
    with pytest.raises(Exception) as exc:
        from raycolo.online.serving.answer_reading import chat_reading
        chat_reading(request(tools=[TIME]), None, None)
    assert all(p.value in str(exc.value) for p in ToolParserKind)


def test_a_forced_call_on_a_mistral_deployment_gets_a_mistral_id():
    """Mistral's templates take back only nine-character ids: a forced call's id is the
    deployment parser's too (vLLM reads forced calls with its mistral parser)."""
    from raycolo.online.serving.answer_reading import chat_reading

    weather = request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    reading = chat_reading(weather, MISTRAL, None)
    answer = read_whole(reading.tools.reader(), '{"city": "Oslo"}')
    assert calls_of(answer) == [("get_weather", {"city": "Oslo"})]
    assert len(answer.tool_calls[0]["id"]) == 9 and answer.tool_calls[0]["id"].isalnum()
    hermes = read_whole(chat_reading(weather, HERMES, None).tools.reader(), '{"city": "Oslo"}')
    assert hermes.tool_calls[0]["id"].startswith("chatcmpl-tool-")
