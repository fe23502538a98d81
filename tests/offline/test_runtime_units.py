"""The runtime's pure parts: prompts, data flow, the output journal, run setup errors."""
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from raycolo.offline.dag import parse_app
from raycolo.engine.models import ByteTokenizer, load_tokenizer
from raycolo.errors import ConfigError
from raycolo.hardware import ClusterSpec
from raycolo.offline.runtime.communicator import Communicator, request_seed
from raycolo.offline.runtime.setup import RunConfig, parse_run_config, prepare
from raycolo.offline.runtime.store import OutputStore
from raycolo.offline.runtime.texts import build_source_texts, synthetic_text, split_words
from raycolo.offline.workload import build_workload


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOK = ByteTokenizer(512)


def _communicator(app_yaml: str, seed: int = 0):
    app = parse_app(yaml.safe_load(app_yaml))
    workload = build_workload(app, seed=seed)
    texts = build_source_texts(app, workload, TOK)
    return app, workload, Communicator(app, workload, texts, {n.name: TOK for n in app.nodes}, seed)


JUDGE_APP = """
name: judge
requests: {count: 3, input_tokens: {distribution: fixed, value: 20, max: 20}}
nodes:
  - {name: a, model: tiny-llama-s, max_output_tokens: 8}
  - {name: b, model: tiny-llama-s, max_output_tokens: 8, repeat: 2}
  - {name: j, model: tiny-llama-m, max_output_tokens: 8, combine: concat,
     prompt: "Q: {input} | A: {a} | B: {b}"}
edges: [{from: input, to: a}, {from: input, to: b}, {from: a, to: j}, {from: b, to: j}]
"""


def test_synthetic_text_has_the_requested_length_and_is_seeded():
    for n in (5, 40, 300):
        text = synthetic_text(n, np.random.default_rng(1), TOK)
        assert abs(len(TOK.encode(text)) - n) <= 12  # whole words
        assert text == synthetic_text(n, np.random.default_rng(1), TOK)
    assert split_words("a b c d e", 2) == ["a b", "c d e"]


def test_concat_waits_for_every_input_and_renders_them_by_name():
    app, workload, comm = _communicator(JUDGE_APP)
    ready = comm.initial()
    assert sorted(r.node for r in ready) == ["a"] * 3 + ["b"] * 6
    # the judge of item 0 needs a:0 and both repeats of b for item 0
    a0 = next(i for i in range(len(workload.nodes["a"])) if workload.nodes["a"].item[i] == 0)
    b0 = [i for i in range(len(workload.nodes["b"])) if workload.nodes["b"].item[i] == 0]
    assert comm.complete("a", a0, "ALPHA") == []
    assert comm.complete("b", b0[0], "BETA1") == []
    woken = comm.complete("b", b0[1], "BETA2")
    assert len(woken) == 1 and woken[0].node == "j"
    prompt = woken[0].prompt
    # {input} is every input of the judge: here the two upstream nodes, not the source
    assert prompt == "Q: ALPHA\n\nBETA1\n\nBETA2 | A: ALPHA | B: BETA1\n\nBETA2"
    with pytest.raises(RuntimeError, match="completed twice"):
        comm.complete("a", a0, "again")


def test_chain_carries_the_previous_output_and_its_own_part():
    app, workload, comm = _communicator("""
name: chain
sources: {docs: {count: 2, chunk_tokens: 30, chunks: {distribution: fixed, value: 3, max: 3}}}
nodes: [{name: s, model: tiny-llama-s, max_output_tokens: 8, prompt: "P={previous} C={chunk}"}]
edges: [{from: docs, to: s}, {from: s, to: s}]
""")
    w = workload.nodes["s"]
    assert len(w) == 6
    first = comm.initial()
    assert [r.index for r in first] == [0, 3]  # only each document's first part
    assert first[0].prompt == f"P= C={comm.texts.parts[0][0]}"
    nxt = comm.complete("s", 0, "SUM0")
    assert [r.index for r in nxt] == [1]
    assert nxt[0].prompt == f"P=SUM0 C={comm.texts.parts[0][1]}"
    assert comm.complete("s", 1, "SUM1")[0].prompt.startswith("P=SUM1 C=")
    assert comm.complete("s", 2, "SUM2") == []
    assert comm.node_done("s").tolist() == [True, True, True, False, False, False]


def test_long_inputs_are_shortened_to_fit_the_context_keeping_the_template():
    app, workload, comm = _communicator(JUDGE_APP)
    huge = "x" * 3000
    for i in range(len(workload.nodes["a"])):
        comm.complete("a", i, huge)
    woken = []
    for i in range(len(workload.nodes["b"])):
        woken += comm.complete("b", i, huge)
    limit, max_tokens = comm.prompt_budget("j")
    assert max_tokens == 8 and limit == 1024 - 8
    for r in woken:
        assert len(TOK.encode(r.prompt)) <= limit
        assert r.prompt.startswith("Q: ") and " | A: " in r.prompt and " | B: " in r.prompt


