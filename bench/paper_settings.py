"""Harli's and SIRIUS's headline settings, simulated with raycolo, and the sweeps that show
what separates raycolo's numbers from the papers'.

    .venv/bin/python bench/paper_settings.py [--seeds 0,1,2] [--json out/paper_settings.json]

(about 2 minutes of one core; docs/colocation-gaps.md reads the tables.)

* **Harli** (its §8.1-8.2, Fig. 11b): Llama3-8B decode on two GPUs beside a PEFT fine-tune
  job, a 40 ms TPOT target, a production trace of over 19,000 requests an hour (5.28/s),
  against SeparateMode (one GPU decodes, the other fine-tunes). Here: the ``llama-8b``
  preset on one GPU per node (``stages=1``), 2 nodes, as an Ada6000-48GB variant (the
  paper's headline GPU: raycolo's ``RTX_6000_ADA`` memory and bandwidth, so a decode step
  reads the weights at 960 GB/s) and as the preset itself (A100 80GB). Poisson inference at
  5.28/s (raycolo's hh-rlhf prompts and decode lengths); ``harli``, ``harli-static`` and
  ``separate``, with the TPOT target set to 40 ms (``tpot_multiplier``) and no weight syncs
  (Harli's fine-tune job trains its own copy, not the served weights: ``sync_every`` =
  2^40); fine-tune micro-batches of 2 samples (Harli §8.2) of hh-rlhf lengths. raycolo's
  ``harli`` runs a fine-tune op before a ready decode iteration while the iteration plus
  what ran since the last one plus the op meets the TPOT target
  (``HarliRule.between_iterations``): time slices in each iteration's slack.
  Sweep: the fine-tune op's duration (a fixed training length, so that its backward, the
  longest op, takes 5-40 ms; Harli §6.1 cuts its ops to about 10 ms), also with 8-token
  prompts, standing in for Harli's prefills on another GPU.
* **SIRIUS** (§6.6, Fig. 17; its headline, §6.1 Fig. 10, is on DNN models raycolo does not
  have): Llama2-13B served on one A100 80GB beside a training job, BurstGPT scaled to at most
  10 req/s, SLOs at 4x the standalone TTFT (170.2 ms) and TBT (20.7 ms). Here: the
  ``llama-13b`` preset (A100 80GB, 26 GB of weights, as SIRIUS's Table 3) on one GPU,
  raycolo's bursty arrivals at a mean of 2/s (its bursts run at 5x the mean: 10/s), TTFT SLO
  680.8 ms (``slo_ms``) and TBT SLO 82.8 ms (a request's mean gap between tokens);
  ``sirius`` vs ``sirius-timeshare`` (time sharing, the README's baseline),
  ``sirius-static`` (SP-50) and inference alone. raycolo fine-tunes the served model (LoRA),
  not a second model, so a training task is C samples of 96 tokens (hh-rlhf's median) on
  llama-13b: C = 4 takes 338 ms (Table 3: 346 ms a batch), C = 72 is the paper's batch.
  Sweeps: C from 4 to 72 (the task's memory as a share of the GPU's free memory: memory
  pressure), and at C = 72 ``overrun_slowdown`` (what over-committing memory costs the
  memory-blind baseline).

The fine-tune job is closed-loop (:class:`FinetuneJobSim`): it keeps ``inflight`` training
tasks in the system (Harli: 4 per GPU that fine-tunes; SIRIUS: 1), and each time one is
trained the next arrives, until the last request has arrived (a backlog queued at t = 0
would, oldest ready first, run every queued forward before any backward). Fine-tune
throughput is the samples trained by the time the last request arrived, over that time
(Harli: iterations/s x batch size; SIRIUS: samples/s); latency figures cover the requests
that arrived in that window. Each run is at most 1,000 tasks (inference + training); a run
that reached the cap measures up to the moment it did ("cap" in the tables). Medians over
the seeds; a ratio is the median of the per-seed ratios.
"""
from __future__ import annotations

import argparse
import bisect
from dataclasses import replace
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raycolo.online.lemix_params import LemixParams  # noqa: E402
from raycolo.online.policies import make_online_policy  # noqa: E402
from raycolo.online.profiles import GIB, RTX_6000_ADA, NodeProfile, preset  # noqa: E402
from raycolo.online.scheduling.stage_rules import TRAIN_KINDS, harli_rule  # noqa: E402
from raycolo.online.simulation.sim import ClusterSimulator  # noqa: E402
from raycolo.online.tasks import LENGTH_DISTRIBUTIONS, OnlineTask, bursty_workload, poisson_workload  # noqa: E402
from raycolo.rng import seeded_rng  # noqa: E402

