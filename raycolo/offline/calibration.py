"""``raycolo validate``: does the cost model predict what the engine really does?

For each tiny model, a held-out request set (seeds the profiler never used) runs on the
torch engine; the prediction samples output lengths from the profiled eCDF and simulates
the engine's scheduler with the fitted coefficients, as the planner does. A two-model
application (an answering model, then a judging model on its answers, one model at a
time on one device) compares the planner's predicted makespan, loads included, with the
measured wall time. Error = (predicted - measured) / measured, over the summed times of
``repeats`` held-out request sets (seeds ``seed``, ``seed + 1``, ...): with 48 requests, one
set's output lengths are a few per cent off the eCDF's mean by chance, and one run on a
shared CPU is a few per cent off another, which a single set would count as model error.
"""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from raycolo.catalog import get_model, model_spec
from raycolo.rng import seeded_rng
from raycolo.offline.dag import parse_app
from raycolo.engine.base import SamplingParams
from raycolo.engine.factory import create_engine
from raycolo.hardware import ClusterSpec
from raycolo.offline.costmodel.latency import profile_file
from raycolo.offline.planner.problem import ExecPlan, PlanningProblem
from raycolo.offline.planner.state import StageEvaluator, initial_state
from raycolo.offline.profiler import (ECDF_MAX_TOKENS, ECDF_TEMPERATURE, REFERENCE_PROMPT, REFERENCE_REQUESTS,
                                     REFERENCE_TOKENS, engine_config, profile_reference, time_reference)
from raycolo.rng import random_prompts
from raycolo.offline.workload import build_workload

TINY_MODELS = ("tiny-llama-s", "tiny-llama-m", "tiny-llama-l")
MAX_NUM_SEQS = 64
JUDGE_MAX_TOKENS = 64
DAG_MODELS = ("tiny-llama-s", "tiny-llama-m")   # the 2-model application: answer, then judge
JUDGE_INSTRUCTION = [7] * 12  # a fixed 12-token instruction before each answer


def cpu_cluster(tp: int = 1) -> ClusterSpec:
    """``tp`` devices whose memory never limits tiny models (the engine's KV budget is large too)."""
    return ClusterSpec(num_gpus=tp, nvlink_group=tp, gpu_memory_bytes=8 * 2**30)


def device_cluster(device: str, tp: int = 1) -> ClusterSpec:
    """The cluster a validation plans for: on a GPU, ``tp`` of this card with its memory;
    on the CPU, :func:`cpu_cluster`."""
    if not device.startswith("cuda"):
        return cpu_cluster(tp)
    import torch

    return ClusterSpec(num_gpus=tp, nvlink_group=tp, gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory)


def _write_requests(path: Path, lengths) -> Path:
    path.write_text("".join(json.dumps({"input_tokens": int(n)}) + "\n" for n in lengths))
    return path


def _problem(app_yaml: str, profile_dir: Path, seed: int, tp: int = 1, cluster: Optional[ClusterSpec] = None,
             max_num_seqs: int = MAX_NUM_SEQS) -> PlanningProblem:
    import yaml
    app = parse_app(yaml.safe_load(app_yaml))
    workload = build_workload(app, seed=seed, ecdf_dir=profile_dir / "ecdf")
    return PlanningProblem(workload, cluster or cpu_cluster(tp), profile_dir=profile_dir, max_num_seqs=max_num_seqs)


def _node_problem(model: str, input_lens, max_tokens: int, profile_dir: Path, seed: int, tp: int = 1,
                  cluster: Optional[ClusterSpec] = None, max_num_seqs: int = MAX_NUM_SEQS,
                  greedy: bool = False) -> PlanningProblem:
    """The planner's problem of one node ``m`` of ``model``: a request per input length."""
    with tempfile.TemporaryDirectory() as tmp:
        source = _write_requests(Path(tmp) / "requests.jsonl", input_lens)
        return _problem(f"""
requests: {{file: {source}}}
nodes: [{{name: m, model: {model}, max_output_tokens: {max_tokens}{', temperature: 0' if greedy else ''}}}]
edges: [{{from: input, to: m}}]
""", profile_dir, seed, tp, cluster=cluster, max_num_seqs=max_num_seqs)


def _sampling(rng_seed: int, count: int, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=ECDF_TEMPERATURE, seed=rng_seed + i)
            for i in range(count)]


