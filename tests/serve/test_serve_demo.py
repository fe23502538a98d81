"""The HTTP demo (examples/serve_demo.py, part of ``make demo``) teaches the served model:
its core, :func:`teach`, against a deployment with the demo's own settings on a local Ray
cluster, over HTTP with the official ``openai`` client and httpx."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]


def _demo():
    spec = importlib.util.spec_from_file_location("serve_demo", ROOT / "examples" / "serve_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_teaches_the_served_model_a_made_up_answer(tmp_path):
    from raycolo.actors.serve import launch as serve_launch

    demo = _demo()
    config = demo.demo_config(str(ROOT / "examples" / "online.yaml"), root=str(tmp_path),
                              app_name="raycolo-demo-test")
    started, _ = serve_launch.init_ray(config)
    try:
        url = serve_launch.start(config)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = config.served_model_name()
        with httpx.Client(base_url=url, timeout=120) as http:
            out = demo.teach(client, http, model, timeout_s=240)
        base = demo.ask(client, f"{model}@base", demo.QUESTION, len(demo.ANSWER.encode()) + 4)
    finally:
        serve_launch.stop(config, started)
    print(f"before {out['before']!r}, after {out['after']!r}, loss {out['loss_before']:.2f} -> "
          f"{out['loss_after']:.2f}, {out['seconds']:.1f} s")
    assert out["before"] != demo.ANSWER and demo.ANSWER.strip() not in out["before"]
    assert out["after"].startswith(demo.ANSWER)
    assert out["loss_after"] < out["loss_before"]
    assert base == out["before"]          # the base model (no adapter) still answers as before