MAX_TASKS = 1000            # inference + training tasks per run
TRAIN_ID0 = 1_000_000       # training task ids start here

# Harli §8.1: one-hour trace of over 19,000 requests; 40 ms TPOT; §8.2: micro-batches of 2.
HARLI_RATE = 19_000 / 3600
HARLI_TPOT_S = 0.040
HARLI_BATCH = 2
HARLI_REQUESTS = 150
HARLI_INFLIGHT = 4          # training tasks in the system per GPU that fine-tunes
# SIRIUS §6.6 / Table 3: SLO = 4 x standalone (TTFT 170.2 ms, TBT 20.7 ms), BurstGPT at <= 10 req/s.
SIRIUS_TTFT_SLO_S = 4 * 0.1702
SIRIUS_TBT_SLO_S = 4 * 0.0207
SIRIUS_RATE = 2.0           # raycolo's bursty_workload: bursts at 5x the mean = 10/s
SIRIUS_LENGTH = 96          # hh-rlhf's median query length


# --------------------------------------------------------------------------- simulation

class FinetuneJobSim(ClusterSimulator):
    """The simulator with a closed-loop fine-tune job: ``inflight`` training tasks start at
    t = 0, and each time one is trained the next arrives (``make_task(task_id, now)``)
    while ``now`` is before ``until`` and fewer than ``cap`` tasks were made."""

    def __init__(self, inference, profile, nodes, policy, params, make_task, inflight, until, cap):
        self.make_task, self.until, self.cap = make_task, until, cap
        self.next_id = TRAIN_ID0
        self.cap_reached_s = None
        first = [self._new(0.0) for _ in range(min(inflight, cap))]
        super().__init__(list(inference) + first, profile, nodes, policy, params)
        recorded = self.cluster.metrics.trained

        def trained(task, now):
            recorded(task, now)
            if task.task_id < TRAIN_ID0 or now >= self.until:
                return
            if self.next_id - TRAIN_ID0 >= self.cap:
                self.cap_reached_s = now if self.cap_reached_s is None else self.cap_reached_s
                return
            new = self._new(now)
            self.tasks.append(new)
            self._at(now, self._arrive, new, False)     # the job's next micro-batch arrives

        self.cluster.metrics.trained = trained

    def _new(self, now):
        task = self.make_task(self.next_id, now)
        self.next_id += 1
        return task


def run(policy: str, profile: NodeProfile, nodes: int, params: LemixParams, inference, make_task,
        inflight: int, tpot_s: float, ttft_slo_s: float) -> dict:
    until = max(t.arrival_s for t in inference) if inference else 0.0
    cap = MAX_TASKS - len(inference)
    sim = FinetuneJobSim(inference, profile, nodes,
                         make_online_policy(policy, params, nodes=nodes, train_rate=0.5),
                         params, make_task, inflight if inflight else 0, until, cap)
    result = sim.run()
    m = sim.cluster.metrics
    window = min(until, sim.cap_reached_s) if sim.cap_reached_s is not None else until
    trained = [t for t in sim.tasks if t.task_id >= TRAIN_ID0 and t.task_id in m.e2e
               and t.arrival_s + m.e2e[t.task_id] <= window]
    missing = [t.task_id for t in sim.tasks if t.task_id < TRAIN_ID0 and m.completions.get(t.task_id) != 1]
    if missing:
        raise RuntimeError(f"{policy}: {len(missing)} requests not completed exactly once")
    inside = [t.task_id for t in inference if t.arrival_s <= window]
    ttft = np.array([m.ttft[i] for i in inside])
    tbt = np.array([m.tbt[i] for i in inside])
    gpu_s = nodes * profile.stages * window
    train_s = sum(max(0.0, min(end, window) - start) for start, end, _, _, kind, _ in sim.cluster.op_log
                  if kind in TRAIN_KINDS and start < window)
    rules = [n.rule for n in sim.cluster.nodes]
    train_ops, between = between_iterations(sim.cluster.op_log, window)
    return {
        "train_ops": train_ops, "train_ops_between": between,
        "finetune_samples_per_s": sum(t.batch for t in trained) / window if window > 0 else 0.0,
        "train_gpu_share": train_s / gpu_s if gpu_s > 0 else 0.0,
        "window_s": window, "capped": sim.cap_reached_s is not None,
        "requests": len(inside), "tasks": len(sim.tasks),
        "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)), "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
        "tpot_p50_ms": 1e3 * float(np.percentile(tbt, 50)), "tpot_p99_ms": 1e3 * float(np.percentile(tbt, 99)),
        "tpot_over": float((tbt > tpot_s).mean()), "ttft_slo": float((ttft <= ttft_slo_s).mean()),
        "tbt_slo": float((tbt <= tpot_s).mean()),
        "paused": sum(getattr(r, "paused", 0) for r in rules),
        "aborts": result.training_aborts, "splits": result.training_splits,
        "overruns": result.overruns, "memory_waits": result.memory_waits, "offloads": result.offloads,
    }