def model_case(model_id: str, profile_dir: Path, requests: int, seed: int, threads: int, tp: int = 1) -> dict:
    """One model's held-out requests at tensor-parallel degree ``tp`` (its other ranks as
    processes of this machine), predicted from its ``tp`` profile."""
    rng = seeded_rng(seed, "validate", model_id)
    lengths = rng.integers(8, 128, requests)
    engine = create_engine(engine_config(model_id, threads=threads, max_num_seqs=MAX_NUM_SEQS, tp=tp))
    vocab = get_model(model_id).vocab
    engine.generate(random_prompts(rng, 2, 8, vocab), SamplingParams(max_tokens=4))  # warm-up
    prompts = random_prompts(rng, requests, lengths, vocab)
    started = time.perf_counter()
    outputs = engine.generate(prompts, _sampling(seed * 100_003, requests, ECDF_MAX_TOKENS))
    measured = time.perf_counter() - started
    machine = _machine(engine, vocab, profile_dir, model_id, tp)
    engine.release()
    problem = _node_problem(model_id, [len(p) for p in prompts], ECDF_MAX_TOKENS, profile_dir, seed, tp)
    state = initial_state(problem)
    run = StageEvaluator(problem).node_run(state, "m", ExecPlan(1, tp), False, {})
    problem.node("m").output_len = np.array([o.output_len for o in outputs])
    known = StageEvaluator(problem).node_run(state, "m", ExecPlan(1, tp), False, {})
    name = f"{model_id} x{requests}" if tp == 1 else f"{model_id} tp{tp} x{requests}"
    return dict(_case(name, run.end - run.load_s, known.end - known.load_s, measured), **machine)


def _machine(engine, vocab: int, profile_dir: Path, name: str, tp: int) -> dict:
    """The reference batch timed now on ``engine`` (``reference_s``) and over the time
    recorded with the profile (``machine_vs_profile``: above 1, the machine is slower now
    than when it was profiled; None where the profile recorded none)."""
    now = time_reference(engine, vocab)
    then = profile_reference(profile_dir, name, tp)
    return {"reference_s": now, "machine_vs_profile": None if then is None else now / then}


@dataclass(frozen=True)
class BatchRuns:
    """``raycolo validate --batches``: engine runs of ``batch`` requests each, every prompt
    ``prompt_len`` tokens and every output ``output_len`` greedy tokens (EOS ignored), so
    the lengths are known and only the latency model and the simulator are judged: the
    shape of a real-size model's check on a GPU (random weights have no meaningful
    output lengths)."""

    batches: tuple[int, ...]
    prompt_len: int = 512
    output_len: int = 128

    def max_num_seqs(self) -> int:
        """The engine's batch limit: the largest batch, or the reference batch whole (run in
        two halves it would not time what the profile timed)."""
        return max(max(self.batches), REFERENCE_REQUESTS)

    def kv_tokens(self) -> int:
        """The engine's KV budget: the whole sequences, one block spare each, of the largest
        batch or of the reference batch timed after it (:func:`time_reference`), whichever
        needs more."""
        return max(max(self.batches) * (self.prompt_len + self.output_len + 16),
                   REFERENCE_REQUESTS * (REFERENCE_PROMPT + REFERENCE_TOKENS + 16))


def batch_cases(model_id: str, name: str, profile_dir: Path, runs: BatchRuns, seed: int, threads: int,
                device: str = "cpu", dtype: str = "float32", tp: int = 1, repeats: int = 1,
                say: Callable[[str], None] = lambda msg: None) -> list[dict]:
    """One engine (``model_id`` in ``dtype`` on ``device``) runs each batch of ``runs``
    ``repeats`` times (their median is the measured time, after one warm-up run of the
    batch); the prediction is the planner's simulation of the same requests with the
    profile ``name`` in ``profile_dir``, loads excluded."""
    import statistics

    vocab = model_spec(model_id, name).vocab
    engine = create_engine(engine_config(model_id, device, threads, seed, max_num_seqs=runs.max_num_seqs(),
                                         kv_cache_tokens=runs.kv_tokens(), tp=tp, dtype=dtype))
    params = SamplingParams(max_tokens=runs.output_len, ignore_eos=True)
    cluster = device_cluster(device, tp)
    cases = []
    try:
        for batch in runs.batches:
            say(f"validating {name} at batch {batch} ({runs.prompt_len} + {runs.output_len} tokens)")
            rng = seeded_rng(seed, "validate-batch", name, str(batch))
            prompts = random_prompts(rng, batch, runs.prompt_len, vocab)
            engine.generate(prompts, params)           # warm-up: kernels, graphs, allocator
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                outputs = engine.generate(prompts, params)
                times.append(time.perf_counter() - started)
            short = [o.output_len for o in outputs if o.output_len != runs.output_len]
            if short:       # the prediction is for exactly output_len tokens each
                raise RuntimeError(f"batch {batch}: {len(short)} request(s) ended after {short[:4]} tokens, "
                                   f"not {runs.output_len}")
            predicted = _predicted_batch(name, profile_dir, runs, batch, seed, tp, cluster)
            case = _case(f"{name} b={batch} ({runs.prompt_len}+{runs.output_len})", predicted, predicted,
                         statistics.median(times))
            cases.append(dict(case, batch=batch, runs_s=times))
        machine = _machine(engine, vocab, profile_dir, name, tp)
    finally:
        engine.release()
    return [dict(case, **machine) for case in cases]