def test_planned_lengths_are_the_real_encoded_lengths_for_source_requests():
    app, workload, comm = _communicator(JUDGE_APP)
    planned = comm.planned_input_lengths()
    for r in comm.initial():
        assert planned[r.node][r.index] == len(TOK.encode(r.prompt))
    # downstream: template and source text, plus the sampled upstream output lengths
    j = workload.nodes["j"]
    for i in range(len(j)):
        carried = sum(int(workload.nodes[up].output_len[k]) for up, k in comm.inputs_of["j"][i])
        assert planned["j"][i] >= carried


def test_request_seeds_depend_on_the_request_not_on_the_order():
    assert request_seed(0, "a", 1) == request_seed(0, "a", 1)
    assert len({request_seed(0, "a", i) for i in range(100)}) == 100
    assert request_seed(0, "a", 1) != request_seed(1, "a", 1)


def test_unknown_placeholder_is_a_config_error_naming_the_node():
    with pytest.raises(ConfigError, match=r"nodes\[a\]\.prompt: unknown placeholder '\{summary\}'"):
        parse_app(yaml.safe_load("""
requests: {count: 2, input_tokens: {distribution: fixed, value: 5, max: 5}}
nodes: [{name: a, model: tiny-llama-s, max_output_tokens: 4, prompt: "{summary} {input}"}]
edges: [{from: input, to: a}]
"""))
    # braces that are not placeholders are text
    parse_app(yaml.safe_load("""
requests: {count: 2, input_tokens: {distribution: fixed, value: 5, max: 5}}
nodes: [{name: a, model: tiny-llama-s, max_output_tokens: 4, prompt: 'JSON {"k": 1} {input}'}]
edges: [{from: input, to: a}]
"""))


def test_journal_survives_a_torn_line_and_refuses_another_job(tmp_path):
    store = OutputStore(tmp_path, "job-a")
    store.append([{"key": "a:0", "node": "a", "index": 0, "text": "x"}])
    with pytest.raises(RuntimeError, match="twice"):
        store.append([{"key": "a:0", "node": "a", "index": 0, "text": "y"}])
    store.close()
    with open(tmp_path / "outputs.jsonl", "a") as f:
        f.write('{"key": "a:1", "no')  # a crash mid-write
    again = OutputStore(tmp_path, "job-a")
    assert list(again.done) == ["a:0"]
    again.append([{"key": "a:1", "node": "a", "index": 1, "text": "z"}])
    again.close()
    assert list(OutputStore(tmp_path, "job-a").done) == ["a:0", "a:1"]
    with pytest.raises(ConfigError, match="different job"):
        OutputStore(tmp_path, "job-b")


def test_a_full_disk_mid_run_keeps_every_output_written_before_it(tmp_path):
    """The journal's disk fills up (its handle on /dev/full: every write fails with
    ENOSPC): the batch is refused whole with an error naming --output and the file,
    nothing of it counts as done, and the same job run again finds exactly the outputs
    acknowledged before, and goes on."""
    from raycolo.errors import StoreFull

    store = OutputStore(tmp_path, "job-a")
    store.append([{"key": "a:0", "node": "a", "index": 0, "text": "x"}])
    store._journal._file.close()
    store._journal._file = open("/dev/full", "a", encoding="utf-8")     # the disk fills up
    with pytest.raises(StoreFull, match=r"--output: .*outputs.jsonl: No space left on device; nothing was "
                                        r"stored \(1 outputs kept in .*run the same job"):
        store.append([{"key": "a:1", "node": "a", "index": 1, "text": "y"},
                      {"key": "a:2", "node": "a", "index": 2, "text": "z"}])
    assert list(store.done) == ["a:0"]
    store.close()
    again = OutputStore(tmp_path, "job-a")           # space again: the job is run again
    assert list(again.done) == ["a:0"]
    again.append([{"key": "a:1", "node": "a", "index": 1, "text": "y"}])
    again.close()
    assert [json.loads(x)["key"] for x in (tmp_path / "outputs.jsonl").read_text().splitlines()] == ["a:0", "a:1"]


def test_prepare_checks_inputs_before_any_cluster(tmp_path):
    good = {"dag": str(EXAMPLES / "tiny.yaml"), "output": str(tmp_path / "out")}
    run = prepare(RunConfig(**good, requests=4))
    assert run.communicator.total == 12
    bad_input = tmp_path / "bad.jsonl"
    bad_input.write_text('{"prompt": "hello"}\n{"text": 3}\n')
    with pytest.raises(ConfigError, match="row 2: needs 'prompt'"):
        prepare(RunConfig(**{**good, "output": str(tmp_path / "o2")}, input=str(bad_input)))
    with pytest.raises(ConfigError, match="--policy|policy"):
        prepare(RunConfig(**{**good, "output": str(tmp_path / "o3")}, policy="nope"))
    with pytest.raises(ConfigError, match="--slice-s"):
        parse_run_config({**good, "slice_s": -1})
    # resuming into a directory of another job is refused
    with pytest.raises(ConfigError, match="different job"):
        prepare(RunConfig(**good, requests=5))


