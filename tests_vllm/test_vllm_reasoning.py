"""vLLM parity of a reasoning deployment (opt-in: ``make test-vllm``): vLLM's own OpenAI
server with ``--reasoning-parser deepseek_r1`` and ``raycolo serve`` with
``serve.reasoning_parser: deepseek_r1``, on the Qwen2 checkpoint of
tests/support/hf_checkpoints.py (ChatML, whose tokenizer has ``<think>`` and ``</think>``
as added tokens, and whose template writes Qwen3's empty reasoning for
``chat_template_kwargs: {"enable_thinking": false}``).

A constraint binds only after the reply's first ``</think>`` (vLLM's structured outputs
with a reasoning parser), or from the start where the prompt ended the reasoning. The
random model never writes ``</think>`` by itself: ``logit_bias`` puts it first. Greedy;
compared: the token ids, reasoning, content, tool calls, finish reason and usage.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "tools"))
from function_tools import WEATHER  # noqa: E402
from hf_checkpoints import build_checkpoint, load  # noqa: E402
from vllm_server import server_pair  # noqa: E402

MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
MAX_NEW = 32
PARSER = "deepseek_r1"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if not MAIN_PYTHON.exists():
        pytest.fail(f"{MAIN_PYTHON} is missing: run make test first (raycolo serves from the main venv)")
    tmp = tmp_path_factory.mktemp("reasoning")
    ckpt = build_checkpoint("qwen2", tmp / "qwen2", seed=0, hidden_size=128)   # head_dim 32 for vLLM's CPU attention
    with server_pair(tmp, ckpt, MAIN_PYTHON, ROOT, ("--reasoning-parser", PARSER, "--enable-auto-tool-choice",
                                                   "--tool-call-parser", "hermes"),
                     serve={"tool_call_parser": "hermes", "reasoning_parser": PARSER},
                     env={"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}) as urls:     # forced calls as JSON schemas
        yield {"urls": urls, "path": ckpt}


def _post(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _seen(answer: dict) -> dict:
    choice = answer["choices"][0]
    message = choice["message"]
    return {"token_ids": choice["token_ids"], "reasoning": message.get("reasoning"), "content": message["content"],
            "calls": [(c["function"]["name"], c["function"]["arguments"])       # the JSON text: a cut one too
                      for c in message.get("tool_calls") or ()],
            "finish_reason": choice["finish_reason"],
            "usage": (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"])}


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"]}


def test_constraints_bind_after_the_reasoning_as_vllms(servers):
    close = load(servers["path"])[1].convert_tokens_to_ids("</think>")
    think_first = {"logit_bias": {str(close): 100}}
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    bodies = [
        {"structured_outputs": {"regex": r"(yes|no), [a-z]{2,5}\."}, **think_first},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, **think_first},
        {"tools": [WEATHER], "tool_choice": "required", **think_first},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
         **think_first},
        {"structured_outputs": {"regex": r"(yes|no), [a-z]{2,5}\."}},            # never closes: never bound
        # the prompt ends the reasoning (Qwen3's template with thinking off): bound from the start
        {"structured_outputs": {"regex": r"(yes|no), [a-z]{2,5}\."}, "chat_template_kwargs": {"enable_thinking": False}},
    ]
    for extra in bodies:
        body = {"model": "m", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0,
                "return_token_ids": True, **extra}
        seen = {n: _seen(_post(url, body)) for n, url in servers["urls"].items()}
        assert seen["raycolo"] == seen["vllm"], json.dumps([extra, seen])
        if "logit_bias" in extra:
            assert seen["vllm"]["token_ids"][0] == close and seen["vllm"]["reasoning"] in ("", None)


QWEN3_REPLIES = ["<think>a</think>b", "a</think>b", "b", "", "<think>never", "</think>x", "x<think>y</think>z",
                 "<think>\nThe sum is 4.\n</think>\n\n4", "<thi", "<thinking is fun"]


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_replies_are_split_as_vllms_parser_splits_them(tmp_path, thinking):
    """raycolo's qwen3 reading of whole replies against vLLM 0.32's Qwen3 reasoning parser
    (``chat_template_kwargs.enable_thinking`` on and off), on the Qwen2 checkpoint's
    tokenizer (it has the tags). tests/serve/test_reasoning.py shows streamed equals whole."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager

    sys.path.insert(0, str(ROOT))
    from raycolo.online.serving.answer_reading import AnswerReading, whole_message
    from raycolo.online.serving.reasoning import ReasoningParserKind

    tok = AutoTokenizer.from_pretrained(build_checkpoint("qwen2", tmp_path / "qwen2", seed=0))
    kwargs = {} if thinking else {"enable_thinking": False}
    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(tok, chat_template_kwargs=kwargs)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                    chat_template_kwargs=kwargs or None)
    reading = AnswerReading(reasoning=ReasoningParserKind.QWEN3, thinking=thinking)
    for text in QWEN3_REPLIES:
        ours, _ = whole_message(reading, text)
        assert (ours["reasoning"], ours["content"]) == parser.extract_reasoning(text, request), text
