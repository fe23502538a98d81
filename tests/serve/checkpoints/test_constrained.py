"""Constrained and tool-calling answers of the checkpoints (tests/serve/checkpoints/conftest.py)
under xgrammar, read as vLLM reads them; /tokenize and /detokenize; bad fields as 400s
naming them."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.checkpoint_serving import MAX_NEW, client
from tests.support.function_tools import REQUIRED_SCHEMA, WEATHER, ZONE, complete_calls
from tests.support.hf_checkpoints import load


def test_structured_outputs_equal_generate_under_xgrammar(front):
    """``response_format`` (OpenAI's json_schema, streamed and not) and vLLM's
    ``structured_outputs`` (regex, choice) through the stages: transformers' greedy tokens
    under xgrammar's own logits processor (tests/support/constrained.py), texts that parse."""
    from tests.support.constrained import constrained_reference

    c = client(front)
    _, tok = load(front["path"])
    case = front["cases"][0]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                               "ok": {"type": "boolean"}}, "required": ["city", "ok"]}
    forms = [({"json": schema, "disable_any_whitespace": True},
              dict(extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})),
             ({"json": schema}, dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {
                 "name": "place", "schema": schema}}})),
             ({"regex": r"(yes|no), [a-z]{2,5}\."}, dict(extra_body={"structured_outputs": {"regex": r"(yes|no), [a-z]{2,5}\."}})),
             ({"choice": ["river", "the sea"]}, dict(extra_body={"structured_outputs": {"choice": ["river", "the sea"]}}))]
    for constraint, body in forms:
        ids, reason = constrained_reference(front["path"], case["prompt_ids"], constraint, MAX_NEW)
        want = tok.decode(ids, skip_special_tokens=True)
        if reason == "stop" and "json" in constraint:
            assert set(json.loads(want)) == {"city", "ok"}
        for stream in (False, True) if constraint is forms[0][0] else (False,):      # streamed: one form
            r = c.completions.create(model=front["model"], prompt=case["prompt_ids"], max_tokens=MAX_NEW,
                                     temperature=0, stream=stream, **body)
            text = "".join(ch.choices[0].text for ch in r) if stream else r.choices[0].text
            assert text == want, (constraint, stream)
            if not stream:
                assert r.choices[0].finish_reason == reason and r.usage.completion_tokens == len(ids)
    # chat, json_object: the text is one JSON object
    r = c.chat.completions.create(model=front["model"], messages=[{"role": "user", "content": "Where?"}],
                                  max_tokens=MAX_NEW, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    with httpx.Client(base_url=front["url"], timeout=60) as h:      # a regex xgrammar cannot parse: a 400 naming it
        r = h.post("/v1/completions", json={"model": front["model"], "prompt": "x", "max_tokens": 4,
                                            "structured_outputs": {"regex": "a(b"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    assert "parenthesis" in r.json()["error"]["message"]


HERMES_CALL = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}\n</tool_call>'


def test_tool_calls_are_calls_forced_under_xgrammar_and_read_as_vllm_reads_them(front):
    """Function calling over HTTP: the prompt is transformers' ``apply_chat_template(tools=...)``
    (the Qwen2 template shows them, the Llama 3 one does not); a named function's arguments
    and "required"'s calls are transformers' greedy tokens under xgrammar with vLLM's
    schemas, streamed and not; "auto" reads hermes calls (the Qwen2 deployment's
    serve.tool_call_parser) and is a 400 where none is set."""
    from tests.support.constrained import constrained_reference

    c = client(front)
    _, tok = load(front["path"])
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    tools = [WEATHER, ZONE]
    # the tools as vLLM 0.32 hands them to the template: description (and parameters) null where not given
    sent = [{"type": "function", "function": {"name": t["function"]["name"], "description": None,
                                              "parameters": t["function"]["parameters"]}} for t in tools]
    prompt = tok.apply_chat_template(messages, tools=sent, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert ("get_weather" in tok.decode(prompt)) == (front["kind"] == "qwen2")

    def reference(constraint, max_new=MAX_NEW):
        ids, reason = constrained_reference(front["path"], prompt, constraint, max_new)
        return tok.decode(ids, skip_special_tokens=True), reason, len(ids)

    text, reason, n = reference({"json": WEATHER["function"]["parameters"]})
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=front["model"], messages=messages, tools=tools, tool_choice=named,
                                  max_tokens=MAX_NEW, temperature=0)
    call, = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", text)
    assert call.id.startswith("chatcmpl-tool-") and r.choices[0].message.content == ""
    assert r.choices[0].finish_reason == reason and r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == n
    chunks = list(c.chat.completions.create(model=front["model"], messages=messages, tools=tools, tool_choice=named,
                                            max_tokens=MAX_NEW, temperature=0, stream=True))
    pieces = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or ()]
    assert pieces[0].function.name == "get_weather" and pieces[0].id and all(p.index == 0 for p in pieces)
    assert "".join(p.function.arguments or "" for p in pieces) == text
    assert chunks[-1].choices[0].finish_reason == reason

    text, reason, _ = reference({"json": REQUIRED_SCHEMA}, 48)
    want = [(x["name"], x["parameters"]) for x in complete_calls(text)]
    for stream in (False, True):
        r = c.chat.completions.create(model=front["model"], messages=messages, tools=tools, tool_choice="required",
                                      max_tokens=48, temperature=0, stream=stream)
        if stream:
            r = list(r)
            calls, finish = [tc for ch in r for tc in ch.choices[0].delta.tool_calls or ()], r[-1].choices[0].finish_reason
        else:
            calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == want
        assert finish == ("tool_calls" if reason == "stop" else "length")

    auto = dict(model=front["model"], messages=messages, tools=tools, max_tokens=64, temperature=0,
                extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    if front["kind"] == "llama3":           # no serve.tool_call_parser: "auto" (the default) is a 400
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(**auto)
        assert err.value.body["param"] == "tool_choice" and "tool_call_parser" in err.value.body["message"]
        return
    text, reason, _ = reference({"regex": HERMES_CALL}, 64)
    assert reason == "stop"
    zone = json.loads(text.split("\n")[1])["arguments"]
    for stream in (False, True):
        r = c.chat.completions.create(**auto, stream=stream)
        if stream:
            r = list(r)
            calls = [tc for ch in r for tc in ch.choices[0].delta.tool_calls or ()]
            content = "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)
            finish = r[-1].choices[0].finish_reason
        else:
            calls, content, finish = r.choices[0].message.tool_calls, r.choices[0].message.content, \
                r.choices[0].finish_reason
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_time", zone)]
        assert not content and finish == "tool_calls"
    # the call and its result go back into the chat, rendered as transformers renders them
    turn = [*messages, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_time", "arguments": json.dumps(zone)}}]},
            {"role": "tool", "content": "12:00", "tool_call_id": "call-1"}]
    reference_turn = [*messages, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_time", "arguments": zone}}]}, turn[2]]
    want = tok.apply_chat_template(reference_turn, tools=sent, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    with httpx.Client(base_url=front["url"], timeout=60) as h:
        r = h.post("/tokenize", json={"model": front["model"], "messages": turn, "tools": tools})
    assert r.status_code == 200 and r.json()["tokens"] == want


def test_tokenize_and_detokenize_are_the_tokenizers_and_the_routes_prefill(front):
    """vLLM's /tokenize and /detokenize against the checkpoint's own transformers
    tokenizer: a prompt with and without its specials, a chat as its template renders it
    (and as the chat route counts it), token strings; the ids decode back."""
    tok = load(front["path"])[1]
    text = next(x for x in front["cases"] if isinstance(x["prompt"], str))["prompt"]
    chat = next(x for x in front["cases"] if isinstance(x["prompt"], list))
    with httpx.Client(base_url=front["url"], timeout=60) as h:
        def post(route, body, status=200):
            r = h.post(route, json=body)
            assert r.status_code == status, r.text
            return r.json()

        out = post("/tokenize", {"model": front["model"], "prompt": text, "return_token_strs": True})
        assert out["tokens"] == tok(text)["input_ids"] and out["count"] == len(out["tokens"])
        assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"]) and out["max_model_len"] == 512
        assert post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"] == \
            tok(text, add_special_tokens=False)["input_ids"]
        out = post("/tokenize", {"messages": chat["prompt"]})
        assert out["tokens"] == chat["prompt_ids"] and out["token_strs"] is None
        r = client(front).chat.completions.create(model=front["model"], messages=chat["prompt"], max_tokens=1)
        assert r.usage.prompt_tokens == out["count"]
        no_turn = tok.apply_chat_template(chat["prompt"], add_generation_prompt=False, tokenize=True,
                                          return_dict=False)
        assert post("/tokenize", {"messages": chat["prompt"], "add_generation_prompt": False})["tokens"] == no_turn
        # chat_template_kwargs: the template's variables (Qwen3's enable_thinking; Llama 3's template ignores it)
        off, m = {"enable_thinking": False}, chat["prompt"]
        want = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False, **off)
        assert (want != chat["prompt_ids"]) == (front["kind"] == "qwen2")
        assert post("/tokenize", {"messages": m, "chat_template_kwargs": off})["tokens"] == want
        assert post("/v1/chat/completions", {"model": front["model"], "messages": m, "max_tokens": 1,
                                             "chat_template_kwargs": off})["usage"]["prompt_tokens"] == len(want)
        err = post("/v1/chat/completions", {"model": front["model"], "messages": m,
                                            "chat_template_kwargs": {"tokenize": False}}, 400)["error"]
        assert err["param"] == "chat_template_kwargs" and "tokenize" in err["message"]
        ids = chat["prompt_ids"]
        assert post("/detokenize", {"tokens": ids})["prompt"] == tok.decode(ids)
        # errors: an id past the vocabulary, a model not served here, a field vLLM's bodies lack
        vocab = load(front["path"])[0].config.vocab_size
        assert post("/detokenize", {"tokens": [1, vocab]}, 400)["error"]["param"] == "tokens"
        assert post("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404)["error"]["param"] == "model"
        assert post("/tokenize", {"prompt": "x", "echo": True}, 400)["error"]["param"] == "echo"
        assert post("/tokenize", {"prompt": 5}, 400)["error"]["param"] == "prompt"


def test_unknown_and_bad_fields_are_400_naming_them(front):
    vocab = load(front["path"])[0].config.vocab_size
    with httpx.Client(base_url=front["url"], timeout=60) as h:
        for body, param in [({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"),
                            ({"logit_bias": {str(vocab): 1}}, "logit_bias"), ({"min_p": 2}, "min_p"),
                            ({"allowed_token_ids": [1, vocab]}, "allowed_token_ids"),
                            ({"stop_token_ids": [vocab + 5]}, "stop_token_ids"),
                            ({"repetition_penalty": "x"}, "repetition_penalty"),
                            ({"top_logprobs": 2}, "top_logprobs"),
                            ({"min_tokens": 99, "max_tokens": 4}, "min_tokens")]:
            r = h.post("/v1/chat/completions", json={"model": front["model"], "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}], **body})
            assert r.status_code == 400, body
            err = r.json()["error"]
            if param:
                assert err["param"] == param and param in err["message"]
