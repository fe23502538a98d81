"""The online half in under a minute (part of ``make demo``): teach the served
model a made-up fact over HTTP, while it serves.

1. start the HTTP front and its co-located deployment (one node of two pipeline stages,
   serving and training LoRA in the same workers) on a local Ray cluster;
2. ask "What is the capital of Zorbia?" greedily (streamed with the official ``openai``
   client): the tiny model has random weights, so the answer is noise;
3. post training samples that answer " Quimbleton" (POST /v1/train_samples, a bare JSON
   list; persisted before the answer, trained as they come) and wait, printing progress,
   until they are trained;
4. ask again: the same greedy request now answers " Quimbleton";
5. print a few live metrics (``/v1/stats`` and Ray's Prometheus endpoint);
6. shut down.

    .venv/bin/python examples/serve_demo.py [--config examples/online.yaml] [--repeats 160]

:func:`teach` is the core (importable; tests/test_serve_demo.py runs it), and
:func:`demo_config` the settings it needs on top of the config.
"""
from __future__ import annotations

import argparse
import socket
import sys
import time

import httpx
import openai

QUESTION = "Q: What is the capital of Zorbia?\nA:"
ANSWER = " Quimbleton"
# 160 copies in micro-batches of 4: 40 optimizer steps, about 3 s of training. The tiny
# model first answers after about 8 steps; its greedy margin grows to about 1.3 logits by
# step 20 and levels off near 1.5 (LoRA cannot touch the random LM head, so the loss stays
# near 3.8): 40 steps leave a wide margin.
REPEATS = 160
# What the demo changes in the config (measured on tiny-llama-s, rank 8, lr 0.003):
# * LoRA on the MLP projections too: on attention alone the random model needs about 75
#   steps to answer, and then only just;
# * one training task in flight (queued_tasks 1): the pipeline stages otherwise run the
#   next task's forward before the last one's update (PipeDream-style weight stashing),
#   and with two or three stale steps 80 steps did not teach it;
# * one node: each node trains its own adapter on the samples placed on it, and a question
#   may be served by either; with one, the answer comes from the adapter that learnt.
DEMO_OVERRIDES = {"nodes": 1, "lora": {
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "micro_batch": 4, "queued_tasks": 1, "checkpoint_every": 20}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo_config(path: str, root: str = "out/serve-demo", port: int | None = None, app_name: str = "raycolo-demo"):
    """``path``'s online config with the demo's settings (:data:`DEMO_OVERRIDES`), its own
    storage under ``root`` and a free port."""
    from raycolo.online.config import load_online_config, parse_online_config

    data = load_online_config(path).model_dump()
    data.update(sample_store=f"{root}/samples", storage_path=f"{root}/checkpoints", resume=False)
    data["nodes"] = DEMO_OVERRIDES["nodes"]
    data["lora"].update(DEMO_OVERRIDES["lora"])
    data["serve"].update(port=port or free_port(), app_name=app_name)
    return parse_online_config(data, f"{path} with the demo's settings")


def ask(client: openai.OpenAI, model: str, question: str, max_tokens: int, stream: bool = False) -> str:
    """The served model's greedy (temperature 0) completion of ``question``."""
    if not stream:
        return client.completions.create(model=model, prompt=question, max_tokens=max_tokens,
                                         temperature=0).choices[0].text
    return "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=model, prompt=question, max_tokens=max_tokens, temperature=0, stream=True))


def teach(client: openai.OpenAI, http: httpx.Client, model: str, question: str = QUESTION,
          answer: str = ANSWER, repeats: int = REPEATS, timeout_s: float = 180.0, say=print) -> dict:
    """Ask ``question`` greedily, post ``repeats`` samples mapping it to ``answer`` over
    HTTP, wait (at most ``timeout_s``) until they are trained, and ask again. Returns the
    answers (``before``, ``after``), the served model's loss on the sample before and
    after (POST /v1/eval), the adapter version and the seconds it took."""
    started = time.time()
    max_tokens = len(answer.encode()) + 4
    before = ask(client, model, question, max_tokens, stream=True)
    sample = {"prompt": question, "completion": answer}
    loss_before = http.post("/v1/eval", json=[sample]).json()["loss"]
    say(f"[2] asked {question!r} (greedy, streamed): {before!r}; loss on the taught answer {loss_before:.2f}")
    trained0 = http.get("/v1/train_samples/status").json()["trained"]
    r = http.post("/v1/train_samples", json=[sample] * repeats)      # a bare list of samples
    r.raise_for_status()
    ack = r.json()
    say(f"[3] POST /v1/train_samples: {repeats} x {answer!r} -> ids {ack['ids'][0]}..{ack['ids'][-1]}, "
        f"persisted {ack['persisted']}")
    deadline, shown = time.time() + timeout_s, None
    while True:
        status = http.get("/v1/train_samples/status").json()
        done = status["trained"] - trained0
        if (done, status["adapter_version"]) != shown:
            shown = (done, status["adapter_version"])
            say(f"    trained {done}/{repeats}, adapter version {status['adapter_version']} "
                f"({time.time() - started:.0f} s)")
        if done >= repeats and status["pending"] == 0:
            break
        if time.time() > deadline:
            raise TimeoutError(f"the samples were not trained within {timeout_s:.0f} s: {status}")
        time.sleep(1.0)
    after = ask(client, model, question, max_tokens)
    loss_after = http.post("/v1/eval", json=[sample]).json()["loss"]
    say(f"[4] asked again: {after!r}; loss on the taught answer {loss_before:.2f} -> {loss_after:.2f}")
    return {"question": question, "answer": answer, "before": before, "after": after,
            "loss_before": loss_before, "loss_after": loss_after, "samples": repeats,
            "adapter_version": status["adapter_version"], "seconds": time.time() - started}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/online.yaml")
    ap.add_argument("--repeats", "--samples", dest="repeats", type=int, default=REPEATS,
                    help="training samples to post (copies of one); --samples is the older spelling")
    args = ap.parse_args()

    import shutil

    from raycolo.actors.serve import launch as serve_launch

    config = demo_config(args.config)
    shutil.rmtree("out/serve-demo", ignore_errors=True)
    metrics_port = free_port()
    t0 = time.time()
    started, dashboard = serve_launch.init_ray(config, metrics_port=metrics_port)
    try:
        print(f"[1] starting {config.nodes} x {config.stages} stage workers and the HTTP front ...", flush=True)
        url = serve_launch.start(config)
        print(f"    serving '{config.served_model_name()}' at {url}/v1 ({time.time() - t0:.0f} s); "
              f"dashboard http://{dashboard}", flush=True)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        http = httpx.Client(base_url=url, timeout=120)
        model = config.served_model_name()

        print(f"    teaching it that the capital of Zorbia is {ANSWER.strip()!r} (LoRA rank {config.lora.rank}, "
              f"lr {config.lora.lr:g}, on {', '.join(config.lora.target_modules)})", flush=True)
        out = teach(client, http, model, repeats=args.repeats, say=lambda m: print(m, flush=True))
        print(f"    before: {out['before']!r}\n    after:  {out['after']!r}  (taught in {out['seconds']:.0f} s)", flush=True)

        stats = http.get("/v1/stats").json()
        print(f"[5] /v1/stats: policy {stats['policy']}, {stats['completed']} requests done, SLO attainment "
              f"{stats['slo_attainment']:.2f}, {stats['training_rate_steps_per_s']:.2f} optimizer steps/s, "
              f"adapter staleness {stats['adapter_staleness_s']:.1f} s, decision p50 {stats['decision_us_p50']:.0f} us",
              flush=True)
        time.sleep(3)      # one export interval
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
        for name in ("ray_raycolo_generation_tokens_total", "ray_raycolo_train_samples_received_total",
                     "ray_raycolo_optimizer_steps", "ray_raycolo_time_to_first_token_seconds_count"):
            values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
            print(f"    Prometheus {name} = {sum(values):g}", flush=True)
    finally:
        print(f"[6] shutting down ({time.time() - t0:.0f} s in all)", flush=True)
        serve_launch.stop(config, started)
    return 0 if out["after"].startswith(ANSWER) else 1


if __name__ == "__main__":
    sys.exit(main())