def between_iterations(op_log, window: float) -> tuple[int, int]:
    """Training ops started before ``window``, and how many of them ran between two decode
    iterations of the same request on their stage (while that request was decoding)."""
    decodes: dict = {}
    for start, end, node, stage, kind, ids in op_log:
        if kind == "decode":
            decodes.setdefault((node, stage), []).append((start, end, set(ids)))
    index = {}
    for key, ops in decodes.items():
        by_end = sorted(ops, key=lambda o: o[1])
        by_start = sorted(ops, key=lambda o: o[0])
        index[key] = ([o[1] for o in by_end], by_end, [o[0] for o in by_start], by_start)
    total = between = 0
    for start, end, node, stage, kind, _ in op_log:
        if kind not in TRAIN_KINDS or start >= window:
            continue
        total += 1
        if (node, stage) not in index:
            continue
        ends, by_end, starts, by_start = index[(node, stage)]
        i = bisect.bisect_right(ends, start + 1e-12) - 1
        j = bisect.bisect_left(starts, end - 1e-12)
        if i >= 0 and j < len(by_start) and by_end[i][2] & by_start[j][2]:
            between += 1
    return total, between


def median_over(seeds, fn) -> dict:
    """fn(seed) -> {policy: metrics}; the per-key medians, and the per-seed runs."""
    per_seed = [fn(s) for s in seeds]
    out = {}
    for policy in per_seed[0]:
        runs = [r[policy] for r in per_seed]
        med = {k: statistics.median(float(r[k]) for r in runs) for k in runs[0] if k != "capped"}
        med["capped"] = sum(bool(r["capped"]) for r in runs)
        med["per_seed"] = runs
        out[policy] = med
    return out


def ratio(meds: dict, policy: str, base: str, key: str) -> float:
    """The median over seeds of policy/base for ``key``."""
    vals = [a[key] / b[key] if b[key] else math.nan
            for a, b in zip(meds[policy]["per_seed"], meds[base]["per_seed"])]
    return statistics.median(vals)


# --------------------------------------------------------------------------- Harli

def ada6000(profile: NodeProfile) -> NodeProfile:
    """``profile`` on raycolo's RTX 6000 Ada 48GB: its memory, and decode steps reading the
    stage's weights at its bandwidth (η stays the preset's: Table II has no Ada figure for Llama)."""
    return NodeProfile.model_validate({**profile.model_dump(), "name": f"{profile.name}@ada6000-48g",
                                       "gpu_memory_bytes": RTX_6000_ADA.memory_bytes,
                                       "decode_floor_s": profile.weight_bytes_per_stage / RTX_6000_ADA.bandwidth})


def harli_params(profile: NodeProfile) -> LemixParams:
    """Harli's 40 ms TPOT target as raycolo's ``tpot_multiplier``, and no weight syncs."""
    base = LemixParams()
    single = harli_rule(profile, base).tpot_target_s / base.tpot_multiplier
    return LemixParams(tpot_multiplier=HARLI_TPOT_S / single, sync_every=1 << 40)


def harli_tasks(seed: int, length=None, prompt=None):
    """Harli's inference trace (Poisson at 5.28/s; hh-rlhf prompts, or all of ``prompt``
    tokens) and its fine-tune job's task maker (micro-batches of 2; hh-rlhf lengths, or
    ``length``)."""
    inference = poisson_workload(HARLI_RATE, 0.0, HARLI_REQUESTS, seed=seed)
    if prompt is not None:
        inference = [replace(t, length=prompt) for t in inference]
    lengths = LENGTH_DISTRIBUTIONS["hh-rlhf"].sample(MAX_TASKS, seeded_rng(seed, "paper-settings", "harli-ft"))

    def make(task_id, now):
        ell = int(length) if length else int(lengths[(task_id - TRAIN_ID0) % len(lengths)])
        return OnlineTask(task_id, "train", now, ell, batch=HARLI_BATCH)
    return inference, make


