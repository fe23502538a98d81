"""Adapters as users have them (docs/serve.md, "Adapters"), against a real deployment:
``lora.init_from`` (the stages start from a peft adapter directory), vLLM's
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` and their errors, and every
served adapter compared with peft's own ``PeftModel.from_pretrained`` + ``generate()``.

One small deployment (1 node x 2 stages of tiny-llama-s, two ingress replicas: the loaded
adapters' registry is the controller's) serves the module. The adapters are built with
peft itself, their LoRA B weights drawn from a seed so that they change the outputs.
"""
from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.support.online_checks import data_plane, free_port
from raycolo.errors import ConfigError
from raycolo.online.config import parse_online_config
from tests.support.tiny_reference import hf_greedy

MODEL = "tiny-llama-s"
RANK, ALPHA = 4, 8                     # the deployment's LoRA
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PROMPTS = ["The quick brown fox", "Adapters as users have them"]
N = 8                                  # tokens per completion (ignore_eos: always N)


def make_adapter(directory: Path, rank: int = RANK, alpha: int = ALPHA, targets=TARGETS, seed: int = 1,
                 model: str = MODEL) -> Path:
    """A peft LoRA adapter of ``model`` whose B weights are random (seeded), saved by peft."""
    from peft import LoraConfig, get_peft_model

    from raycolo.engine.models import build_tiny_model

    base, _ = build_tiny_model(model, 0)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    peft_model.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {
        "init": make_adapter(d / "init", seed=1),
        "small": make_adapter(d / "small", rank=2, alpha=4, targets=("q_proj", "v_proj"), seed=2),  # padded
        "scaled": make_adapter(d / "scaled", alpha=16, seed=3),          # scaling 4, the deployment's 2
        "big": make_adapter(d / "big", rank=8, alpha=16, seed=4),
        "mlp": make_adapter(d / "mlp", targets=("q_proj", "gate_proj"), seed=5),
        "other_model": make_adapter(d / "other", model="tiny-llama-m", seed=6),
        "root": d,
    }


@pytest.fixture(scope="module")
def front(tmp_path_factory, adapters):
    from raycolo.actors.serve import launch as serve_launch

    out = tmp_path_factory.mktemp("serve-adapters")
    config = parse_online_config({
        "model_loading_config": {"model_id": MODEL, "dtype": "float32"},
        "nodes": 1, "stages": 2, "policy": "lemix",
        "lemix": {"slo_ms": 5000, "max_batch": 8, "profile_warmup": 2},
        "lora": {"rank": RANK, "alpha": ALPHA, "lr": 0.01, "micro_batch": 2, "checkpoint_every": 1,
                 "flush_after_s": 1, "init_from": str(adapters["init"])},
        "stage": {"cpus_per_worker": 0.5, "cpu_threads": 1, "kv_cache_tokens": 512, **data_plane()},
        "max_tokens": N,
        "sample_store": str(out / "samples"), "storage_path": str(out / "checkpoints"),
        "serve": {"port": free_port(), "app_name": "raycolo-adapters-test", "replicas": 2,
                  "lora_load_dirs": [str(adapters["root"])]},
    })
    started, _ = serve_launch.init_ray(config)
    try:
        url = serve_launch.start(config)
        yield {"url": url, "config": config, "out": out}
    finally:
        serve_launch.stop(config, started)


def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=front["url"] + "/v1", api_key="none", max_retries=0, timeout=120)


def http(front) -> httpx.Client:
    return httpx.Client(base_url=front["url"], timeout=120)


def served(front, model: str, prompt: str) -> tuple[str, list[float]]:
    """The served greedy text and each token's log-probability (the API's token ids: the
    byte tokenizer's text drops ids past the bytes, the log-probabilities do not)."""
    r = client(front).completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True})
    assert r.model == model and r.usage.completion_tokens == N and r.choices[0].finish_reason == "length"
    return r.choices[0].text, r.choices[0].logprobs.token_logprobs


