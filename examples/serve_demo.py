"""The online half in about two minutes (part of ``make demo``):

1. start the HTTP front and its co-located deployment on a local Ray cluster;
2. stream a completion with the official ``openai`` client;
3. post training samples over HTTP (persisted before the answer, trained as they come);
4. show the held-out loss and the served output changing as the adapter trains;
5. print a few live metrics (``/v1/stats`` and Ray's Prometheus endpoint);
6. shut down.

    .venv/bin/python examples/serve_demo.py [--config examples/online.yaml] [--samples 96]
"""
import argparse
import random
import socket
import sys
import time

import httpx
import openai

WORDS = ["red", "blue", "green", "gold", "gray", "pink", "teal", "lime", "navy", "plum", "rose", "jade"]


def sample(rng: random.Random) -> dict:
    """A task a small adapter can pick up: answer with the colour named in the question."""
    w = rng.choice(WORDS)
    return {"prompt": f"Which colour is {w}? Answer:", "completion": f" {w}."}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/online.yaml")
    ap.add_argument("--samples", type=int, default=96, help="training samples to post")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from raycolo.actors import serve_launch
    from raycolo.online.config import load_online_config

    config = load_online_config(args.config)
    config = config.model_copy(update={
        "sample_store": "out/serve-demo/samples", "storage_path": "out/serve-demo/checkpoints",
        "serve": config.serve.model_copy(update={"port": free_port(), "app_name": "raycolo-demo"})})
    import shutil
    shutil.rmtree("out/serve-demo", ignore_errors=True)
    rng = random.Random(args.seed)
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

        prompt = "Which colour is teal? Answer:"
        print(f"[2] streaming a completion of {prompt!r}:", flush=True)
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        pieces = []
        for chunk in stream:
            pieces.append(chunk.choices[0].text)
            print(f"    chunk {len(pieces):2d}: {chunk.choices[0].text!r}", flush=True)
        before_text = "".join(pieces)

        held_out = {"samples": [sample(random.Random(1000 + i)) for i in range(8)]}
        before = http.post("/v1/eval", json=held_out).json()
        print(f"[3] held-out loss before training: {before['loss']:.3f} (adapter version "
              f"{before['adapter_version']}); posting {args.samples} training samples", flush=True)
        for i in range(0, args.samples, 16):
            ack = http.post("/v1/train_samples", json={"samples": [sample(rng) for _ in range(16)]}).json()
            print(f"    POST /v1/train_samples -> ids {ack['ids'][0]}..{ack['ids'][-1]}, persisted {ack['persisted']}",
                  flush=True)
        deadline = time.time() + 90
        while time.time() < deadline:
            status = http.get("/v1/train_samples/status").json()
            print(f"    trained {status['trained']}/{status['received']}, adapter version "
                  f"{status['adapter_version']}", flush=True)
            if status["trained"] >= args.samples - config.lora.micro_batch:
                break
            time.sleep(3)
        after = http.post("/v1/eval", json=held_out).json()
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0]
        print(f"[4] held-out loss: {before['loss']:.3f} -> {after['loss']:.3f} (adapter version "
              f"{after['adapter_version']}); served output {before_text!r} -> {answer.text!r} "
              f"(finish_reason {answer.finish_reason})", flush=True)

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