def test_input_file_replaces_the_source_and_keeps_row_ids(tmp_path):
    rows = [{"id": f"q{i}", "prompt": f"question number {i} about rivers"} for i in range(5)]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = prepare(RunConfig(dag=str(EXAMPLES / "tiny.yaml"), output=str(tmp_path / "out"),
                            input=str(path)))
    assert run.communicator.total == 15
    assert [run.texts.text(i) for i in range(5)] == [r["prompt"] for r in rows]
    assert [run.texts.row_ids[i] for i in range(5)] == [f"q{i}" for i in range(5)]
    small = [r for r in run.communicator.initial() if r.node == "small"]
    assert [r.prompt for r in small] == [r["prompt"] for r in rows]


def test_load_tokenizer_needs_a_checkpoint_for_real_models():
    assert isinstance(load_tokenizer("tiny-llama-s"), ByteTokenizer)
    with pytest.raises(ConfigError, match="checkpoint"):
        load_tokenizer("llama-2-7b-chat-hf")


def test_remaining_workload_drops_finished_requests_and_met_dependencies():
    from raycolo.offline.runtime.remaining import remaining_workload

    app = parse_app(yaml.safe_load("""
name: r
sources: {docs: {count: 2, chunk_tokens: 30, chunks: {distribution: fixed, value: 3, max: 3}}}
nodes:
  - {name: s, model: tiny-llama-s, max_output_tokens: 8, prompt: "{previous} {chunk}"}
  - {name: e, model: tiny-llama-s, max_output_tokens: 8, repeat: 2}
edges: [{from: docs, to: s}, {from: s, to: s}, {from: s, to: e}]
"""))
    workload = build_workload(app, seed=0)
    s, e = workload.nodes["s"], workload.nodes["e"]
    assert len(s) == 6 and len(e) == 4
    done = {"s": np.array([True, True, False, True, True, True]), "e": np.array([False, True, False, False])}
    rest = remaining_workload(workload, done)
    rs, re_ = rest.nodes["s"], rest.nodes["e"]
    assert len(rs) == 1 and rs.chain_head.tolist() == [True]       # its predecessor is done
    assert rs.successor.tolist() == [-1] and rs.output_len.tolist() == [s.output_len[2]]
    assert len(re_) == 3
    # the evaluators of document 0 still wait for its last part (old s:2, now s:0); those
    # of document 1 have their input already
    waiting = {int(i) for up, req, upi in re_.deps for i in req}
    assert waiting == {i for i in range(3) if re_.item[i] == 0}
    assert all(up == "s" and set(upi.tolist()) == {0} for up, req, upi in re_.deps)
    gone = remaining_workload(workload, {"s": np.ones(6, bool), "e": np.array([False, True, True, True])})
    assert list(gone.nodes) == ["e"] and gone.nodes["e"].deps == []


def _profiled_problem(**kw):
    from raycolo.offline.costmodel.latency import resolve_profile_dir
    from raycolo.offline.planner.problem import PlanningProblem
    app = parse_app(yaml.safe_load("""
name: scaled
requests: {count: 24, input_tokens: {distribution: uniform, min: 8, max: 96}}
nodes: [{name: a, model: tiny-llama-m, max_output_tokens: 32}]
edges: [{from: input, to: a}]
"""))
    profile = resolve_profile_dir("cpu")
    return PlanningProblem(build_workload(app, seed=3, ecdf_dir=profile / "ecdf"),
                           ClusterSpec(num_gpus=1, nvlink_group=1, gpu_memory_bytes=8 * 2**30),
                           profile_dir=profile, max_num_seqs=16, **kw)


