"""Serving checkpoints as users have them, over HTTP with the official ``openai`` client and
through the online controller (the live runtime's API), against transformers'
``generate()`` on the same directory (tests/support/hf_checkpoints.py): token ids, text, finish
reasons and ``usage`` as vLLM counts it (every generated token, the EOS included), greedy,
streamed and not; chats rendered once with the checkpoint's template (one BOS).

One deployment per checkpoint kind for every module of this package (1 node x 2 stages): the Llama 3-style one, whose
<|eot_id|> is an EOS only through generation_config.json (node loop, tokens through the
controller, a chunk per 5 tokens), and the Qwen2 ChatML one (every op through the controller).
"""
from __future__ import annotations

import pytest

from tests.support.checkpoint_serving import KINDS, MAX_NEW, STREAM_INTERVAL
from tests.support.hf_checkpoints import greedy_cases
from tests.support.online_checks import data_plane, free_port


@pytest.fixture(scope="package", params=KINDS)
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
