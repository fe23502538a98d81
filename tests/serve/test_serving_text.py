"""The HTTP front's pure parts (raycolo/serving): request validation, error bodies, chat
rendering, incremental text with stop strings, and the shipped Grafana dashboard."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings, strategies as st
from pydantic import ValidationError

from raycolo.engine.models import ByteTokenizer
from raycolo.online.serving.openai_errors import from_validation
from raycolo.online.serving.protocol import ChatCompletionRequest, CompletionRequest, TrainSamplesRequest
from raycolo.online.serving.text import TextStream, encode_completion, render_plain

ROOT = Path(__file__).resolve().parents[2]
TOK = ByteTokenizer(512)


def stream_all(text_ids, stop, include_stop=False):
    s = TextStream(TOK, stop, include_stop=include_stop)
    out = "".join(s.add(t) for t in text_ids)
    return out + s.flush(), s.stopped


def vllm_stop_cut(ids, stop: list[str], include_stop: bool = False):
    """vLLM v1's ``check_stop_strings`` (vllm/v1/engine/detokenizer.py), written out again
    and run as each token's text arrives from the incremental decoder: only an occurrence
    ending in the new characters counts, the first stop string in the order given wins,
    and the text is cut before it (after it with ``include_stop``). None: no stop."""
    from raycolo.generation.detokenize import decoder

    d, text = decoder(TOK), ""
    for t in ids:
        new = d.step(t)
        text += new
        if not new:
            continue
        for s in stop:
            i = text.find(s, 1 - len(new) - len(s))
            if i != -1:
                return text[:i + len(s)] if include_stop else text[:i]
    return None


@given(st.text(max_size=40), st.lists(st.text(min_size=1, max_size=4), max_size=3))
@settings(max_examples=300, deadline=None)
@example("\x80", ["\ufffd"])        # half a character is not a replacement character yet
@example("a\ufffd", ["\ufffd"])     # a real one, last: held back as if incomplete, never a stop
@example("0\xdb0", ["\xdb", "0\xdb0"])   # the short stop completes first (a clean-clone run found it)
def test_streamed_text_equals_the_decoded_text_cut_at_the_first_stop(text, stop):
    """Whatever the byte boundaries, the deltas add up to the decoded text, cut where vLLM
    cuts it (:func:`vllm_stop_cut`): before the stop string, or just after it with
    ``include_stop_str_in_output``; nothing is held back past the end."""
    ids = TOK.encode(text)[1:]
    # a trailing U+FFFD is, to an incremental detokenizer, a character still incomplete: never
    # emitted, so never text and never part of a stop string (vLLM's DecodeStream alike)
    whole = text.rstrip("\ufffd")
    for include in (False, True):
        got, stopped = stream_all(ids, stop, include)
        cut = vllm_stop_cut(ids, stop, include)
        if cut is not None:
            assert stopped is not None and got == cut and (not include or cut.endswith(stopped))
        else:
            assert stopped is None and got == whole


def test_a_stop_string_before_min_tokens_is_never_a_stop_later():
    """vLLM searches only the text each token adds, once ``min_tokens`` allow it: a stop
    string that appeared earlier does not end the text later (it did: "b", then STOP)."""
    for include in (False, True):
        s = TextStream(TOK, ["bc"], include_stop=include)
        out = [s.add(t, check=i >= 2) for i, t in enumerate(TOK.encode("bcxa")[1:])]
        assert "".join(out) + s.flush() == "bcxa" and s.stopped is None
    s = TextStream(TOK, ["x", "ab"])           # the first in the given order wins, as in vLLM
    assert "".join(s.add(t) for t in TOK.encode("cab")[1:]) == "c" and s.stopped == "ab"
    s = TextStream(TOK, ["b", "ab"])
    assert "".join(s.add(t) for t in TOK.encode("cab")[1:]) == "ca" and s.stopped == "b"


def test_with_the_stop_string_included_nothing_is_held_back():
    """``include_stop_str_in_output``: every character goes out as it comes (vLLM holds
    nothing back then either), and the text ends with the stop string."""
    s = TextStream(TOK, ["ab", "END"], include_stop=True)
    deltas = [s.add(t) for t in TOK.encode("xEaNab tail")[1:]]
    assert deltas[:6] == ["x", "E", "a", "N", "a", "b"] and s.stopped == "ab" and "".join(deltas) == "xEaNab"
    held = TextStream(TOK, ["ab", "END"])
    assert [held.add(t) for t in TOK.encode("xEaN")[1:]] == ["", "", "x", "E"]   # two characters held back


def test_no_delta_ever_shows_half_a_character_or_a_stop_prefix():
    ids = TOK.encode("héllo wörld END more")[1:]
    s = TextStream(TOK, ["END"])
    deltas = [s.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "héllo wörld " and s.stopped == "END"


def test_plain_chat_template_and_training_completions():
    assert render_plain([("system", "Be brief."), ("user", "Hi")]) == \
        "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert encode_completion(TOK, "ab") == [ord("a") + 3, ord("b") + 3, TOK.eos_token_id]


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 5.5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"model": "m", "prompt": ["a"] * 65}, "prompt"),                            # a batch of at most 64
    ({"model": "m", "prompt": [[1, 2], []]}, "prompt"),
    ({"model": "m", "prompt": [[1, 2], [3, -1]]}, "prompt"),
    ({"model": "m", "prompt": [[1], ["a"]]}, "prompt[1][0]"),
    ({"model": "m", "prompt": ["a", [1]]}, "prompt[1]"),
    ({"model": "m", "prompt": {"a": 1}}, "prompt"),
    ({"model": "m", "prompt": ["a", "b\udfff"]}, "prompt"),
    ({"model": "m", "prompt": [[1]] * 9, "n": 16}, "prompt"),                   # 144 choices: at most 128
    ({"model": "m", "prompt": [1, -2]}, "prompt"),
    ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),                # 0 only with echo
    ({"model": "m", "prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),   # vLLM's rule
    ({"model": "m", "prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x"}, "model"),
    ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),                    # unsupported: never ignored
    ({"model": "m", "prompt": "a\ud800"}, "prompt"),                             # a lone surrogate
    ({"model": "m", "prompt": ["\ud800"]}, "prompt"),
    ({"model": "m", "prompt": "x", "logit_bias": {"a1": 2}}, "logit_bias"),      # a key that is no token id
    ({"model": "m", "prompt": "x", "logit_bias": {"-1": 2}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"1": 100.5}}, "logit_bias.1"),
    ({"model": "m", "prompt": "x", "logit_bias": {"1": "2"}}, "logit_bias.1"),
    ({"model": "m", "prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "min_p": 1.5}, "min_p"),
    ({"model": "m", "prompt": "x", "min_p": "0.1"}, "min_p"),
    ({"model": "m", "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "n": 17}, "n"),
    # structured outputs: the constraint xgrammar cannot build is refused with its reason
    ({"model": "m", "prompt": "x", "response_format": {"type": "json"}}, "response_format.type"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a",
      "schema": {"type": "object"}, "extra": 1}}}, "response_format.json_schema.extra"),
    ({"model": "m", "prompt": "x", "structured_outputs": {}}, "structured_outputs"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"json": {"type": "object", "properties": {"a": {
      "$ref": "#/$defs/missing"}}}}}, "structured_outputs"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"model": "m", "prompt": "x", "bad_words": ["ok", " "]}, "bad_words"),
    ({"model": "m", "prompt": "x", "bad_words": "word"}, "bad_words"),
    ({"model": "m", "prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"model": "m", "prompt": "x", "allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    # bounds against what xgrammar would take seconds to unroll (a{1000000}: 2 s) or recurse into
    ({"model": "m", "prompt": "x", "structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs.regex"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"grammar": 'root ::= "a"{2,1001}'}},
     "structured_outputs.grammar"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"json": {"type": "string", "pattern": "[a-z]{5000}"}}},
     "structured_outputs.json"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"json": json.loads('{"type": "array", "items": ' * 80 + "{}"
                                                                             + "}" * 80)}}, "structured_outputs.json"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice[1]"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs.structural_tag"),
])
def test_invalid_completion_requests_name_their_parameter(body, param):
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate(body)
    err = from_validation(exc.value)
    assert err.status == 400 and err.param == param and err.message.startswith(param)
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_valid_requests_and_whole_floats():
    r = CompletionRequest.model_validate({"model": "m", "prompt": ["hi"], "max_tokens": 4.0, "stop": "x",
                                          "user": "ignored"})
    assert r.prompts() == ["hi"] and r.max_tokens == 4 and r.stop_list() == ["x"]
    c = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 3})
    assert c.messages[0].text() == "ab" and c.limit() == 3
    r = CompletionRequest.model_validate({"model": "m", "prompt": "x", "min_p": 0.1,
                                          "logit_bias": {"7": -100, "5": 1.5}})
    params = r.sampling_params(8, 0)
    assert params.min_p == 0.1 and params.logit_bias == ((5, 1.5), (7, -100.0))


@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs: give"),
    ({"min_tokens": 2, "structured_outputs": {"choice": ["A"]}}, "min_tokens: not with structured"),
    ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens: not with structured"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "string", "pattern": "a{5000}"}}}}, "response_format: json_schema.schema: pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "$ref": "#/$defs/missing"}}}}, "response_format: json_schema.schema: json: xgrammar cannot"),
    ({"structured_outputs": {"json": {"type": "integer", "multipleOf": 5}}}, "structured_outputs.json: xgrammar "
                                                                            "would not enforce multipleOf"),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "structured_outputs.json: xgrammar"),
    ({"structured_outputs": {"regex": r"a\\{5000}"}}, "structured_outputs.regex"),
])
def test_constraints_that_cannot_hold_are_400s_before_anything_runs(body, message):
    """A constraint the grammar could not keep, or that would fail in the sampling process
    (a 500 or a broken text later), is a 400 naming it now."""
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **body})
    err = from_validation(exc.value)
    assert err.status == 400 and err.message.startswith(message), err.message


def test_response_format_and_structured_outputs_become_one_constraint():
    """OpenAI's ``response_format`` maps onto vLLM's ``structured_outputs`` as vLLM's
    server maps it (``text``: no constraint)."""
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    def params(**body):
        return CompletionRequest.model_validate({"model": "m", "prompt": "x", **body}).sampling_params(8, 0)
    got = params(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
                 ).structured_outputs
    assert got.kind.value == "json" and json.loads(got.json_schema) == schema
    assert list(json.loads(got.json_schema)["properties"]) == ["b", "a"]          # the order the text follows
    assert params(response_format={"type": "text"}).structured_outputs is None
    got = params(response_format={"type": "json_object"}).structured_outputs
    assert got.kind.value == "json_object" and not got.disable_any_whitespace
    got = params(response_format={"type": "text"}, structured_outputs={"regex": "[0-9]+"}).structured_outputs
    assert got.regex == "[0-9]+"
    got = params(structured_outputs={"choice": ["yes", "no"]}).structured_outputs
    assert got.choice == ("yes", "no") and params(temperature=0).plain_greedy
    assert not params(temperature=0, structured_outputs={"choice": ["a"]}).plain_greedy
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                                 "structured_outputs": {"json": json.dumps(schema)}})
    assert chat.sampling_params(8, 0).structured_outputs.json_schema == json.dumps(schema)


@pytest.mark.parametrize("sample", [
    {"prompt": "only"}, {"completion": "only"}, {"prompt": "p", "completion": ""},
    {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
    {"prompt": "p", "completion": "c", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
])
def test_invalid_training_samples_are_refused(sample):
    with pytest.raises(ValidationError):
        TrainSamplesRequest.model_validate({"samples": [sample]})


def test_grafana_dashboard_uses_only_exported_metrics():
    dash = json.loads((ROOT / "docs" / "grafana-raycolo.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    used = set(re.findall(r"ray_(raycolo_[a-z_]+?)(?:_total|_bucket)?\b", exprs))
    defined = set(re.findall(r'"(raycolo_[a-z_]+)"', (ROOT / "raycolo" / "actors" / "serve" / "front_metrics.py").read_text()))
    assert used and used <= defined, used - defined


def test_model_variant_names():
    """A model name selects a variant by a checked integer, never a path: nothing in a
    request can name a file (docs/security.md)."""
    from raycolo.online.serving.protocol import model_variant

    served = "tiny-llama-s"
    assert model_variant(served, served) == "latest"
    assert model_variant(served + "@base", served) == "base"
    assert model_variant(served + "@v0", served) == 0 and model_variant(served + "@v17", served) == 17
    for name in ("gpt-4", served + "@v", served + "@v01", served + "@v-1", served + "@v1.0",
                 served + "@vÙ£", served + "@v" + "9" * 10, served + "@Base", served[:-1], served + "x",
                 served + "@v../../etc/passwd", served + "@v1/../../x", "../" + served, served + "@v1\x00"):
        assert model_variant(name, served) is None, name


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a\ud800b"}, "prompt"),                 # a lone surrogate: no tokenizer encodes it
    ({"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": 5}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"prompt": "x", "model": ""}, "model"),
    ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs"),
])
def test_invalid_tokenize_bodies_name_their_parameter(body, param):
    from raycolo.online.serving.tokenize_protocol import TokenizeBody

    with pytest.raises(ValidationError) as exc:
        TokenizeBody.model_validate(body)
    err = from_validation(exc.value)
    assert err.status == 400 and err.param == param, (err.param, err.message)


def test_tokenize_bodies_take_vllms_defaults():
    from raycolo.online.serving.tokenize_protocol import DetokenizeRequest, TokenizeBody

    prompt = TokenizeBody.model_validate({"prompt": "hi"}).root
    chat = TokenizeBody.model_validate({"messages": [{"role": "user", "content": "hi"}]}).root
    assert prompt.add_special_tokens and not prompt.return_token_strs
    assert chat.add_generation_prompt and not chat.add_special_tokens
    with pytest.raises(ValidationError):
        DetokenizeRequest.model_validate({"tokens": [1, -2]})


def test_byte_tokenizer_token_strings():
    assert ByteTokenizer(512).convert_ids_to_tokens([1, 3 + 0x41, 2, 400]) == ["<s>", "<0x41>", "</s>", "<unused_400>"]


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text"),
])
def test_lone_surrogates_in_chats_are_400s(body, param):
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate(body)     # FastAPI parses with json, which takes lone surrogates
    err = from_validation(exc.value)
    assert err.status == 400 and err.param == param and "Unicode" in err.message, (err.param, err.message)


def test_lone_surrogates_in_training_samples_are_400s():
    with pytest.raises(ValidationError) as exc:
        TrainSamplesRequest.model_validate({"samples": [{"prompt": "a", "completion": "\ud800"}]})
    assert from_validation(exc.value).param == "samples[0].completion"


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("kwargs, message", [
    ({"add_generation_prompt": False}, "not a template variable"),      # the route's own field
    ({"messages": []}, "not a template variable"),
    ({"chat_template": "{{ 1 }}"}, "not a template variable"),          # no template from a request
    ({"tokenize": False}, "not a template variable"),
    ({"not a name": 1}, "not a template variable's name"),
    ({f"v{i}": i for i in range(33)}, "at most 32"),
    ([], "valid dictionary"),
])
def test_chat_template_kwargs_are_template_variables_only(kwargs, message):
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({"model": "m", "messages": HI, "chat_template_kwargs": kwargs})
    err = from_validation(exc.value)
    assert err.status == 400 and err.param == "chat_template_kwargs" and message in err.message, err.message
    ok = ChatCompletionRequest.model_validate({"model": "m", "messages": HI,
                                               "chat_template_kwargs": {"enable_thinking": False, "x": [1, {"y": None}]}})
    assert ok.chat_template_kwargs == {"enable_thinking": False, "x": [1, {"y": None}]}


def test_chat_template_kwargs_render_as_transformers_and_a_refusing_template_is_a_chat_template_error(
        hf_checkpoints):
    """Qwen3's ``enable_thinking: false`` (the fixture's ChatML template writes the empty
    reasoning as Qwen3's does): the ids are transformers' ``apply_chat_template`` with the
    same variables; a template's ``raise_exception`` and a variable it cannot use are a
    ChatTemplateError (the routes' 400), not a 500."""
    from transformers import AutoTokenizer

    from raycolo.engine.models import HFTokenizer, load_tokenizer
    from raycolo.online.serving.text import ChatTemplateError, chat_prompt_ids

    path = hf_checkpoints["qwen2"]
    tok, hf = load_tokenizer(str(path)), AutoTokenizer.from_pretrained(path)
    want = hf.apply_chat_template(HI, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert want.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    got = chat_prompt_ids(tok, HI, template_kwargs={"enable_thinking": False})
    assert got == hf(want, add_special_tokens=False)["input_ids"]
    assert chat_prompt_ids(tok, HI) == chat_prompt_ids(tok, HI, template_kwargs={"enable_thinking": True})
    assert chat_prompt_ids(tok, HI, add_special_tokens=True, template_kwargs={"enable_thinking": False}) == got
    strict = AutoTokenizer.from_pretrained(path)
    strict.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}"
                            "{% endif %}{{ messages[0]['content'] * width }}")
    wrapped = HFTokenizer(strict)
    with pytest.raises(ChatTemplateError, match="a system message first"):
        chat_prompt_ids(wrapped, HI)
    system = [{"role": "system", "content": "s"}]
    with pytest.raises(ChatTemplateError, match="cannot render"):
        chat_prompt_ids(wrapped, system, template_kwargs={"width": {"a": 1}})      # str * dict
    assert chat_prompt_ids(wrapped, system, template_kwargs={"width": 2}) == hf("ss", add_special_tokens=False)["input_ids"]