@functools.lru_cache(maxsize=None)
def _reference(prompt: str, adapter_dir) -> tuple[str, list[float]]:
    from raycolo.engine.models import build_tiny_model, load_tokenizer

    tok = load_tokenizer(MODEL)
    ids = tok.encode(prompt)
    out = hf_greedy(MODEL, ids, N, adapter_dir=adapter_dir)      # transformers' generate()
    model, _ = build_tiny_model(MODEL, 0, "float32")
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(out)[:, None])[:, 0]
    return tok.decode(out), logprobs.tolist()


def reference(prompt: str, adapter_dir=None) -> tuple[str, list[float]]:
    """peft's own greedy text, PeftModel.from_pretrained(base, adapter_dir).generate(), and
    its tokens' log-probabilities."""
    return _reference(prompt, None if adapter_dir is None else str(adapter_dir))


def same(got: tuple[str, list[float]], want: tuple[str, list[float]]) -> bool:
    """The same tokens: each token's log-probability to float precision, and the same text
    (but for a last, incomplete UTF-8 character: the HTTP front's incremental decoding decides
    whether it shows, not the tokens)."""
    ok = got[0].rstrip("\ufffd") == want[0].rstrip("\ufffd") and len(got[1]) == len(want[1]) == N and \
        all(abs(a - b) < 1e-3 for a, b in zip(got[1], want[1]))
    assert ok, f"served {got}, peft {want}"
    return ok


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def load(h: httpx.Client, name: str, path, **extra) -> httpx.Response:
    return h.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


# -- lora.init_from: checked before anything starts -------------------------------------------
def config_with(init_from, **lora):
    return parse_online_config({"lora": {"rank": RANK, "alpha": ALPHA, "init_from": str(init_from), **lora}})


def test_init_from_is_checked_and_names_what_differs(adapters, tmp_path):
    config_with(adapters["init"]).check_init_from()          # fits
    cases = [
        (config_with(adapters["init"], rank=8), "rank (r) is 4, lora.rank is 8"),
        (config_with(adapters["init"], alpha=16), "lora_alpha is 8, lora.alpha is 16"),
        (config_with(adapters["init"], target_modules=["q_proj", "v_proj"]), "lora.target_modules"),
        (config_with(adapters["other_model"]), "another base model"),
        (config_with(tmp_path / "nothing-here"), "does not exist"),
        (config_with(tmp_path), "not a peft adapter directory: it has no adapter_config.json"),
    ]
    for config, words in cases:
        with pytest.raises(ConfigError) as exc:
            config.check_paths()          # what `raycolo serve` and OnlineDeployment.start run first
        assert str(exc.value).startswith("lora.init_from: ") and words in str(exc.value), exc.value
    # the restore key (which checkpoints belong to this run) follows the adapter's contents
    plain = parse_online_config({"lora": {"rank": RANK, "alpha": ALPHA}})
    keys = {plain.adapter_fingerprint(), config_with(adapters["init"]).adapter_fingerprint(),
            config_with(adapters["scaled"], alpha=16).adapter_fingerprint()}
    assert len(keys) == 3
    assert config_with(adapters["init"]).adapter_fingerprint() == config_with(adapters["init"]).adapter_fingerprint()


# -- the deployment ----------------------------------------------------------------------------
def test_init_from_is_served_before_any_training(front, adapters):
    """The stages start from the init adapter: the served model's greedy text is peft's with
    that adapter, <model>@base is the model without it, and the two differ."""
    for prompt in PROMPTS:
        want = reference(prompt, adapters["init"])
        base = reference(prompt)
        assert want != base, "the init adapter should change the greedy text"
        assert same(served(front, MODEL, prompt), want)
        assert same(served(front, MODEL + "@base", prompt), base)
    with http(front) as h:
        assert h.get("/v1/train_samples/status").json()["trained"] == 0


