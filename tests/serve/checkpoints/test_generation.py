"""Completions and chats of the checkpoints (tests/serve/checkpoints/conftest.py), over HTTP
with the official ``openai`` client and through the controller, against transformers'
``generate()``: text, token ids, finish and stop reasons, usage, batches, n, stop strings,
penalties, log-probabilities and the logit bias, streamed and not."""
from __future__ import annotations

import json

import httpx
import pytest
import ray
import torch

from tests.support.checkpoint_serving import MAX_NEW, client, sse
from tests.support.hf_checkpoints import hf_reference, load


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
            chunks = sse(h, route, body)
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


def test_a_prefilled_assistant_message_is_continued_as_transformers_continues_it(front):
    """vLLM's assistant prefill: ``continue_final_message`` (``add_generation_prompt``
    false) prefills transformers' ``apply_chat_template(continue_final_message=True)``,
    and the answer is ``generate()``'s continuation of it; ``echo`` puts the prefilled text
    before it, streamed (a chunk of its own after the role) or not; ``/tokenize`` gives the
    same ids; the default ``add_generation_prompt`` with it is a 400."""
    messages = [{"role": "user", "content": "Write a letter about the winter city"},
                {"role": "assistant", "content": "Dear friend, the"}]
    tok = load(front["path"])[1]
    want = tok.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    ids, text, reason = hf_reference(front["path"], want, MAX_NEW)
    body = {"model": front["model"], "messages": messages, "max_tokens": MAX_NEW, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    with httpx.Client(base_url=front["url"], timeout=120) as h:
        r = h.post("/v1/chat/completions", json=body).json()
        assert r["usage"]["prompt_tokens"] == len(want) and r["usage"]["completion_tokens"] == len(ids)
        assert r["choices"][0]["message"]["content"] == text and r["choices"][0]["finish_reason"] == reason
        echoed = h.post("/v1/chat/completions", json={**body, "echo": True}).json()
        assert echoed["choices"][0]["message"]["content"] == "Dear friend, the" + text
        chunks = sse(h, "/v1/chat/completions", {**body, "echo": True})
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
        assert deltas[0].get("role") == "assistant" and deltas[1] == {"content": "Dear friend, the"}
        assert "".join(d.get("content") or "" for d in deltas) == "Dear friend, the" + text
        assert h.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                         "continue_final_message": True}).json()["tokens"] == want
        refused = h.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_the_responses_api_answers_as_transformers_and_the_chat_route_do(front):
    """OpenAI's Responses API through the official client: a chat given as ``input`` is
    answered with transformers' greedy text (``incomplete`` where the limit cut it), the
    same streamed as events; a forced function call is the chat route's call."""
    c = client(front)
    for case in [x for x in front["cases"] if isinstance(x["prompt"], list)][:2]:
        r = c.responses.create(model=front["model"], input=case["prompt"], max_output_tokens=MAX_NEW, temperature=0)
        assert r.output_text == case["text"]
        assert r.status == ("incomplete" if case["finish_reason"] == "length" else "completed")
        assert (r.usage.input_tokens, r.usage.output_tokens) == (len(case["prompt_ids"]), len(case["output_ids"]))
        events = list(c.responses.create(model=front["model"], input=case["prompt"], max_output_tokens=MAX_NEW,
                                         temperature=0, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == case["text"]
        assert events[-1].type == f"response.{r.status}" and events[-1].response.output_text == case["text"]
    tool = {"type": "function", "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                           "required": ["city"]}}
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    r = c.responses.create(model=front["model"], input=ask, tools=[tool], max_output_tokens=MAX_NEW, temperature=0,
                           tool_choice={"type": "function", "name": "get_weather"})
    chat = c.chat.completions.create(model=front["model"], messages=ask, max_tokens=MAX_NEW, temperature=0,
                                     tools=[{"type": "function", "function": {k: tool[k] for k in ("name", "parameters")}}],
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(o.name, o.arguments) for o in calls] == \
        [(t.function.name, t.function.arguments) for t in chat.choices[0].message.tool_calls]
    assert "city" in json.loads(calls[0].arguments)


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
    assert len(lp.token_logprobs) == 10
    ranked = [sorted(t.values(), reverse=True) for t in lp.top_logprobs]   # its own token, and the top 2
    assert all(len(t) == 2 + (own < top[1]) for t, own, top in zip(lp.top_logprobs, lp.token_logprobs, ranked))
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