def test_a_compute_scale_multiplies_every_iteration_but_not_the_load():
    """The probe's prediction agrees with the reference simulator (the slow, step-by-step
    one) on the profile as it is; a compute scale of 2.5 makes every iteration, so the
    whole batch, 2.5 times as long, and leaves the load alone."""
    from raycolo.offline.costmodel.latency import IterationLatency
    from raycolo.offline.planner.problem import ExecPlan
    from raycolo.offline.sim import reference
    from raycolo.offline.sim.types import ReplicaWorkload

    plain, scaled = _profiled_problem(), _profiled_problem(compute_scale={"tiny-llama-m": 2.5})
    rng = np.random.default_rng(5)
    prompts, outputs = rng.integers(4, 200, 40), rng.integers(1, 40, 40)   # 40 > 16 seqs: queueing
    base = plain.replica_seconds("tiny-llama-m", prompts, outputs)
    model = plain.node("a").model
    ref = reference.simulate(ReplicaWorkload(prompts, outputs, np.zeros(40)), plain.limits(model.name, 1),
                             IterationLatency(model, plain.profile(model.name, 1), max_seqs=16))
    assert base == pytest.approx(ref.end_time, rel=1e-9) and base > 0
    assert scaled.replica_seconds("tiny-llama-m", prompts, outputs) == pytest.approx(2.5 * base, rel=1e-9)
    assert scaled.load_seconds("a", ExecPlan(1, 1)) == plain.load_seconds("a", ExecPlan(1, 1))


def test_compute_scales_are_low_medians_and_unprobed_models_take_the_clusters():
    from raycolo.actors.offline.pool import ComputeScales

    scales = ComputeScales()
    assert scales.scales(["a", "b"]) == {}                  # nothing measured: the profiles
    for gpu, (measured, predicted) in enumerate([(3.0, 1.0), (1.0, 1.0), (4.0, 2.0)]):
        scales.add("a", gpu, 8, measured, predicted)
    scales.add("c", 0, 8, 10.0, 1.0)
    # a: ratios 3, 1, 2 -> 2; c: 10; b was not probed: the low median of 1, 2, 3, 10 -> 2
    assert scales.scales(["a", "b", "c"]) == {"a": 2.0, "b": 2.0, "c": 10.0}
    report = scales.as_dict(["a", "b"])
    assert report["models"]["b"] == {"scale": 2.0, "samples": []}
    assert [s["ratio"] for s in report["models"]["a"]["samples"]] == [3.0, 1.0, 2.0]


def test_a_local_cluster_declares_the_machines_gpus_and_never_more():
    """Hand-worked cases of the GPUs `raycolo run` gives its local cluster: a CPU machine
    (NVML counts none) gets --gpus or 2 logical GPUs; a machine with 8 GPUs gets them
    all, or fewer on request; asking for more than it has fails naming --gpus (Ray would
    hand out ids past the real ones, and those replicas would compute on the CPU)."""
    from raycolo.engine.device_stats import local_cluster_gpus, physical_gpus

    assert physical_gpus() == 0                         # this machine: no driver
    assert [local_cluster_gpus(None, 0), local_cluster_gpus(5, 0)] == [2, 5]
    assert [local_cluster_gpus(None, 8), local_cluster_gpus(4, 8), local_cluster_gpus(8, 8)] == [8, 4, 8]
    with pytest.raises(ConfigError, match="--gpus: 9, but this machine has 8 GPU"):
        local_cluster_gpus(9, 8)


def test_device_auto_refuses_a_real_gpu_torch_cannot_see():
    """`device: auto` of an engine actor: CUDA on a GPU torch sees; the CPU on Ray's logical
    GPUs (no physical one) or with none; an error naming the field where Ray gave a real
    GPU and torch sees none (a CPU build of torch, or an id past the machine's GPUs)."""
    from raycolo.engine.device_stats import auto_device

    assert auto_device([0], True, 1) == "cuda"
    assert auto_device([0], False, 0) == "cpu"          # logical GPUs: the suite's own case
    assert auto_device([], False, 8) == "cpu"
    with pytest.raises(ConfigError, match="engine_kwargs.device: auto: Ray gave this replica GPU \\[9\\]"):
        auto_device([9], False, 8)


def test_planner_gpus_take_blocks_of_each_nodes_gpus():
    """Hand-worked: nodes b (2 GPUs) and a (4 GPUs) own planner ids in node-id order, a
    block each; a replica's bundles name its GPUs' nodes; one node, or ids past the
    cluster's GPUs, pin nothing; NVLink groups of 3 straddle a's and b's blocks."""
    from raycolo.actors.offline.gpu_nodes import NODE_LABEL, GpuNodes, assign

    owners = assign([("b", 2), ("a", 4)], 6)
    assert owners == ("a", "a", "a", "a", "b", "b") and assign([("b", 2), ("a", 4)], 5) == owners[:5]
    nodes = GpuNodes(owners)
    assert nodes.selector((4, 5)) == [{NODE_LABEL: "b"}, {NODE_LABEL: "b"}]
    assert nodes.selector((0,)) == [{NODE_LABEL: "a"}] and nodes.selector((5, 6)) is None
    assert GpuNodes(("a", "a")).selector((0, 1)) is None and GpuNodes().selector((0,)) is None
    assert nodes.straddling(2) == nodes.straddling(4) == [] and nodes.straddling(3) == [(3, 4, 5)]
    assert GpuNodes(("a", "b", "a", "b")).straddling(2) == [(0, 1), (2, 3)]
