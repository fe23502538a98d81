"""gpu-check's stage rows: ``stage.inproc`` (StageModel slices with LoRA in one process) and
``stage.p2p`` (two stage processes over a real process group), both against peft, and
``stage.versions`` (a step mixing adapter versions as one batched-LoRA pass)."""
from __future__ import annotations

import os
import tempfile
import time
import traceback

from raycolo.gpu_check.common import CUTS, MODEL, PASS, Row, _model, _prompts, _random_lora_b, _require, _train_chain
from raycolo.gpu_check.references import _hf_greedy, _reference, _reference_training


def _stage_chain(device, dtype: str = "float64"):
    from raycolo.online.stages.stage_model import LoraSettings, StageModel, add_lora

    lora = LoraSettings(rank=4, alpha=8, lr=1e-2, seed=3)
    chain = []
    for a, b in zip(CUTS[:-1], CUTS[1:]):
        # as a stage worker builds it: the model in host memory, only the stage's part moved
        model = add_lora(_model(MODEL, dtype, "cpu"), lora)
        chain.append(StageModel(model, (a, b), 64, 16, lr=lora.lr, device=device))
    return chain, lora


def _training_batch():
    from raycolo.online.stages.stage_model import training_batch

    return training_batch([(p, p[1:6]) for p in _prompts([8, 13, 5], seed=4)])


def check_stage_inproc(device) -> Row:
    ps = _prompts([9, 23, 14])
    chain, lora = _stage_chain(device)
    rids = list(range(len(ps)))
    hidden = None
    for st in chain:
        hidden = st.forward(rids, ps, hidden)
    outs = [[int(t)] for t in hidden.argmax(-1).tolist()]
    for _ in range(11):
        hidden = None
        for st in chain:
            hidden = st.forward(rids, [[o[-1]] for o in outs], hidden)
        for o, t in zip(outs, hidden.argmax(-1).tolist()):
            o.append(int(t))
    ref = _reference(MODEL, device)      # a fresh LoRA (B = 0) is the base model
    _require(outs == [_hf_greedy(ref, p, 12) for p in ps], "stage serving tokens differ from generate()")
    for st in chain:
        for rid in rids:
            st.release(rid)
    batch = _training_batch()
    ids, labels, lengths = batch
    ref_losses, ref_state = _reference_training(lora, batch, 2, device)
    losses = []
    for task in range(2):
        x = ids.to(device)
        for st in chain[:-1]:
            x = st.train_forward(task, x, lengths)
        losses.append(float(chain[-1].train_forward(task, x, lengths, labels.to(device)).detach()))
        grad = None
        for st in reversed(chain):
            grad = st.train_backward(task, grad)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    _require(loss_diff < 1e-8, f"training losses {losses} vs peft's {ref_losses}")
    merged = {}
    for st in chain:
        merged.update({k: v.detach().cpu() for k, v in st.lora_state().items()})
    _require(set(merged) == set(ref_state), "LoRA state keys differ from peft's")
    wdiff = max(float((merged[k] - ref_state[k]).abs().max()) for k in ref_state)
    _require(wdiff < 1e-8, f"LoRA weights after 2 steps differ from peft's by {wdiff:.3g}")
    return Row("stage.inproc", PASS, {"tokens_equal": f"{12 * len(ps)}/{12 * len(ps)}",
                                      "loss_diff": loss_diff, "lora_diff": wdiff},
               f"{len(chain)} StageModels, serve + 2 LoRA steps vs peft")


def check_stage_versions(device) -> Row:
    """A step mixing adapter versions (a saved version, the latest adapter after a training
    step, the base model) as one batched-LoRA pass (row_versions.py) against the same
    stages running one pass per version, float64, every projection under LoRA."""
    from raycolo.online.stages.peft_format import export_adapter
    from raycolo.online.stages.stage_model import LoraSettings, StageModel, add_lora

    lora = LoraSettings(rank=4, alpha=8, lr=1e-2, seed=3,
                        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))

    def chain(batched: bool):
        out = []
        for a, b in zip(CUTS[:-1], CUTS[1:]):
            st = StageModel(add_lora(_model(MODEL, "float64", device), lora), (a, b), 64, 16, lr=lora.lr,
                            batched_versions=batched)
            _random_lora_b(st)
            out.append(st)
        return out

    one, per = chain(True), chain(False)
    with tempfile.TemporaryDirectory() as tmp:
        saved = export_adapter([st.lora_state() for st in one], lora, os.path.join(tmp, "v1"))
        for stages in (one, per):         # the latest adapter moves away from the saved one
            _train_chain(stages, _training_batch(), device, 0)
        rids = [0, 1, 2, 3]
        versions = {"base": [2], "pinned": {0: str(saved), 3: str(saved)}}
        toks, worst, passes = _prompts([9, 23, 14, 6]), 0.0, []
        run = one[0].executor.execute
        one[0].executor.execute = lambda *a, **k: passes.append(1) or run(*a, **k)
        for _ in range(4):
            outs = []
            for stages in (one, per):
                hidden = None
                for st in stages:
                    hidden = st.forward(rids, toks, hidden, **versions)
                outs.append(hidden)
            worst = max(worst, float((outs[0] - outs[1]).abs().max()))
            toks = [[int(t)] for t in outs[1].argmax(-1).tolist()]
    _require(worst < 1e-10, f"one batched-LoRA pass differs from a pass per version by {worst:.3g}")
    _require(len(passes) == 4, f"the first stage ran {len(passes)} passes for 4 mixed steps")
    return Row("stage.versions", PASS, {"max_abs_diff": worst, "passes": f"{len(passes)} (not 12)"},
               f"{MODEL} float64, LoRA on every projection, saved + latest + base rows in one pass")