# -- an assistant's prefill: continue_final_message, and chat's echo ----------------------
PREFILLED = [{"role": "user", "content": "Write a letter about the winter city"},
             {"role": "assistant", "content": "Dear friend, the"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_a_continued_last_message_renders_as_transformers_continues_it(hf_checkpoints, kind):
    """``continue_final_message`` ends the prompt inside the last message: transformers'
    ``apply_chat_template(continue_final_message=True)`` on each template, with the
    tokenizer's special tokens where ``/tokenize`` asks for them."""
    from transformers import AutoTokenizer

    from raycolo.engine.models import load_tokenizer
    from raycolo.online.serving.text import chat_prompt_ids

    path = hf_checkpoints[kind]
    tok, hf = load_tokenizer(str(path)), AutoTokenizer.from_pretrained(path)
    want = hf.apply_chat_template(PREFILLED, continue_final_message=True, tokenize=False)
    assert want.endswith("Dear friend, the")
    ids = chat_prompt_ids(tok, PREFILLED, add_generation_prompt=False, continue_final_message=True)
    assert ids == hf(want, add_special_tokens=False)["input_ids"]
    closed = chat_prompt_ids(tok, PREFILLED, add_generation_prompt=False)
    assert len(closed) > len(ids) and closed[:len(ids)] == ids      # the turn's end is all that differs
    assert chat_prompt_ids(tok, PREFILLED, add_generation_prompt=False, add_special_tokens=True,
                           continue_final_message=True) == hf(want)["input_ids"]


def test_the_plain_template_leaves_a_continued_message_open():
    chat = [("user", "Hi"), ("assistant", "Well,")]
    assert render_plain(chat, False, continue_final_message=True) == "<|user|>\nHi\n<|assistant|>\nWell,"
    assert render_plain(chat, False) == "<|user|>\nHi\n<|assistant|>\nWell,\n"


@pytest.mark.parametrize("fields, param", [
    ({"continue_final_message": True}, "continue_final_message"),       # add_generation_prompt is true by default
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": "yes", "add_generation_prompt": False}, "continue_final_message"),
    ({"add_generation_prompt": 0}, "add_generation_prompt"),
    ({"echo": "true"}, "echo"),
])
def test_chat_rendering_fields_follow_vllms_rule_and_name_their_parameter(fields, param):
    from raycolo.online.serving.tokenize_protocol import TokenizeBody

    bodies = [(ChatCompletionRequest, {"model": "m", "messages": PREFILLED, **fields})]
    if "echo" not in fields:
        bodies.append((TokenizeBody, {"messages": PREFILLED, **fields}))
    for model, body in bodies:
        with pytest.raises(ValidationError) as exc:
            model.model_validate(body)
        err = from_validation(exc.value)
        assert err.status == 400 and err.param == param, (model, err.param, err.message)


def test_a_last_message_without_text_cannot_be_continued():
    called = [PREFILLED[0], {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({"model": "m", "messages": called, **CONTINUE})
    err = from_validation(exc.value)
    assert err.param == "continue_final_message" and "no text" in err.message


def test_chat_echo_shows_the_assistants_last_message_only():
    def echoed(messages, **fields):
        return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields}).echoed()

    assert echoed(PREFILLED, echo=True, **CONTINUE) == "Dear friend, the"
    assert echoed(PREFILLED, echo=True) == "Dear friend, the"          # vLLM's: the last message is the assistant's
    assert echoed(PREFILLED, **CONTINUE) == ""                           # no echo asked
    assert echoed(PREFILLED[:1], echo=True) == ""                        # the user's message is not echoed
    parts = [PREFILLED[0], {"role": "assistant", "content": [{"type": "text", "text": "Dear "},
                                                            {"type": "text", "text": "friend"}]}]
    assert echoed(parts, echo=True) == "Dear friend"