HARLI_POLICIES = ("harli", "separate", "harli-static")


def harli_runs(profile: NodeProfile, seed: int, policies=HARLI_POLICIES, length=None, prompt=None) -> dict:
    params = harli_params(profile)
    inference, make = harli_tasks(seed, length, prompt)
    out = {}
    for p in policies:
        inflight = HARLI_INFLIGHT * (1 if p == "separate" else 2)   # per GPU that fine-tunes
        out[p] = run(p, profile, 2, params, inference, make, inflight, HARLI_TPOT_S, math.inf)
    return out


def backward_length(profile: NodeProfile, op_s: float) -> int:
    """The training length whose backward of a micro-batch of 2 takes ``op_s`` on a stage."""
    return max(1, round(math.sqrt(op_s / (HARLI_BATCH * profile.eta_b))))


# --------------------------------------------------------------------------- SIRIUS

def sirius_requests(profile: NodeProfile, batch: int) -> int:
    """Requests per run: as many as keep inference + training within MAX_TASKS (at most
    900), so that a run of large training tasks still completes a few dozen of them."""
    task_s = profile.forward_s(batch, SIRIUS_LENGTH) + profile.backward_s(batch, SIRIUS_LENGTH)
    per_request = 0.6 / SIRIUS_RATE / task_s          # training tasks per request at a 60 % share
    return min(900, int(MAX_TASKS / (1 + per_request)))


def sirius_tasks(seed: int, batch: int, requests: int):
    inference = bursty_workload(SIRIUS_RATE, 0.0, requests, seed=seed)

    def make(task_id, now):
        return OnlineTask(task_id, "train", now, SIRIUS_LENGTH, batch=batch)
    return inference, make


SIRIUS_POLICIES = ("sirius", "sirius-timeshare", "sirius-static")


def sirius_runs(profile: NodeProfile, seed: int, batch: int, policies=SIRIUS_POLICIES,
                infer_only: bool = True, overrun_slowdown: float = 2.0) -> dict:
    params = LemixParams(slo_ms=1e3 * SIRIUS_TTFT_SLO_S, overrun_slowdown=overrun_slowdown)
    inference, make = sirius_tasks(seed, batch, sirius_requests(profile, batch))
    out = {p: run(p, profile, 1, params, inference, make, 1, SIRIUS_TBT_SLO_S, SIRIUS_TTFT_SLO_S)
           for p in policies}
    if infer_only:
        out["inference alone"] = run("sirius", profile, 1, params, inference, make, 0,
                                     SIRIUS_TBT_SLO_S, SIRIUS_TTFT_SLO_S)
    return out


def memory_share(profile: NodeProfile, batch: int) -> float:
    """A training task's memory over the stage's free memory."""
    return profile.train_bytes(batch, SIRIUS_LENGTH) / profile.free_bytes


# --------------------------------------------------------------------------- printing

def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def cap_mark(r: dict) -> str:
    return f" (cap: {int(r['capped'])} seeds)" if r["capped"] else ""


def between_share(r: dict) -> str:
    return pct(r["train_ops_between"] / r["train_ops"]) if r["train_ops"] else "-"