# stage.p2p: each rank is a spawned process that runs the real StageProcess over a process group.
P2P_STEPS = 8
P2P_PROMPTS = (9, 23, 14)


def _p2p_rank(rank: int, backend: str, device_str: str, store_path: str, tokens_q, results_q) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        from raycolo.online.stages.stage_ops import ForwardStep, TrainBackward, TrainForward
        from raycolo.online.stages.stage_process import StageProcess, p2p_group
        device = torch.device(device_str)
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        store = dist.FileStore(store_path, 2)
        dist.init_process_group(backend, store=store, rank=rank, world_size=2,
                                **({"device_id": device} if backend == "nccl" else {}))
        chain, _ = _stage_chain(device)
        st = chain[rank]
        # as the stage workers run it: over NCCL, the tensors still go on a gloo group
        proc = StageProcess(st, rank, 2, st.model.config.hidden_size, torch.float64, dist, p2p_group(dist))
        ps = _prompts(P2P_PROMPTS)
        rids = list(range(len(ps)))
        counts = [len(p) for p in ps]
        outs = [[] for _ in ps]
        seq = 0
        for step in range(P2P_STEPS):
            seq += 1
            toks = ps if step == 0 else [[o[-1]] for o in outs]
            op = ForwardStep(prefill=step == 0, requests=rids, seq=seq, after=seq,
                             counts=counts if step == 0 else [1] * len(ps), tokens=toks if rank == 0 else None)
            result = proc.run(op)
            new = result.tokens if rank == 1 else tokens_q.get(timeout=120)
            if rank == 1:
                tokens_q.put(new)
            for o, t in zip(outs, new):
                o.append(int(t))
        # one pipelined training step: train_f on both stages, then train_b back
        samples = [(p, p[1:6]) for p in _prompts([8, 13, 5], seed=4)]
        ids, _, lengths = _training_batch()
        shape = list(ids.shape)
        f = TrainForward(task=1, samples=samples, shape=shape, lengths=lengths, seq=1000 + rank, after=1000,
                         beta=0.1)
        result = proc.run(f)
        proc.run(TrainBackward(task=1, shape=shape, seq=2000 + rank, after=2001))
        proc.received(list(proc.pending))
        dist.barrier()
        # numpy, not tensors: torch pickles tensors through shared memory, gone with this process
        state = {k: v.detach().cpu().numpy() for k, v in st.lora_state().items()}
        results_q.put((rank, {"tokens": outs, "loss": result.loss, "state": state}))
        dist.destroy_process_group()
    except BaseException as exc:     # noqa: BLE001 - reported as the row's failure
        results_q.put((rank, {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                              "trace": traceback.format_exc(limit=6)}))


def check_stage_p2p(device) -> Row:
    import multiprocessing as mp
    import queue

    import torch

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and gpus >= 2:
        backend, devices, how = "nccl", ["cuda:0", "cuda:1"], "NCCL group, tensors over gloo, one GPU per stage"
    elif device.type == "cuda":
        backend, devices, how = "gloo", ["cuda:0", "cuda:0"], "gloo, both stages on one GPU"
    else:
        backend, devices, how = "gloo", ["cpu", "cpu"], "gloo on CPU"
    ctx = mp.get_context("spawn")
    tokens_q, results_q = ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_p2p_rank, args=(r, backend, devices[r], store, tokens_q, results_q),
                             daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + 120        # two tiny stages: seconds; under device_run's 200 s
        try:
            while len(results) < 2 and time.monotonic() < deadline:
                try:
                    rank, res = results_q.get(timeout=1.0)
                except queue.Empty:
                    # both gone, or one died (a crash leaves its peer blocked in a receive)
                    if all(p.exitcode is not None for p in procs) or \
                            any(p.exitcode not in (None, 0) for p in procs):
                        break
                    continue
                results[rank] = res
                if "error" in res:
                    break
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
    errors = [f"stage {r}: {res['error']}" for r, res in sorted(results.items()) if "error" in res]
    _require(not errors, "; ".join(errors) + f" [{how}]")
    _require(len(results) == 2, f"stage processes ended without a result "
                                f"(exit codes {[p.exitcode for p in procs]}) [{how}]")
    ps = _prompts(P2P_PROMPTS)
    ref = _reference(MODEL, device)
    refs = [_hf_greedy(ref, p, P2P_STEPS) for p in ps]
    _require(results[0]["tokens"] == refs and results[1]["tokens"] == refs,
             f"pipelined greedy tokens differ from generate() [{how}]")
    from raycolo.online.stages.stage_model import LoraSettings
    ref_losses, ref_state = _reference_training(LoraSettings(rank=4, alpha=8, lr=1e-2, seed=3),
                                                _training_batch(), 1, device)
    loss_diff = abs(results[1]["loss"] - ref_losses[0])
    _require(loss_diff < 1e-8, f"pipelined loss {results[1]['loss']} vs peft's {ref_losses[0]} [{how}]")
    merged = {k: torch.from_numpy(v) for r in (0, 1) for k, v in results[r]["state"].items()}
    _require(set(merged) == set(ref_state), "LoRA state keys differ from peft's")
    wdiff = max(float((merged[k] - ref_state[k]).abs().max()) for k in ref_state)
    _require(wdiff < 1e-8, f"LoRA weights after the pipelined step differ by {wdiff:.3g} [{how}]")
    n = P2P_STEPS * len(ps)
    return Row("stage.p2p", PASS, {"tokens_equal": f"{n}/{n}", "loss_diff": loss_diff, "lora_diff": wdiff},
               f"StageProcess x2, {how}")