def test_a_loaded_adapter_is_served_under_its_name_as_peft_generates_it(front, adapters):
    c = client(front)
    for name, key in (("small-lora", "small"), ("scaled-lora", "scaled")):
        text = c.post("/load_lora_adapter", body={"lora_name": name, "lora_path": str(adapters[key])},
                      cast_to=str)
        assert text == f"Success: LoRA adapter '{name}' added successfully."
    cards = {m.id: m for m in c.models.list().data}
    assert cards["small-lora"].root == str(adapters["small"]) and cards["small-lora"].parent == MODEL
    assert cards["small-lora"].model_dump()["adapter"] == "loaded"
    for prompt in PROMPTS:
        # rank 2 of q/v only: zero-padded to the deployment's rank 4, the other modules untouched
        assert same(served(front, "small-lora", prompt), reference(prompt, adapters["small"]))
        # lora_alpha 16 at rank 4 (scaling 4, the deployment's 2)
        assert same(served(front, "scaled-lora", prompt), reference(prompt, adapters["scaled"]))
    # two ingress replicas: every one answers for a loaded adapter (the controller's registry)
    with http(front) as h:
        for _ in range(4):
            r = h.post("/v1/completions", json={"model": "small-lora", "prompt": PROMPTS[0], "max_tokens": 2,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        # streamed too
        with h.stream("POST", "/v1/completions", json={"model": "scaled-lora", "prompt": PROMPTS[1],
                                                       "max_tokens": N, "temperature": 0, "ignore_eos": True,
                                                       "stream": True}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert streamed.rstrip("\ufffd") == reference(PROMPTS[1], adapters["scaled"])[0].rstrip("\ufffd")
        # load_inplace replaces what the name serves
        assert load(h, "small-lora", adapters["scaled"], load_inplace=True).status_code == 200
    assert same(served(front, "small-lora", PROMPTS[0]), reference(PROMPTS[0], adapters["scaled"]))

    # unload: 200 with vLLM's text; the name is gone from the list and from serving
    for name in ("small-lora", "scaled-lora"):
        text = c.post("/unload_lora_adapter", body={"lora_name": name}, cast_to=str)
        assert text == f"Success: LoRA adapter '{name}' removed successfully."
    assert not {"small-lora", "scaled-lora"} & {m.id for m in c.models.list().data}
    with pytest.raises(openai.NotFoundError) as exc:
        c.completions.create(model="small-lora", prompt="x", max_tokens=1)
    assert exc.value.body["param"] == "model" and exc.value.body["code"] == "model_not_found"
    # their copies in the deployment's storage go once nothing runs on them
    copies = front["out"] / "checkpoints"
    deadline = time.time() + 10
    while time.time() < deadline and any(p.is_dir() for p in copies.glob("adapter-*/loaded/*")):
        time.sleep(0.2)
    assert not any(p.is_dir() for p in copies.glob("adapter-*/loaded/*"))
    assert same(served(front, MODEL, PROMPTS[0]), reference(PROMPTS[0], adapters["init"]))   # untouched


def test_loading_is_off_without_lora_load_dirs_and_confined_to_them(adapters, tmp_path):
    """What POST /v1/load_lora_adapter may read is the controller's to decide, before it
    looks at the path (the controller's role, built on a stand-in for the controller that
    holds only its config)."""
    import asyncio
    from types import SimpleNamespace

    from raycolo.actors.online.loaded_adapters import LoadedAdapters

    def load(dirs, path):
        ctl = SimpleNamespace(config=parse_online_config({"serve": {"lora_load_dirs": dirs}}))
        return asyncio.run(LoadedAdapters(ctl).load_adapter("x", str(path)))

    out = load([], adapters["init"])
    assert out.status == 403 and out.code == "adapter_loading_disabled"
    assert "serve.lora_load_dirs" in out.message
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (adapters["root"] / "link").symlink_to(outside)
    for path in (outside, "/etc", adapters["root"] / ".." / "x", adapters["root"] / "link", "x" * 5000):
        out = load([str(adapters["root"])], path)
        assert out.status == 403 and out.code == "path_not_allowed", (path, out)
        assert "exist" not in out.message          # nothing said about what is there


def test_load_and_unload_errors_are_openai_errors_naming_the_problem(front, adapters):
    with http(front) as h:
        err = error_of(load(h, "x", "/etc"), 403)                              # outside serve.lora_load_dirs
        assert err["param"] == "lora_path" and err["code"] == "path_not_allowed"
        assert err["type"] == "permission_error"
        err = error_of(load(h, "x", adapters["root"] / "missing"), 404)       # vLLM: no adapter found
        assert err["param"] == "lora_path" and "does not exist" in err["message"]
        err = error_of(load(h, "x", adapters["root"]), 400)
        assert err["param"] == "lora_path" and "not a peft adapter directory" in err["message"]
        err = error_of(load(h, "x", adapters["big"]), 400)
        assert "rank (r) is 8, larger than this deployment's LoRA rank 4" in err["message"]
        err = error_of(load(h, "x", adapters["mlp"]), 400)
        assert "gate_proj, which this deployment's LoRA does not" in err["message"]
        err = error_of(load(h, "x", adapters["other_model"]), 400)
        assert "another base model" in err["message"] and err["code"] == "invalid_adapter"
        for taken in (MODEL, MODEL + "@base", MODEL + "@v3"):
            err = error_of(load(h, taken, adapters["init"]), 400)
            assert err["param"] == "lora_name" and "conflicts with a served base model" in err["message"]
        assert load(h, "dup", adapters["init"]).status_code == 200
        err = error_of(load(h, "dup", adapters["small"]), 400)                 # vLLM: 400
        assert err["param"] == "lora_name" and "has already been loaded" in err["message"]
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "dup"}).status_code == 200
        err = error_of(h.post("/v1/unload_lora_adapter", json={"lora_name": "dup"}), 404)   # vLLM: 404
        assert err["param"] == "lora_name" and "cannot be found" in err["message"]
        err = error_of(h.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400)
        assert err["param"] == "lora_path"
        err = error_of(h.post("/v1/load_lora_adapter", json={"lora_name": "", "lora_path": "/tmp"}), 400)
        assert err["param"] == "lora_name"
        assert [m["id"] for m in h.get("/v1/models").json()["data"]][:2] == [MODEL, MODEL + "@base"]
        assert not [m for m in h.get("/v1/models").json()["data"] if m["adapter"] == "loaded"]


def test_a_trained_version_is_exported_in_peft_format_and_served_as_peft_generates_it(front):
    """Training goes on from the init adapter; checkpoint v<k> is written in peft's format
    (versions/v<k>) and <model>@v<k> is what PeftModel.from_pretrained(base, versions/v<k>)
    generates."""
    samples = [{"prompt": f"Q{i}: copy xyz", "completion": "xyz xyz"} for i in range(2)]
    with http(front) as h:
        assert h.post("/v1/train_samples", json={"samples": samples}).status_code == 200
        deadline = time.time() + 60
        while time.time() < deadline:
            status = h.get("/v1/train_samples/status").json()
            if status["pinned_versions"]:
                break
            time.sleep(0.5)
    assert status["pinned_versions"], status
    k = status["pinned_versions"][-1]
    directory = next(front["out"].glob(f"checkpoints/adapter-*/versions/v{k}"))
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK and config["lora_alpha"] == ALPHA
    # trained on from lora.init_from: every A and B still points the init adapter's way
    # (Adam moves each weight by about lr a step; from scratch B would start at zero and A
    # at fresh random values, each at a cosine near 0 to the init's)
    from safetensors.torch import load_file
    init = load_file(str(Path(front["config"].lora.init_from) / "adapter_model.safetensors"))
    trained = load_file(str(directory / "adapter_model.safetensors"))
    assert set(trained) == set(init) and len(init) == 2 * len(TARGETS) * 2      # 2 layers
    cosines = [float(torch.nn.functional.cosine_similarity(trained[k].flatten(), init[k].flatten(), dim=0))
               for k in sorted(init)]
    assert all(c > 0.5 for c in cosines) and any(not torch.equal(trained[k], init[k]) for k in init), cosines
    for prompt in PROMPTS:
        assert same(served(front, f"{MODEL}@v{k}", prompt), reference(prompt, directory))
