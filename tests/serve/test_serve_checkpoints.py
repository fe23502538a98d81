"""Serving checkpoints as users have them, over HTTP with the official ``openai`` client and
through the online controller (the live runtime's API), against transformers'
``generate()`` on the same directory (tests/support/hf_checkpoints.py): token ids, text, finish
reasons and ``usage`` as vLLM counts it (every generated token, the EOS included), greedy,
streamed and not; chats rendered once with the checkpoint's template (one BOS).

One deployment per checkpoint kind (1 node x 2 stages): the Llama 3-style one, whose
<|eot_id|> is an EOS only through generation_config.json (node loop, tokens through the
controller, a chunk per 5 tokens), and the Qwen2 ChatML one (every op through the controller).
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import ray
import torch

from tests.support.hf_checkpoints import greedy_cases, load
from tests.support.function_tools import REQUIRED_SCHEMA, WEATHER, ZONE, complete_calls
from tests.support.online_checks import data_plane, free_port

MAX_NEW = 24
KINDS = ["llama3", "qwen2"]
STREAM_INTERVAL = 5


@pytest.fixture(scope="module", params=KINDS)
def front(request, hf_checkpoints, tmp_path_factory):
    from raycolo.actors.serve import launch as serve_launch
    from raycolo.online.config import parse_online_config

    kind = request.param
    path = hf_checkpoints[kind]
    out = tmp_path_factory.mktemp(f"serve-{kind}")
    config = parse_online_config({
        "model_loading_config": {"model_id": str(path), "dtype": "float32"},
        "nodes": 1, "stages": 2, "policy": "lemix",
        "lemix": {"slo_ms": 5000, "max_batch": 8, "profile_warmup": 2},
        "lora": {"rank": 4, "alpha": 8, "micro_batch": 2},
        # the Qwen2 one with every op through the controller (the other data plane)
        "stage": {"cpus_per_worker": 0.5, "cpu_threads": 1, "kv_cache_tokens": 512,
                  **({"data_plane": "controller"} if kind == "qwen2" else {}), **data_plane()},
        "max_tokens": 16,
        "sample_store": str(out / "samples"), "storage_path": str(out / "checkpoints"),
        # the Llama 3 one streams a chunk per STREAM_INTERVAL tokens (vLLM's --stream-interval),
        # its tokens coming through the controller's reports rather than the token inbox
        # (tests/serve/deployment/ covers the inbox)
        "serve": {"port": free_port(), "app_name": f"raycolo-{kind}",
                  **({"stream_interval": STREAM_INTERVAL, "token_path": "controller"} if kind == "llama3"
                     else {"tool_call_parser": "hermes"})},
    })
    started, _ = serve_launch.init_ray(config, metrics_port=free_port())
    try:
        url = serve_launch.start(config)
        yield {"kind": kind, "path": path, "url": url, "config": config,
               "model": config.served_model_name(), "cases": greedy_cases(path, MAX_NEW, n=6)}
    finally:
        serve_launch.stop(config, started)


def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=front["url"] + "/v1", api_key="none", max_retries=0, timeout=120)


def test_completions_equal_transformers_streamed_or_not(front):
    from raycolo.actors.serve.launch import controller_handle

    c = client(front)
    cases = [x for x in front["cases"] if isinstance(x["prompt"], str)]
    assert cases
    before = ray.get(controller_handle(front["config"]).stats.remote())["front_events"]
    for case in cases:
        r = c.completions.create(model=front["model"], prompt=case["prompt"], max_tokens=MAX_NEW, temperature=0)
        choice = r.choices[0]
        assert choice.text == case["text"], case["prompt"]
        assert choice.finish_reason == case["finish_reason"]
        assert r.usage.prompt_tokens == len(case["prompt_ids"])
        assert r.usage.completion_tokens == len(case["output_ids"])      # the EOS counts, as in vLLM
        chunks = list(c.completions.create(model=front["model"], prompt=case["prompt"], max_tokens=MAX_NEW,
                                           temperature=0, stream=True, stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == case["text"]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] \
            == [case["finish_reason"]]
        assert chunks[-1].usage.completion_tokens == len(case["output_ids"])
        every = front["config"].serve.stream_interval
        if every > 1:   # the first tokens, then one chunk per ``every`` tokens, then the rest
            texts = [ch for ch in chunks if ch.choices and ch.choices[0].text]
            assert len(texts) <= 2 + (len(case["output_ids"]) - 1) // every, len(texts)
    events = ray.get(controller_handle(front["config"]).stats.remote())["front_events"] - before
    # every token through the controller (its data plane, or its token path): an event each
    direct = front["config"].stage.data_plane == "node" and front["config"].serve.token_path == "direct"
    assert events == 0 if direct else events >= sum(len(x["output_ids"]) for x in cases), events


def _sse(h, route: str, body: dict) -> list[dict]:
    with h.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_a_batch_of_prompts_gives_each_its_choices_as_vllm_numbers_them(front):
    """Texts or token-id lists: prompt p's choice j at index p * n + j, transformers' greedy
    output for its own prompt, with its own prompt_token_ids; usage counts each prompt once;
    streamed, chunks carry their choice's index; errors name the prompt at fault."""
    cases = [x for x in front["cases"] if isinstance(x["prompt"], str)][:2]
    want = [(i, x["text"], x["output_ids"], x["prompt_ids"], x["finish_reason"]) for i, x in enumerate(cases)
            for _ in range(2)]
    with httpx.Client(base_url=front["url"], timeout=120) as h:
        for prompt in ([x["prompt"] for x in cases], [x["prompt_ids"] for x in cases]):
            a = h.post("/v1/completions", json={"model": front["model"], "prompt": prompt, "max_tokens": MAX_NEW,
                                                "temperature": 0, "n": 2, "return_token_ids": True}).json()
            assert [(c["index"] // 2, c["text"], c["token_ids"], c["prompt_token_ids"], c["finish_reason"])
                    for c in a["choices"]] == want and [c["index"] for c in a["choices"]] == [0, 1, 2, 3]
            assert (a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"]) == \
                (sum(len(x["prompt_ids"]) for x in cases), 2 * sum(len(x["output_ids"]) for x in cases))
        for second, words in [("river " * 600, "prompt 1 has"), ("", "prompt 1: the prompt is empty")]:
            r = h.post("/v1/completions", json={"model": front["model"], "prompt": [cases[0]["prompt"], second],
                                                "max_tokens": 4})
            if second == "" and front["kind"] == "llama3":       # its BOS: never empty
                assert r.status_code == 200, r.text
            else:
                assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and \
                    words in r.json()["error"]["message"], r.text
    texts = {}
    for chunk in client(front).completions.create(model=front["model"], prompt=[x["prompt"] for x in cases],
                                                  max_tokens=MAX_NEW, temperature=0, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {0: cases[0]["text"], 1: cases[1]["text"]}


def test_token_ids_and_stop_reason_as_vllm_returns_them(front):
    """vLLM's ``return_token_ids`` (the prompt's ids, and each choice's generated ids with the
    stop token; streamed: the prompt's with the first chunk, each chunk's own) and
    ``stop_reason`` (a stop token other than the tokenizer's EOS: its id; a stop string: the
    string; the EOS or the length: null), against transformers' ids."""
    _, tok = load(front["path"])
    cases = front["cases"]
    picked = {id(c): c for c in [next(c for c in cases if c["finish_reason"] == reason) for reason in ("stop", "length")]
              + [c for c in cases if not isinstance(c["prompt"], str)][:1]}     # a stop, a length, a chat
    with httpx.Client(base_url=front["url"], timeout=120) as h:
        for case in picked.values():
            chat = not isinstance(case["prompt"], str)
            route = "/v1/chat/completions" if chat else "/v1/completions"
            body = {"model": front["model"], "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True,
                    **({"messages": case["prompt"]} if chat else {"prompt": case["prompt"]})}
            want_reason = (None if case["finish_reason"] == "length" or case["output_ids"][-1] == tok.eos_token_id
                           else case["output_ids"][-1])
            r = h.post(route, json=body).json()
            ch = r["choices"][0]
            assert ch["token_ids"] == case["output_ids"] and ch["stop_reason"] == want_reason
            assert (r if chat else ch)["prompt_token_ids"] == case["prompt_ids"]
            chunks = _sse(h, route, body)
            choices = [c["choices"][0] for c in chunks]
            assert sum((c.get("token_ids", []) for c in choices), []) == case["output_ids"]
            prompts = [c["prompt_token_ids"] for c in (chunks if chat else choices) if "prompt_token_ids" in c]
            assert prompts == [case["prompt_ids"]]
            assert [c["stop_reason"] for c in choices if c["finish_reason"]] == [want_reason]
        case = next(x for x in front["cases"] if x["finish_reason"] == "length" and isinstance(x["prompt"], str))
        stop = case["text"][len(case["text"]) // 2:len(case["text"]) // 2 + 2]
        r = h.post("/v1/completions", json={"model": front["model"], "prompt": case["prompt"], "max_tokens": MAX_NEW,
                                            "temperature": 0, "stop": [stop], "logprobs": 1,
                                            "return_tokens_as_token_ids": True}).json()["choices"][0]
        assert r["stop_reason"] == stop and "token_ids" not in r
        assert r["logprobs"]["tokens"] == [f"token_id:{t}" for t in case["output_ids"][:len(r["logprobs"]["tokens"])]]
    assert any(c["finish_reason"] == "stop" and c["output_ids"][-1] != tok.eos_token_id for c in front["cases"]) \
        or front["kind"] != "llama3"          # Llama 3 stops at <|eot_id|>: an id, as vLLM reports it


def test_token_id_prompts_and_the_controller_give_transformers_ids(front):
    """The online runtime's own API (what raycolo online run drives): the generated ids,
    the stop token included, and the finish reason."""
    from raycolo.actors.serve.launch import controller_handle

    controller = controller_handle(front["config"])
    for case in front["cases"]:
        got = ray.get(controller.result.remote(ray.get(controller.submit.remote(case["prompt_ids"], MAX_NEW))),
                      timeout=120)
        assert got["tokens"] == case["output_ids"] and got["finish_reason"] == case["finish_reason"]
    case = front["cases"][0]
    r = client(front).completions.create(model=front["model"], prompt=case["prompt_ids"], max_tokens=MAX_NEW,
                                         temperature=0)
    assert r.choices[0].text == case["text"] and r.usage.completion_tokens == len(case["output_ids"])


def test_chat_renders_the_template_once_and_equals_transformers(front):
    c = client(front)
    cases = [x for x in front["cases"] if isinstance(x["prompt"], list)]
    assert cases
    bos = load(front["path"])[1].bos_token_id
    for case in cases:
        if bos is not None:
            assert case["prompt_ids"].count(bos) == 1
        r = c.chat.completions.create(model=front["model"], messages=case["prompt"], max_tokens=MAX_NEW,
                                      temperature=0)
        assert r.usage.prompt_tokens == len(case["prompt_ids"])          # one BOS, not two
        assert r.choices[0].message.content == case["text"]
        assert r.choices[0].finish_reason == case["finish_reason"]
        assert r.usage.completion_tokens == len(case["output_ids"])
        chunks = list(c.chat.completions.create(model=front["model"], messages=case["prompt"], max_tokens=MAX_NEW,
                                                temperature=0, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == case["text"]


def test_stop_strings_penalties_logprobs_and_n(front):
    c = client(front)
    case = next(x for x in front["cases"] if x["finish_reason"] == "length" and isinstance(x["prompt"], str))
    text = case["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    r = c.completions.create(model=front["model"], prompt=case["prompt"], max_tokens=MAX_NEW, temperature=0,
                             stop=[stop])
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    for stream in (False, True):         # vLLM's include_stop_str_in_output: the text ends after it
        got = c.completions.create(model=front["model"], prompt=case["prompt"], max_tokens=MAX_NEW, temperature=0,
                                   stop=[stop], stream=stream, extra_body={"include_stop_str_in_output": True})
        got = "".join(ch.choices[0].text for ch in got) if stream else got.choices[0].text
        assert got == text[:text.index(stop) + len(stop)]
    # repetition_penalty, as vLLM's load generator sends it: transformers applies the same rule
    model, tok = load(front["path"])
    with torch.no_grad():
        ref = model.generate(torch.tensor([case["prompt_ids"]]), do_sample=False, max_new_tokens=10,
                             repetition_penalty=1.4, eos_token_id=None, pad_token_id=0)[0, len(case["prompt_ids"]):]
    r = c.completions.create(model=front["model"], prompt=case["prompt_ids"], max_tokens=10, temperature=0,
                             extra_body={"repetition_penalty": 1.4, "ignore_eos": True}, logprobs=2)
    assert tok.decode(ref.tolist(), skip_special_tokens=True).startswith(r.choices[0].text)
    assert len(r.usage and r.choices[0].text) >= 0
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 10 and all(len(t) == 2 for t in lp.top_logprobs)
    with torch.no_grad():
        logits = model(torch.tensor([case["prompt_ids"]])).logits[0, -1].float()
    assert lp.token_logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[ref[0]]), abs=1e-3)
    # n choices, sampled with seed + i; usage sums them
    r = c.completions.create(model=front["model"], prompt=case["prompt"], max_tokens=6, temperature=1.0, seed=5,
                             n=3, extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    again = c.completions.create(model=front["model"], prompt=case["prompt"], max_tokens=6, temperature=1.0, seed=5,
                                 extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text          # seeded: the same draw
    # streamed, the same n choices: their chunks under their index, usage over all of them
    chunks = list(c.completions.create(model=front["model"], prompt=case["prompt"], max_tokens=6, temperature=1.0,
                                       seed=5, n=3, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    texts = ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i)
             for i in range(3)]
    assert texts == [ch.text for ch in r.choices] and chunks[-1].usage.completion_tokens == 18


def test_logit_bias_as_transformers_applies_it_and_min_p_one_is_greedy(front):
    """``logit_bias`` against generate()'s ``sequence_bias`` (transformers' own processor):
    the greedy tokens with the first one banned and another token pushed up. ``min_p`` 1
    leaves only the most likely token, so a seeded draw at temperature 1 is the greedy text."""
    c = client(front)
    case = next(x for x in front["cases"] if x["finish_reason"] == "length" and isinstance(x["prompt"], str))
    model, tok = load(front["path"])
    banned, pushed = case["output_ids"][0], 50
    with torch.no_grad():
        ref = model.generate(torch.tensor([case["prompt_ids"]]), do_sample=False, max_new_tokens=10,
                             sequence_bias={(banned,): -100.0, (pushed,): 2.5}, eos_token_id=None,
                             pad_token_id=0)[0, len(case["prompt_ids"]):].tolist()
    assert banned not in ref
    r = c.completions.create(model=front["model"], prompt=case["prompt_ids"], max_tokens=10, temperature=0,
                             logit_bias={str(banned): -100, str(pushed): 2.5}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    r = c.completions.create(model=front["model"], prompt=case["prompt"], max_tokens=MAX_NEW, temperature=1.0,
                             seed=3, extra_body={"min_p": 1.0})
    assert r.choices[0].text == case["text"]
    # vLLM's bad_words through the last stage: generate()'s bad_words_ids with vLLM's sequences
    from tests.support.constrained import banned_word, vllm_sequences

    word = banned_word(tok, case["output_ids"])
    with torch.no_grad():
        ref = model.generate(torch.tensor([case["prompt_ids"]]), do_sample=False, max_new_tokens=10,
                             bad_words_ids=vllm_sequences(tok, [word]), eos_token_id=None,
                             pad_token_id=0)[0, len(case["prompt_ids"]):].tolist()
    r = c.completions.create(model=front["model"], prompt=case["prompt_ids"], max_tokens=10, temperature=0,
                             extra_body={"ignore_eos": True, "bad_words": [word]})
    assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True) != case["text"]


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
                            ({"top_logprobs": 2}, None),
                            ({"min_tokens": 99, "max_tokens": 4}, "min_tokens")]:
            r = h.post("/v1/chat/completions", json={"model": front["model"], "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}], **body})
            assert r.status_code == 400, body
            err = r.json()["error"]
            if param:
                assert err["param"] == param and param in err["message"]


def test_chat_training_samples_end_with_the_end_of_turn_token(front):
    """A chat sample is stored as the template renders it: the completion ends with the
    template's end-of-turn token, not the tokenizer's EOS."""
    from raycolo.actors.serve.launch import controller_handle

    with httpx.Client(base_url=front["url"], timeout=60) as h:
        r = h.post("/v1/train_samples", json={"samples": [{"messages": [
            {"role": "user", "content": "Where is the river?"}, {"role": "assistant", "content": "By the stone."}]}]})
        assert r.status_code == 200, r.text
        seq = r.json()["ids"][0]
    controller = controller_handle(front["config"])
    prompt, completion = ray.get(controller.stored_samples.remote([seq]), timeout=60)[0]
    tok = load(front["path"])[1]
    end = "<|eot_id|>" if front["kind"] == "llama3" else "<|im_end|>"
    assert completion[-1] == tok.convert_tokens_to_ids(end)
    assert prompt.count(tok.bos_token_id) == (1 if tok.bos_token_id is not None else 0)