HARLI_SWEEP_MS = (5, 10, 20, 25, 30, 40)
SHORT_PROMPT = 8
SIRIUS_SWEEP_C = (4, 32, 48, 56, 64, 68, 72)
SIRIUS_SLOWDOWNS = (1, 2, 4, 5, 6, 8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.perf_counter()
    report: dict = {"seeds": seeds}

    # ---- Harli: the paper's setting
    llama8 = preset("llama-8b", 1)
    profiles = {"Ada6000 48GB": ada6000(llama8), "A100 80GB": llama8}
    print(f"## Harli's setting (§8.1-8.2): llama-8b, 1 GPU per node, 2 nodes, Poisson {HARLI_RATE:.2f} req/s "
          f"({HARLI_REQUESTS} requests), TPOT target {1e3 * HARLI_TPOT_S:.0f} ms, fine-tune micro-batches of "
          f"{HARLI_BATCH} (hh-rlhf lengths), no weight syncs; seeds {args.seeds}, medians\n")
    for gpu, prof in profiles.items():
        print(f"* {gpu}: decode step floor {1e3 * prof.decode_floor_s:.1f} ms; `tpot_multiplier` "
              f"{harli_params(prof).tpot_multiplier:.2f} (target 40 ms); fine-tune micro-batch of 2 x 96 tokens: "
              f"forward {1e3 * prof.forward_s(2, 96):.1f} ms, backward {1e3 * prof.backward_s(2, 96):.1f} ms")
    print("\n| GPU | policy | fine-tune samples/s | vs `separate` | GPU time fine-tuning "
          "| fine-tune ops between two decode iterations | TPOT p50/p99 ms | requests over 40 ms TPOT | TTFT p99 ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    report["harli"] = {}
    for gpu, prof in profiles.items():
        meds = median_over(seeds, lambda s: harli_runs(prof, s, HARLI_POLICIES))
        report["harli"][gpu] = {"profile": prof.model_dump(), "tpot_multiplier": harli_params(prof).tpot_multiplier,
                                "runs": meds}
        for p, r in meds.items():
            print(f"| {gpu} | `{p}` | {r['finetune_samples_per_s']:.2f}{cap_mark(r)} | "
                  f"{ratio(meds, p, 'separate', 'finetune_samples_per_s'):.2f}x | {pct(r['train_gpu_share'])} | "
                  f"{between_share(r)} | {r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} | {pct(r['tpot_over'])} | "
                  f"{r['ttft_p99_ms']:.0f} |")

    # ---- Harli: the sweep of the fine-tune op's duration
    print(f"\n## Harli, sensitivity: the fine-tune op's duration (a fixed training length such that a micro-batch "
          f"of {HARLI_BATCH}'s backward, its longest op, takes the given time; same setting)\n")
    print(f"Right-hand columns: every prompt {SHORT_PROMPT} tokens, so that a prefill costs next to nothing on "
          "the decode GPU (Harli serves prefills on another GPU, §8.1; raycolo cannot).\n")
    print("| GPU | backward / forward op ms | length | `separate` samples/s | `harli` / separate "
          "| harli GPU time fine-tuning | harli TPOT p99 ms | harli requests over 40 ms "
          "| short prompts: `harli` / separate | short prompts: requests over 40 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    report["harli_sweep"] = []
    for gpu, prof in profiles.items():
        for op_ms in HARLI_SWEEP_MS:
            ell = backward_length(prof, op_ms / 1e3)
            meds = median_over(seeds, lambda s: harli_runs(prof, s, ("harli", "separate"), ell))
            ha, sep = meds["harli"], meds["separate"]
            row = {"gpu": gpu, "backward_ms": 1e3 * prof.backward_s(HARLI_BATCH, ell),
                   "forward_ms": 1e3 * prof.forward_s(HARLI_BATCH, ell), "length": ell,
                   "harli_ratio": ratio(meds, "harli", "separate", "finetune_samples_per_s"), "runs": meds}
            short = median_over(seeds, lambda s: harli_runs(prof, s, ("harli", "separate"), ell, SHORT_PROMPT))
            row["short_prompt_ratio"] = ratio(short, "harli", "separate", "finetune_samples_per_s")
            row["short_prompt_runs"] = short
            report["harli_sweep"].append(row)
            capped = max(r["capped"] for r in list(meds.values()) + list(short.values()))
            print(f"| {gpu} | {row['backward_ms']:.1f} / {row['forward_ms']:.1f} | {ell} | "
                  f"{sep['finetune_samples_per_s']:.2f}{' (cap)' if capped else ''} | {row['harli_ratio']:.2f}x | "
                  f"{pct(ha['train_gpu_share'])} | {ha['tpot_p99_ms']:.1f} | {pct(ha['tpot_over'])} | "
                  f"{row['short_prompt_ratio']:.2f}x | {pct(short['harli']['tpot_over'])} |")

    # ---- SIRIUS: the paper's LLM setting
    llama13 = preset("llama-13b", 1)
    print(f"\n## SIRIUS's LLM setting (§6.6, Fig. 17): llama-13b on one A100 80GB, bursty arrivals at a mean of "
          f"{SIRIUS_RATE:g} req/s (bursts at {5 * SIRIUS_RATE:g}/s), TTFT SLO {1e3 * SIRIUS_TTFT_SLO_S:.1f} ms, "
          f"TBT SLO {1e3 * SIRIUS_TBT_SLO_S:.1f} ms, one training task of C x {SIRIUS_LENGTH} tokens at a time; "
          f"seeds {args.seeds}, medians\n")
    print(f"* llama-13b, 1 GPU: free memory {llama13.free_bytes / GIB:.0f} GiB; a training sample of {SIRIUS_LENGTH} "
          f"tokens holds {llama13.train_bytes(1, SIRIUS_LENGTH) / GIB:.2f} GiB, forward "
          f"{1e3 * llama13.forward_s(1, SIRIUS_LENGTH):.1f} ms, backward {1e3 * llama13.backward_s(1, SIRIUS_LENGTH):.1f} ms; "
          f"a request reserves KV for its prompt + 512 tokens ({llama13.inference_bytes(1, 96 + 512) / GIB:.2f} GiB at "
          f"a 96-token prompt); decode step floor {1e3 * llama13.decode_floor_s:.1f} ms\n")
    print("| C (task memory / free) | requests | policy | training samples/s | vs timeshare | GPU time training "
          "| TTFT SLO | TBT SLO | TTFT p99 ms | aborts | splits | overruns | memory waits |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    report["sirius"] = {}
    for batch in (4, 72):
        meds = median_over(seeds, lambda s: sirius_runs(llama13, s, batch))
        report["sirius"][batch] = meds
        for p, r in meds.items():
            vs = "" if p == "inference alone" else f"{ratio(meds, p, 'sirius-timeshare', 'finetune_samples_per_s'):.2f}x"
            print(f"| {batch} ({pct(memory_share(llama13, batch))}) | {r['requests']:.0f} | `{p}` | "
                  f"{r['finetune_samples_per_s']:.2f}{cap_mark(r)} | {vs} | {pct(r['train_gpu_share'])} | "
                  f"{pct(r['ttft_slo'])} | {pct(r['tbt_slo'])} | {r['ttft_p99_ms']:.0f} | {r['aborts']:.0f} | "
                  f"{r['splits']:.0f} | {r['overruns']:.0f} | {r['memory_waits']:.0f} |")

    # ---- SIRIUS: the memory-pressure sweep
    print("\n## SIRIUS, sensitivity: memory pressure (training task size C; same setting)\n")
    print("| C | task memory / free memory | sirius samples/s | timeshare samples/s | sirius / timeshare "
          "| TTFT SLO sirius / timeshare | timeshare overruns | sirius aborts / splits |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    report["sirius_sweep"] = []
    for batch in SIRIUS_SWEEP_C:
        meds = median_over(seeds, lambda s: sirius_runs(llama13, s, batch, ("sirius", "sirius-timeshare"), False))
        si, ts = meds["sirius"], meds["sirius-timeshare"]
        row = {"batch": batch, "memory_share": memory_share(llama13, batch),
               "ratio": ratio(meds, "sirius", "sirius-timeshare", "finetune_samples_per_s"),
               "slo_ratio": ratio(meds, "sirius", "sirius-timeshare", "ttft_slo"), "runs": meds}
        report["sirius_sweep"].append(row)
        print(f"| {batch} | {pct(row['memory_share'])} | {si['finetune_samples_per_s']:.2f} | "
              f"{ts['finetune_samples_per_s']:.2f} | {row['ratio']:.2f}x | {pct(si['ttft_slo'])} / {pct(ts['ttft_slo'])} | "
              f"{ts['overruns']:.0f} | {si['aborts']:.0f} / {si['splits']:.0f} |")

    # ---- SIRIUS: what over-committing memory costs the memory-blind baseline
    print("\n## SIRIUS, sensitivity: what an overrun costs time sharing (`overrun_slowdown`, C = 72)\n")
    print("| overrun_slowdown | sirius samples/s | timeshare samples/s | sirius / timeshare | TTFT SLO sirius / timeshare "
          "| timeshare overruns |")
    print("|---:|---:|---:|---:|---:|---:|")
    report["sirius_overrun_sweep"] = []
    for slowdown in SIRIUS_SLOWDOWNS:
        meds = median_over(seeds, lambda s: sirius_runs(llama13, s, 72, ("sirius", "sirius-timeshare"), False,
                                                       float(slowdown)))
        si, ts = meds["sirius"], meds["sirius-timeshare"]
        row = {"overrun_slowdown": slowdown, "ratio": ratio(meds, "sirius", "sirius-timeshare", "finetune_samples_per_s"),
               "runs": meds}
        report["sirius_overrun_sweep"].append(row)
        print(f"| {slowdown} | {si['finetune_samples_per_s']:.2f} | {ts['finetune_samples_per_s']:.2f} | "
              f"{row['ratio']:.2f}x | {pct(si['ttft_slo'])} / {pct(ts['ttft_slo'])} | {ts['overruns']:.0f} |")

    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        from common import write_json
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
