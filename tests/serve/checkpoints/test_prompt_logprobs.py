"""Prompt log-probabilities over HTTP (tests/serve/checkpoints/conftest.py), against
transformers' logits over the whole prompt: OpenAI's ``echo`` with ``logprobs`` as an eval
harness sends it (lm-eval's log-likelihood requests: token ids, ``max_tokens`` 0 or 1,
greedy), vLLM's ``prompt_logprobs`` on completions and chats, and echo streamed."""
from __future__ import annotations

import httpx
import torch

from tests.support.checkpoint_serving import sse
from tests.support.hf_checkpoints import chat_prompt_ids, load


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False).replace("\ufffd", "")


def _rank_fits(row: torch.Tensor, token: int, rank: int) -> bool:
    """vLLM's rank (tokens at least as likely count ahead), up to float32 near-ties."""
    v = row[token]
    return int((row > v + 1e-4).sum()) + 1 <= rank <= int((row >= v - 1e-4).sum())


def test_echo_and_prompt_logprobs_are_transformers_log_likelihoods(front):
    model, tok = load(front["path"])
    case = next(x for x in front["cases"] if x["finish_reason"] == "length")
    ids = case["prompt_ids"] + case["output_ids"][:3]             # a context and its continuation
    ref = _reference(model, ids)
    with httpx.Client(base_url=front["url"], timeout=120) as h:
        def post(route: str, **body) -> dict:
            r = h.post(route, json={"model": front["model"], "temperature": 0, **body})
            assert r.status_code == 200, r.text
            return r.json()

        for max_tokens in (0, 1):        # lm-eval's request: the prompt alone, or with the next token
            a = post("/v1/completions", prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens)
            c, lp = a["choices"][0], a["choices"][0]["logprobs"]
            assert c["text"].startswith(tok.decode(ids, skip_special_tokens=False))
            assert len(lp["tokens"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
            assert lp["top_logprobs"][0] is None
            for j in range(1, len(ids)):
                assert abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]])) < 1e-3
                top = lp["top_logprobs"][j]           # its own token and the most likely one
                assert lp["tokens"][j] in top and (len(top) == 1 + (ids[j] != int(ref[j - 1].argmax())) or "" in top)
            # each token's text (vLLM's: a split character shows on its last byte, a byte that ends
            # no character shows nothing) joins to the prompt's
            assert "".join(lp["tokens"][:len(ids)]) == _text(tok, ids)
            if max_tokens:                # the greedy continuation: the case's next output token
                assert lp["tokens"][-1] == tok.decode([case["output_ids"][3]])
            assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == len(ids)
        # vLLM's prompt_logprobs on a text prompt: each token's own entry first, with its rank
        text_ids = case["prompt_ids"]
        a = post("/v1/completions", prompt=case["prompt"], max_tokens=2, prompt_logprobs=2)
        got, ref = a["choices"][0]["prompt_logprobs"], _reference(model, text_ids)
        assert a["choices"][0]["logprobs"] is None                # no echo, no logprobs: the prompt's alone
        assert got[0] is None and len(got) == len(text_ids) == a["usage"]["prompt_tokens"]
        for j in range(1, len(text_ids)):
            entries = list(got[j].items())
            own, top = entries[0], torch.topk(ref[j - 1], 2).indices.tolist()
            assert own[0] == str(text_ids[j]) and _rank_fits(ref[j - 1], text_ids[j], own[1]["rank"])
            assert abs(own[1]["logprob"] - float(ref[j - 1, text_ids[j]])) < 1e-3
            assert {int(t) for t, _ in entries} == {text_ids[j], *top}
            assert [e["rank"] for _, e in entries[1:]] == [r for r, t in enumerate(top, 1) if t != text_ids[j]]
        shown = "".join(next(iter(got[j].values()))["decoded_token"] for j in range(1, len(text_ids)))
        assert shown == _text(tok, text_ids[1:])
        # a chat's, at the answer's top level (k = 0: each token's own entry alone)
        messages = [{"role": "user", "content": "Where is the river?"}]
        chat_ids = chat_prompt_ids(front["path"], messages)
        a = post("/v1/chat/completions", messages=messages, max_tokens=2, prompt_logprobs=0)
        ref = _reference(model, chat_ids)
        assert len(a["prompt_logprobs"]) == len(chat_ids) and a["prompt_logprobs"][0] is None
        for j, entry in enumerate(a["prompt_logprobs"][1:], 1):
            assert list(entry) == [str(chat_ids[j])]
            assert abs(entry[str(chat_ids[j])]["logprob"] - float(ref[j - 1, chat_ids[j]])) < 1e-3
        # echo streamed: the first text chunk starts with the prompt, its log-probabilities first
        plain = post("/v1/completions", prompt=case["prompt"], max_tokens=4)["choices"][0]["text"]
        chunks = sse(h, "/v1/completions", {"model": front["model"], "prompt": case["prompt"], "max_tokens": 4,
                                            "temperature": 0, "echo": True, "logprobs": 0})
        texts = [ch["choices"][0]["text"] for ch in chunks if ch["choices"] and ch["choices"][0]["text"]]
        assert texts[0].startswith(case["prompt"]) and "".join(texts) == case["prompt"] + plain
        lps = [ch["choices"][0]["logprobs"] for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]]
        tokens = [t for x in lps for t in x["token_logprobs"]]
        assert tokens[0] is None and len(tokens) == len(text_ids) + 4 and None not in tokens[1:]
