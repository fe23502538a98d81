"""Chat training samples over HTTP (tests/serve/checkpoints/conftest.py). This module's name
sorts last in its package on purpose: the sample it posts trains the adapter, after which
the served model is no longer the checkpoint every other module compares with."""
from __future__ import annotations

import httpx
import ray

from tests.support.hf_checkpoints import load


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