def _predicted_batch(name: str, profile_dir: Path, runs: BatchRuns, batch: int, seed: int, tp: int,
                     cluster: ClusterSpec) -> float:
    problem = _node_problem(name, [runs.prompt_len] * batch, runs.output_len, profile_dir, seed, tp, cluster,
                            max(runs.batches), greedy=True)
    problem.node("m").output_len = np.full(batch, runs.output_len)
    run = StageEvaluator(problem).node_run(initial_state(problem), "m", ExecPlan(1, tp), False, {})
    return run.end - run.load_s


def _case(name: str, predicted: float, predicted_known: float, measured: float) -> dict:
    """``error`` is the planner's view (sampled output lengths); ``error_known_lengths``
    uses the lengths the engine really produced, isolating latency model and simulator."""
    return {"name": name, "predicted_s": predicted, "measured_s": measured,
            "error": (predicted - measured) / measured,
            "predicted_known_lengths_s": predicted_known,
            "error_known_lengths": (predicted_known - measured) / measured}


def dag_case(profile_dir: Path, requests: int, seed: int, threads: int,
             answer: str = DAG_MODELS[0], judge: str = DAG_MODELS[1]) -> dict:
    rng = seeded_rng(seed, "validate-dag")
    lengths = rng.integers(8, 128, requests)
    prompts = random_prompts(rng, requests, lengths, get_model(answer).vocab)
    started = time.perf_counter()
    first = create_engine(engine_config(answer, threads=threads, max_num_seqs=MAX_NUM_SEQS))
    answers = first.generate(prompts, _sampling(seed * 7_919, requests, ECDF_MAX_TOKENS))
    first.release()
    second = create_engine(engine_config(judge, threads=threads, max_num_seqs=MAX_NUM_SEQS))
    judged = second.generate([JUDGE_INSTRUCTION + a.token_ids for a in answers],
                             _sampling(seed * 104_729, requests, JUDGE_MAX_TOKENS))
    second.release()
    measured = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        source = _write_requests(Path(tmp) / "requests.jsonl", lengths)
        problem = _problem(f"""
requests: {{file: {source}}}
nodes:
  - {{name: answer, model: {answer}, max_output_tokens: {ECDF_MAX_TOKENS}}}
  - {{name: judge, model: {judge}, max_output_tokens: {JUDGE_MAX_TOKENS}, prompt: "{' '.join(['w'] * 9)} {{input}}"}}
edges: [{{from: input, to: answer}}, {{from: answer, to: judge}}]
""", profile_dir, seed)
        from raycolo.offline.policies import get_policy
        plan = get_policy("samullm")(problem)
        answered = np.array([a.output_len for a in answers])
        problem.node("answer").output_len = answered
        problem.node("judge").input_len = answered + len(JUDGE_INSTRUCTION)
        problem.node("judge").output_len = np.array([j.output_len for j in judged])
        known = get_policy("samullm")(problem)
    return _case(f"2-model DAG {answer} -> {judge} x{requests}", plan.makespan_s, known.makespan_s,
                 measured)


def _summed(runs: list[dict]) -> dict:
    """One case over several request sets: its errors over their summed times."""
    if len(runs) == 1:
        return runs[0]
    total = {k: sum(r[k] for r in runs) for k in ("predicted_s", "predicted_known_lengths_s", "measured_s")}
    case = _case(runs[0]["name"], total["predicted_s"], total["predicted_known_lengths_s"], total["measured_s"])
    machine = [r.get("machine_vs_profile") for r in runs]
    if all(m is not None for m in machine):
        case["machine_vs_profile"] = float(np.median(machine))
    return dict(case, runs=runs, set_errors=[r["error"] for r in runs])


