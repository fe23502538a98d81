"""Two ``StageProcess``es splitting a real-size model on one device (bench/gpu_realsize.py's
``stage.split2p`` row): each a spawned process holding half the layers (with an active
LoRA, decode through CUDA graphs on a GPU), hidden states between them over gloo (two
ranks on one GPU: NCCL refuses them), as a live node's stage workers run. Rank 0 times
each decode step from handing its op over until the sampled tokens come back from rank 1.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
import traceback


def _rank(rank: int, shape: str, device_str: str, dtype_name: str, batch: int, prompt: int, steps: int,
          store_path: str, tokens_q, results_q) -> None:
    try:
        import torch
        import torch.distributed as dist

        from realsize_models import BLOCK, add_active_lora, build_model, prompts_for
        from raycolo.online.stages.stage_model import StageModel
        from raycolo.online.stages.stage_ops import ForwardStep
        from raycolo.online.stages.stage_process import StageProcess

        device, dtype = torch.device(device_str), getattr(torch, dtype_name)
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)     # torch 2.11 refuses a device without an index
        dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
        model = add_active_lora(build_model(shape, device, dtype, seed=0)[0], seed=3)
        layers = model.config.num_hidden_layers
        bounds = (0, layers // 2) if rank == 0 else (layers // 2, layers)
        blocks = batch * -(-(prompt + steps + 2) // BLOCK) + 1
        stage = StageModel(model, bounds, blocks, BLOCK, cuda_graphs=True)
        proc = StageProcess(stage, rank, 2, model.config.hidden_size, dtype, dist)
        ps = prompts_for(model.config.vocab_size, batch, prompt, seed=batch)
        rids, toks, times = list(range(batch)), ps, []
        for step in range(steps + 1):
            t0 = time.perf_counter()
            op = ForwardStep(prefill=step == 0, requests=rids, seq=step + 1, after=step + 1,
                             counts=[len(t) for t in toks], tokens=toks if rank == 0 else None)
            result = proc.run(op)
            if rank == 1:
                new = result.tokens
                tokens_q.put(new)
            else:
                new = tokens_q.get(timeout=300)
                if step:
                    times.append(time.perf_counter() - t0)
            toks = [[int(t)] for t in new]
        proc.received(list(proc.pending))
        dist.barrier()
        results_q.put((rank, {"times": times}))
        dist.destroy_process_group()
    except BaseException as exc:     # noqa: BLE001 - reported to the parent
        results_q.put((rank, {"error": f"{type(exc).__name__}: {exc}"[:300], "trace": traceback.format_exc(limit=6)}))


def split_step(shape: str, device: str, dtype_name: str, batch: int, prompt: int, steps: int,
               timeout_s: float = 240.0) -> float:
    """Median seconds of one decode step through the two stage processes."""
    ctx = mp.get_context("spawn")
    tokens_q, results_q = ctx.Queue(), ctx.Queue()
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, shape, device, dtype_name, batch, prompt, steps, store,
                                                 tokens_q, results_q), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while len(results) < 2 and time.monotonic() < deadline:
                try:
                    rank, res = results_q.get(timeout=1.0)
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        break
                    continue
                results[rank] = res
                if "error" in res:
                    break
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
    errors = [f"stage {r}: {res['error']}\n{res['trace']}" for r, res in results.items() if "error" in res]
    if errors or 0 not in results:
        raise RuntimeError("; ".join(errors) or f"stage processes ended without a result "
                                                 f"(exit codes {[p.exitcode for p in procs]})")
    return statistics.median(results[0]["times"][1:] or results[0]["times"])
