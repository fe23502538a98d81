"""A node's data plane without a central actor: the node loop in stage 0's process, its ops
to stage 1 over the stages' own gloo group (raycolo/online/stages/node_pipeline.py), on real
checkpoints (tests/support/hf_checkpoints.py), in spawned processes, no Ray.

* The tokens equal transformers' ``generate()`` on the same directory, with requests
  arriving while others decode (so they join running batches).
* A training task trained through the loop gives transformers' loss and the LoRA weights
  of peft's own step on the whole model (AdamW), while base-model requests run beside it.
* The node's report, replayed on a mirror built by the cluster's rule, starts the same
  ops and arms the same timers event for event; a report with an event missing does not.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.support.hf_checkpoints import greedy_cases, load

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))     # node_harness.py


MAX_NEW = 12
# The stages' group times out after this long (Ray Train's default is 30 minutes); one
# request arrives at LATE_AT_S, when the node has idled past it.
COLLECTIVE_TIMEOUT_S = 4.0
LATE_AT_S = 10.0


def _config(path, **kw) -> dict:
    return {"model_loading_config": {"model_id": str(path)}, "nodes": 1, "stages": 2, **kw}


def _mirror(config: dict):
    from raycolo.online.scheduling.cluster import Cluster
    from raycolo.online.config import OnlineConfig, live_profile, model_hf_config
    from raycolo.online.policies import make_online_policy

    cfg = OnlineConfig.model_validate(config)
    policy = make_online_policy(cfg.policy, cfg.lemix, nodes=1, train_rate=cfg.train_rate)
    profile = live_profile(cfg, model_hf_config(cfg.model_loading_config.model_id))
    return Cluster(policy, profile, 1, cfg.lemix).new_node(0)


@pytest.fixture(scope="module")
def served(hf_checkpoints):
    from node_harness import NodeRunSpec, RequestSpec, run_node

    path = hf_checkpoints["llama3"]
    cases = greedy_cases(path, MAX_NEW, n=6)
    config = _config(path)
    late = RequestSpec(cases[0]["prompt_ids"], MAX_NEW, at_s=LATE_AT_S)
    spec = NodeRunSpec(config, requests=[RequestSpec(c["prompt_ids"], MAX_NEW, at_s=0.015 * i)
                                         for i, c in enumerate(cases)] + [late],
                       collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    return config, cases, run_node(spec)


def test_the_node_loop_on_two_stage_processes_gives_transformers_tokens(served):
    _, cases, res = served
    for i, case in enumerate(cases):
        assert res.tokens[i] == case["output_ids"], f"request {i}"
        assert res.finish[i] == case["finish_reason"], f"request {i}"
        assert len(res.token_times[i]) == len(case["output_ids"])
    assert {c["finish_reason"] for c in cases} == {"stop", "length"}
    assert all(n > 0 for n in res.ops_run), res.ops_run


def test_a_node_idle_longer_than_its_groups_timeout_keeps_its_stages(served):
    """Stage 1 waits for its next op as long as the node idles: before, it waited on the
    stages' own group, whose receive failed at that group's timeout (a live node's stages
    started over after 30 idle minutes). The late request is served by the same stages."""
    _, cases, res = served
    late = len(cases)
    idle = res.token_times[late][0] - max(times[-1] for i, times in res.token_times.items() if i != late)
    assert idle > COLLECTIVE_TIMEOUT_S, "the node did not idle past the timeout: the test tests nothing"
    assert res.tokens[late] == cases[0]["output_ids"]
    assert res.finish[late] == cases[0]["finish_reason"]


def test_a_mirror_replaying_the_report_stays_in_step_and_a_gap_is_caught(served):
    from raycolo.online.scheduling.node_events import MirrorDiverged, OpDone
    from raycolo.online.scheduling.node_loop import NodeReport, replay

    config, cases, res = served
    mirror = _mirror(config)
    steps = replay(mirror, res.report)
    assert len(steps) == len(res.report.events)
    ended = {r.task_id for step in steps for r in step.finished}
    assert ended == set(range(len(cases) + 1))       # and the late request
    assert not mirror.active and mirror.queued_ops == 0
    mirror.check_released()
    # the same log without one op's completion: the mirror says it is out of step
    events = list(res.report.events)
    gap = next(i for i, (e, _) in enumerate(events) if type(e) is OpDone and e.stage == 0)
    with pytest.raises(MirrorDiverged):
        replay(_mirror(config), NodeReport(0, events[:gap] + events[gap + 1:]))


def _peft_step(path, sample, lora_cfg):
    """transformers' loss of ``sample`` on the whole model with fresh LoRA, and the LoRA
    weights after peft's own AdamW step on it."""
    from peft import get_peft_model_state_dict

    from raycolo.online.stages.stage_model import LoraSettings, add_lora

    model = load(path)[0]
    whole = add_lora(type(model).from_pretrained(path, dtype=torch.float32).eval(),
                     LoraSettings(rank=lora_cfg["rank"], alpha=lora_cfg["alpha"], lr=lora_cfg["lr"]))
    prompt, completion = sample
    ids = torch.tensor([prompt + completion])
    labels = torch.tensor([[-100] * len(prompt) + completion])
    opt = torch.optim.AdamW([p for p in whole.parameters() if p.requires_grad], lr=lora_cfg["lr"])
    loss = whole(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    return float(loss.detach()), {k: v.detach() for k, v in get_peft_model_state_dict(whole).items()}


def test_training_through_the_node_loop_gives_peft_step_beside_base_requests(hf_checkpoints):
    from node_harness import NodeRunSpec, RequestSpec, TrainSpec, run_node
    from raycolo.online.scheduling.node_loop import replay

    path = hf_checkpoints["qwen2"]
    cases = greedy_cases(path, MAX_NEW, n=2)
    tokenizer = load(path)[1]
    sample = (tokenizer("The river was quiet")["input_ids"], tokenizer(" in the morning light")["input_ids"])
    lora = {"rank": 4, "alpha": 8, "lr": 0.05}
    config = _config(path, lora=lora)
    spec = NodeRunSpec(config, training=[TrainSpec([sample])],
                       requests=[RequestSpec(c["prompt_ids"], MAX_NEW, at_s=0.005 * i, base=True)
                                 for i, c in enumerate(cases)])
    res = run_node(spec)
    for i, case in enumerate(cases):
        assert res.tokens[i] == case["output_ids"], f"base request {i}"
    ref_loss, ref_state = _peft_step(path, sample, lora)
    assert len(res.losses) == 1
    assert res.losses[0] == pytest.approx(ref_loss, abs=1e-5)
    merged = {k: torch.from_numpy(v) for stage in res.lora.values() for k, v in stage.items()}
    assert set(merged) == set(ref_state)
    assert max(float((merged[k] - ref_state[k]).abs().max()) for k in ref_state) < 1e-5
    assert any(float(v.abs().max()) > 1e-3 for k, v in merged.items() if "lora_B" in k)   # it trained
    replay(_mirror(config), res.report)


def test_a_node_that_ends_before_its_loop_started_stops_its_other_stages(hf_checkpoints):
    """Stage 0 of a node whose loop never starts (the deployment stopped, or the group went
    stale, before its setup) tells the other stages to stop: each returns, rather than
    waiting on the stages' group for an op that never comes (a live deployment stopped
    just after its start waited 60 s for its runs to end)."""
    from node_harness import NodeRunSpec, run_node

    spec = NodeRunSpec(_config(hf_checkpoints["llama3"]), stop_before_loop=True, answer_timeout_s=120)
    res = run_node(spec)
    assert sorted(res.lora) == [0, 1]         # every stage answered: each one returned
    assert res.ops_run == [0, 0]