def validate(profile_dir: str | Path, models=TINY_MODELS, requests: int = 48, seed: int = 4242,
             threads: int = 1, progress: Optional[Callable[[str], None]] = None, tp: int = 1,
             repeats: int = 1, batches: Optional[BatchRuns] = None, device: str = "cpu",
             dtype: str = "auto", names: Optional[dict[str, str]] = None) -> dict:
    """The held-out sampled request sets of the tiny models (and a 2-model application),
    on the CPU; or, with ``batches``, fixed-length batches of any model on ``device``, each
    in ``dtype`` (:func:`~raycolo.offline.profiler.resolve_dtype`; a checkpoint
    directory's profile is the one named ``names[directory]``, else the directory's name)."""
    from raycolo.offline.profiler import resolve_dtype

    say = progress or (lambda msg: None)
    profile_dir = Path(profile_dir)
    cases, dtypes = [], []
    if batches is None:
        if device != "cpu":
            raise ValueError("the sampled request sets run on the CPU; fixed-length batches run anywhere")
        missing = [m for m in DAG_MODELS if not profile_file(profile_dir, m, 1).exists()]
        if tp == 1 and missing:   # its plan would cost them by roofline defaults, not this machine
            say(f"not validating the 2-model application: {profile_dir} has no profile of {', '.join(missing)}")
        dag = tp == 1 and not missing
        # Request set by request set, every case in turn: a slow stretch of a shared machine
        # then falls on one set of several cases, not on every set of one case.
        sets: dict[str, list[dict]] = {m: [] for m in models}
        dag_sets: list[dict] = []
        for r in range(repeats):
            of = f" (request set {r + 1} of {repeats})" if repeats > 1 else ""
            for model_id in models:
                say(f"validating {model_id}" + (f" at tp={tp}" if tp > 1 else "") + of)
                sets[model_id].append(model_case(model_id, profile_dir, requests, seed + r, threads, tp))
            if dag:
                say("validating a 2-model application" + of)
                dag_sets.append(dag_case(profile_dir, requests, seed + r, threads))
        cases += [_summed(runs) for runs in [*sets.values(), dag_sets] if runs]
        dtypes.append("float32")
    else:
        for model_id in models:
            name = (names or {}).get(model_id) or model_spec(model_id).name
            dtypes.append(resolve_dtype(model_id, device, dtype))
            cases += batch_cases(model_id, name, profile_dir, batches, seed, threads, device, dtypes[-1], tp,
                                 repeats, say)
    machine = [c["machine_vs_profile"] for c in cases if c.get("machine_vs_profile") is not None]
    mape = float(np.mean([abs(c["error"]) for c in cases]))
    mape_known = float(np.mean([abs(c["error_known_lengths"]) for c in cases]))
    return {"cases": cases, "mape": mape, "mape_known_lengths": mape_known,
            "mean_signed_error": float(np.mean([c["error"] for c in cases])),
            "mean_signed_error_known_lengths": float(np.mean([c["error_known_lengths"] for c in cases])),
            "profile": str(profile_dir), "threads": threads, "tp": tp, "repeats": repeats,
            "device": device, "dtype": ",".join(sorted(set(dtypes))),
            "machine_vs_profile": float(np.median(machine)) if machine else None,
            "batches": None if batches is None else {"sizes": list(batches.batches), "prompt_len": batches.prompt_len,
                                                     "output_len": batches.output_len}}


def format_report(report: dict) -> str:
    lines = [f"{'case':<44} {'predicted_s':>11} {'measured_s':>10} {'error':>8} "
             f"{'known-lengths error':>19} {'machine':>8} {'one set':>15}"]
    for c in report["cases"]:
        machine = c.get("machine_vs_profile")
        sets = c.get("set_errors") or []
        spread = f"{min(sets):+.0%}..{max(sets):+.0%}" if len(sets) > 1 else "-"
        lines.append(f"{c['name']:<44} {c['predicted_s']:>11.2f} {c['measured_s']:>10.2f} "
                     f"{c['error']:>+8.1%} {c['error_known_lengths']:>+19.1%} "
                     f"{'-' if machine is None else f'x{machine:.2f}':>8} {spread:>15}")
    lines.append(f"{'mean signed error (+: predicted slower)':<44} {'':>11} {'':>10} "
                 f"{report['mean_signed_error']:>+8.1%} {report['mean_signed_error_known_lengths']:>+19.1%}")
    where = f"profile {report['profile']}, {report.get('dtype', 'float32')} on {report.get('device', 'cpu')}"
    if report.get("batches"):
        lines.append(f"MAPE {report['mape']:.1%} over fixed-length batches ({where}, median of "
                     f"{report['repeats']} timed run(s) per batch)")
    else:
        lines.append(f"MAPE {report['mape']:.1%} with sampled output lengths (the planner's prediction), "
                     f"{report['mape_known_lengths']:.1%} with the lengths the engine produced "
                     f"({where}, {report['threads']} thread(s), {report['repeats']} request set(s) per case)")
    lines.append("machine: a fixed reference batch timed beside each case over its time when the profile was "
                 "measured (x1.10: 10 % slower now; '-': the profile recorded none)")
    if report.get("repeats", 1) > 1 and not report.get("batches"):
        lines.append("one set: the lowest and highest error of the case's request sets alone (the sets run "
                     "in turn across the cases; the error above is over their summed times)")
    return "\n".join(lines)
