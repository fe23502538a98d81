"""gpu-check's engine rows: ``torch_engine`` (TorchEngine on the device), ``device_stats``
(NVML against CUDA's own figures) and ``vllm``."""
from __future__ import annotations

import tempfile
import time
import weakref

from raycolo.batching.step_scheduler import StepKind
from raycolo.gpu_check.common import MODEL, PASS, SKIP, Row, _model, _prompts, _require, _sync
from raycolo.gpu_check.references import _greedy_agreement, _hf_greedy


def check_torch_engine(device) -> Row:
    import torch

    from raycolo.engine.base import SamplingParams
    from raycolo.engine.executor.graphs import graph_attempts
    from raycolo.engine.factory import create_engine

    ps = _prompts([9, 23, 14, 40])
    ref = _model(MODEL, "float64", "cpu").eval()
    refs = [_hf_greedy(ref, p, 16) for p in ps]
    on_cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if on_cuda else None
    engine = create_engine({"backend": "torch",
                            "model_loading_config": {"model_id": MODEL, "dtype": "float64"},
                            "engine_kwargs": {"device": str(device), "max_num_seqs": 8,
                                              "kv_cache_tokens": 4096, "cpu_threads": 1}})
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    try:
        got = [o.token_ids for o in engine.generate(ps, params)]
        _require(got == refs, "engine tokens differ from transformers' generate()")
        figures = {"tokens_equal": f"{16 * len(ps)}/{16 * len(ps)}"}
        # prompt log-probabilities (every prompt position's logits on the device, scored there)
        scored = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))
        same = 0
        for p, out in zip(ps, scored):
            with torch.no_grad():
                lp = torch.log_softmax(ref(torch.tensor([p])).logits[0], -1)
            for j, e in enumerate(out.prompt_logprobs[1:], 1):
                row = lp[j - 1]
                same += (e.token == p[j] and abs(e.logprob - float(row[p[j]])) < 1e-5     # scored in float32, as vLLM
                         and e.rank == int((row >= row[p[j]]).sum())
                         and [t for t, _ in e.top] == torch.topk(row, 2).indices.tolist())
        positions = sum(len(p) - 1 for p in ps)
        _require(same == positions, f"prompt log-probabilities: {same}/{positions} positions equal transformers'")
        figures["prompt_logprobs_equal"] = f"{same}/{positions}"
        decode = [r.seconds for r in engine.stats.iterations if r.kind == StepKind.DECODE]
        if decode:
            figures["ms_decode_iter"] = 1000 * sorted(decode)[len(decode) // 2]
        # the steps that captured a CUDA graph say so (raycolo profile leaves them out of
        # its fit); the same shapes again replay what was captured
        captured = sum(r.graph_capture for r in engine.stats.iterations)
        _require(captured == engine.executor.graph_captures == graph_attempts(engine.executor),
                 "steps flagged as capturing != graphs captured (or a capture failed)")
        if engine.executor.graph_captures:
            engine.stats.iterations.clear()
            engine.generate(ps, params)
            _require(not any(r.graph_capture for r in engine.stats.iterations), "the same shapes captured again")
            figures["graph_capture_steps"] = captured
        # seeded sampling (on the logits' device, from counter-based random bits that are the
        # same on every device) must not depend on the device
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
        drawn = [o.token_ids for o in engine.generate(ps, seeded)]
        if device.type != "cpu":
            cpu_engine = create_engine({"backend": "torch",
                                        "model_loading_config": {"model_id": MODEL, "dtype": "float64"},
                                        "engine_kwargs": {"device": "cpu", "max_num_seqs": 8,
                                                          "kv_cache_tokens": 4096}})
            try:
                cpu_drawn = [o.token_ids for o in cpu_engine.generate(ps, seeded)]
            finally:
                cpu_engine.release()
            _require(drawn == cpu_drawn, "seeded sampling on the device differs from the CPU engine's")
            figures["seeded_equal_cpu"] = f"{16 * len(ps)}/{16 * len(ps)}"
        else:
            _require(drawn == [o.token_ids for o in engine.generate(ps, seeded)], "seeded sampling not repeatable")
            figures["seeded_repeat"] = "ok"
        awake = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        if engine.sleep():
            held = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
            engine.wake_up()
            again = [o.token_ids for o in engine.generate(ps, params)]
            _require(again == refs, "tokens after sleep/wake_up differ")
            figures["sleep_wake"] = "ok"
            if held is not None:
                figures["MiB_awake"] = round(awake / 2**20, 1)
                figures["MiB_asleep"] = round(held / 2**20, 1)
                _require(held < awake, "sleep() freed no device memory")
        executor = weakref.ref(engine.executor)
        engine.release()
        engine = None
        # weights, cache and graphs go with the engine at once (an executor and its graphs
        # refer to each other: only a collection frees them)
        _require(executor() is None, "release() left the executor (and its device memory) alive")
        if on_cuda:
            figures["MiB_left_after_release"] = round((torch.cuda.memory_allocated(device) - before) / 2**20, 1)
        return Row("torch_engine", PASS, figures, "float64, continuous batching on the device")
    finally:
        if engine is not None:
            engine.release()


def check_device_stats(device) -> Row:
    import torch

    from raycolo.engine.device_stats import device_reading

    if device.type == "cuda":
        try:
            import pynvml
        except ImportError:             # a machine's own python without raycolo's dependencies
            return Row("device_stats", SKIP, {}, "nvidia-ml-py (pynvml) is not installed: tools/gpu_wheels.sh "
                                                 "carries it to a machine without a network")
        torch.cuda.empty_cache()        # a 1 GiB allocation below must reach the driver
        before = device_reading(device)
        _require(before["source"] == "nvml", f"source {before['source']!r}, not nvml")
        free, total = torch.cuda.mem_get_info(device)
        used_cuda = total - free
        _require(0 < before["memory_used_bytes"] <= before["memory_total_bytes"], f"used/total {before}")
        _require(abs(before["memory_total_bytes"] - total) <= 0.05 * total,
                 f"NVML total {before['memory_total_bytes']} vs CUDA's {total}")
        _require(abs(before["memory_used_bytes"] - used_cuda) <= 0.05 * total,
                 f"NVML used {before['memory_used_bytes']} vs CUDA's {used_cuda}")
        block = torch.ones(2**28, dtype=torch.float32, device=device)          # 1 GiB
        busy_until = time.monotonic() + 1.0
        a = torch.randn(4096, 4096, device=device)
        while time.monotonic() < busy_until:
            a = (a @ a).tanh_()
            _sync(device)               # keep the launch queue short: busy for about 1 s
        _sync(device)
        after = device_reading(device)
        grew = after["memory_used_bytes"] - before["memory_used_bytes"]
        del block, a
        torch.cuda.empty_cache()
        _require(grew >= 0.9 * 2**30, f"NVML used grew {grew} bytes after a 1 GiB allocation")
        util = after["utilization"]
        _require(util is not None and 0.0 <= util <= 1.0, f"utilization {util}")
        from raycolo.engine.device_stats import _nvml_handle
        name = pynvml.nvmlDeviceGetName(_nvml_handle(device.index or 0))
        name = name.decode() if isinstance(name, bytes) else name
        _require(name == torch.cuda.get_device_name(device),
                 f"NVML device {name!r} is not torch's {torch.cuda.get_device_name(device)!r}")
        return Row("device_stats", PASS, {"used_GiB": round(before["memory_used_bytes"] / 2**30, 2),
                                          "total_GiB": round(before["memory_total_bytes"] / 2**30, 1),
                                          "alloc_seen_GiB": round(grew / 2**30, 2), "util_busy": util},
                   f"nvml, {name}")
    before = device_reading(device)
    _require(before["source"] == "process_rss", f"source {before['source']!r}")
    with open("/proc/self/status") as f:
        vmrss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    _require(abs(before["memory_used_bytes"] - vmrss) <= 0.1 * vmrss, f"rss {before} vs VmRSS {vmrss}")
    block = torch.ones(2**26, dtype=torch.float32)      # 256 MiB, touched
    after = device_reading(device)
    grew = after["memory_used_bytes"] - before["memory_used_bytes"]
    del block
    # at least half: the allocator may reuse pages earlier checks freed that are still
    # resident (a fresh-clone run saw 230 MiB of 256 MiB)
    _require(grew >= 0.5 * 2**28, f"rss grew {grew} bytes after a 256 MiB allocation")
    _require(before["utilization"] is None, "a CPU reading has no utilization")
    return Row("device_stats", PASS, {"rss_MiB": round(before["memory_used_bytes"] / 2**20),
                                      "alloc_seen_MiB": round(grew / 2**20)}, "process_rss vs /proc VmRSS")


def check_vllm(device) -> Row:
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except Exception as exc:      # noqa: BLE001 - ImportError, or a wheel that fails to load
        return Row("vllm", SKIP, {}, f"vllm does not import here ({type(exc).__name__})")
    platform = str(current_platform.device_type)
    if platform != device.type:
        return Row("vllm", SKIP, {}, f"installed vllm runs on {platform!r}, not {device.type!r}")
    import torch

    from raycolo.engine.base import SamplingParams
    from raycolo.engine.factory import create_engine
    from raycolo.engine.models import save_tiny_checkpoint

    if device.type == "cuda":
        torch.cuda.empty_cache()     # vLLM wants gpu_memory_utilization (0.9) of the device free

    ps = _prompts([9, 23, 14, 40])
    ref = _model(MODEL, "float64", "cpu").eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_checkpoint(MODEL, tmp, seed=0)
        kwargs = {"max_num_seqs": 8, "kv_cache_tokens": 8192}
        if platform == "cpu":
            kwargs["block_size"] = 32
        engine = create_engine({"backend": "vllm",
                                "model_loading_config": {"model_id": str(path), "dtype": "float32"},
                                "engine_kwargs": kwargs})
        try:
            t0 = time.perf_counter()
            outs = [o.token_ids for o in engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=32,
                                                                            ignore_eos=True))]
            elapsed = time.perf_counter() - t0
            load_s = engine.stats.load_seconds
        finally:
            engine.release()
    same, total, gap = _greedy_agreement(ref, ps, outs, tie=1e-3)
    return Row("vllm", PASS, {"greedy_equal": f"{same}/{total}", "max_gap": gap,
                              "tok_s": round(total / elapsed), "load_s": round(load_s, 1)},
               f"vllm {vllm.__version__} float32 vs transformers float64 (teacher-forced)")
