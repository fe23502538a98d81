"""The HTTP front's metrics, through ``ray.util.metrics`` (Ray exports them to Prometheus
with a ``ray_`` prefix). Names follow vLLM's where the meaning is the same, with
``raycolo_`` in place of ``vllm:``: Ray 2.60's OpenTelemetry exporter drops metric names
that contain a colon (measured), so ``vllm:time_to_first_token_seconds`` is
``ray_raycolo_time_to_first_token_seconds`` here (docs/serve.md lists them all)."""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0]
MODEL = ("model_name",)
REPLICA = MODEL + ("replica",)


class FrontMetrics:
    """Recorded by every ingress replica, each series tagged with the served model and the
    replica that recorded it (sum over ``replica`` for the deployment); the tags are set
    once, so a record passes none."""

    def __init__(self, model_name: str, replica: str):
        self.ttft = Histogram("raycolo_time_to_first_token_seconds", "Time to first token",
                              boundaries=LATENCY_BUCKETS, tag_keys=REPLICA)
        self.itl = Histogram("raycolo_inter_token_latency_seconds", "Time between streamed tokens",
                             boundaries=LATENCY_BUCKETS, tag_keys=REPLICA)
        self.e2e = Histogram("raycolo_e2e_request_latency_seconds", "End-to-end request latency",
                             boundaries=LATENCY_BUCKETS, tag_keys=REPLICA)
        self.prompt_tokens = Counter("raycolo_prompt_tokens", "Prompt tokens of accepted requests",
                                     tag_keys=REPLICA)
        self.generation_tokens = Counter("raycolo_generation_tokens", "Generated tokens sent",
                                         tag_keys=REPLICA)
        self.success = Counter("raycolo_request_success", "Finished requests by finish reason",
                               tag_keys=REPLICA + ("finished_reason",))
        self.rejected = Counter("raycolo_admission_rejections", "Requests refused with 429 (overload)",
                                tag_keys=REPLICA)
        self.readmitted = Counter("raycolo_requests_readmitted",
                                  "Streaming requests admitted again after the controller restarted",
                                  tag_keys=REPLICA)
        self.placed_directly = Counter("raycolo_requests_placed_directly",
                                       "Requests the replica placed on a node while the controller was down",
                                       tag_keys=REPLICA)
        self.samples_received = Counter("raycolo_train_samples_received",
                                        "Training samples persisted and acknowledged", tag_keys=REPLICA)
        self.samples_stored_here = Counter("raycolo_train_samples_stored_by_replica",
                                           "Training samples the replica stored itself while the controller was down",
                                           tag_keys=REPLICA)
        for metric in (self.ttft, self.itl, self.e2e, self.prompt_tokens, self.generation_tokens, self.success,
                       self.rejected, self.readmitted, self.placed_directly, self.samples_received,
                       self.samples_stored_here):
            metric.set_default_tags({"model_name": model_name, "replica": replica})


class DeploymentMetrics:
    """Gauges of the whole deployment, set from the controller's stats by one replica."""

    def __init__(self):
        self.running = Gauge("raycolo_num_requests_running", "Requests in a node's batch", tag_keys=MODEL)
        self.waiting = Gauge("raycolo_num_requests_waiting", "Requests accepted, not yet running",
                             tag_keys=MODEL)
        self.trained = Gauge("raycolo_train_samples_trained", "Samples the adapters hold", tag_keys=MODEL)
        self.pending = Gauge("raycolo_train_samples_pending", "Samples not trained yet", tag_keys=MODEL)
        self.steps = Gauge("raycolo_optimizer_steps", "Optimizer steps taken", tag_keys=MODEL)
        self.adapter_version = Gauge("raycolo_adapter_version", "Latest adapter checkpoint version",
                                     tag_keys=MODEL)
        self.staleness = Gauge("raycolo_adapter_staleness_seconds",
                               "Seconds since the served adapter last changed", tag_keys=MODEL)
        self.slo = Gauge("raycolo_slo_attainment", "Fraction of finished requests within the TTFT SLO",
                         tag_keys=MODEL)
        self.busy = Gauge("raycolo_stage_busy_fraction", "Fraction of time a stage ran ops",
                          tag_keys=MODEL + ("node", "stage"))
        self.memory = Gauge("raycolo_stage_memory_bytes", "Bytes in use on a stage (KV and training)",
                            tag_keys=MODEL + ("node", "stage"))
        self.device_memory = Gauge("raycolo_device_memory_used_bytes",
                                   "A stage's device memory in use: NVML on a GPU (source=nvml), the "
                                   "worker process's resident memory on a CPU (source=process_rss)",
                                   tag_keys=MODEL + ("node", "stage", "source"))
        self.device_util = Gauge("raycolo_device_utilization", "A stage's GPU utilization (NVML), 0-1",
                                 tag_keys=MODEL + ("node", "stage"))
        self.decision = Gauge("raycolo_decision_latency_seconds", "Scheduling decision latency, p50",
                              tag_keys=MODEL)
        self.alive = Gauge("raycolo_nodes_alive", "Stage-worker nodes alive", tag_keys=MODEL)
        self.restarting = Gauge("raycolo_nodes_restarting", "Stage-worker nodes whose worker group is "
                                "restarting (given no new work until it is back)", tag_keys=MODEL)

    def update(self, model: str, s: dict) -> None:
        tags = {"model_name": model}
        self.running.set(s["running"], tags)
        self.waiting.set(s["waiting"], tags)
        self.trained.set(s["samples_trained"], tags)
        self.pending.set(s["samples_pending"], tags)
        self.steps.set(s["optimizer_steps"], tags)
        self.adapter_version.set(s["adapter_version"], tags)
        self.staleness.set(s["adapter_staleness_s"], tags)
        self.slo.set(s["slo_attainment"], tags)
        self.decision.set(s["decision_us_p50"] / 1e6, tags)
        self.alive.set(s["nodes_alive"], tags)
        self.restarting.set(len(s["restarting_nodes"]), tags)
        for st in s["stages"]:
            t = dict(tags, node=str(st["node"]), stage=str(st["stage"]))
            self.busy.set(st["busy_fraction"], t)
            self.memory.set(st["memory_bytes"], t)
            device = st.get("device")
            if device:
                self.device_memory.set(device["memory_used_bytes"], dict(t, source=device["source"]))
                if device["utilization"] is not None:
                    self.device_util.set(device["utilization"], t)
