"""The online controller's read-only reports: training status, health, stats, the
figures the HTTP front exports as metrics, and the run's result.

A mixin of :class:`~raycolo.actors.online.controller.OnlineController`: it reads the
controller's cluster, driver, sample store and ledger, and changes nothing but the
monitor's running sums of stage busy time.
"""
from __future__ import annotations

import time

from raycolo.actors.online.state import ControllerState


def _pct(values, q) -> float:
    import numpy as np
    return float(np.percentile(values, q)) if len(values) else 0.0


class Reports(ControllerState):
    def _reset_busy(self) -> None:
        """Busy fractions count a new cluster's ops from zero."""
        self.busy_s, self.busy_seen = {}, 0

    def _hop(self) -> None:
        """One call from a stage worker or a node loop reached this actor."""
        self.hops += 1

    def _reset_hops(self) -> None:
        self.hops = 0

    def _note_readings(self, node: int, stage: int, device, sends) -> None:
        """A stage's last device reading and its sends' counts (each None: none new)."""
        if device is not None:
            self.device[(node, stage)] = device
        if sends is not None:
            self.sends[(node, stage)] = sends

    def _reports_init(self) -> None:
        """This role's own state (it alone writes these)."""
        self.hops = 0
        self.device: dict = {}                        # (node, stage) -> its device's last reading
        self.sends: dict = {}                         # (node, stage) -> (sends held, sends posted)
        self.busy_s: dict = {}                        # (node, stage) -> seconds of ops run (monitor)
        self.busy_seen = 0                            # op_log entries counted into busy_s

    async def train_status(self) -> dict:
        trained = sum(1 for n in self.ledger.trained.values() if n > 0)
        last = max(((n, v) for n, v in enumerate(self.ledger.version) if v),
                    key=lambda x: x[1], default=None)
        return {"received": len(self.store), "trained": trained,
                "pending": self.store.pending(self.cursor) + len(self.backlog), "adapter_version": self.adapter_version,
                "last_checkpoint": None if last is None else {"node": last[0], "version": last[1]},
                "pinned_versions": list(self.versions), "resumed": self.resumption}

    async def monitor(self) -> dict:
        """The figures the HTTP front exports as gauges (raycolo/actors/serve/front_metrics.py)."""
        now = self.driver.now() if self.driver else 0.0
        nodes = self.cluster.nodes
        running = sum(len(node.batch) + len(node.joining) for node in nodes)
        log, busy = self.cluster.op_log, self.busy_s
        offset = self.cluster.op_log_dropped
        for start, end, n, st, _kind, _ids in log[max(0, self.busy_seen - offset):]:   # ops logged since the last call
            busy[(n, st)] = busy.get((n, st), 0.0) + (end - start)
        self.busy_seen = offset + len(log)
        result = await self.metrics()
        status = await self.train_status()
        return {
            "running": running, "waiting": max(0, self.unfinished() - running),
            "samples_trained": status["trained"], "samples_pending": status["pending"],
            "optimizer_steps": sum(self.trained_steps), "adapter_version": self.adapter_version,
            "adapter_staleness_s": time.time() - self.adapter_changed_s,
            "slo_attainment": result.slo_attainment,
            "decision_us_p50": _pct(self.cluster.scheduler.decision_us, 50),
            "nodes_alive": self.config.nodes - len(self.dead),
            "restarting_nodes": sorted(self.cluster.scheduler.restarting),
            "stages": [{"node": n, "stage": st, "busy_fraction": min(1.0, busy.get((n, st), 0.0) / now) if now else 0.0,
                        "memory_bytes": nodes[n].stages[st].used_bytes,
                        "device": self.device.get((n, st)),
                        "sends_held": self.sends.get((n, st), (0, 0))[0],
                        "sends_posted": self.sends.get((n, st), (0, 0))[1]}
                       for n in range(self.config.nodes) for st in range(self.config.stages)],
        }

    async def last_node(self) -> int:
        """The live node that trained last (its adapter is the freshest)."""
        node = self.last_trained_node
        return node if node not in self.dead else next(n for n in range(self.config.nodes) if n not in self.dead)

    async def health(self) -> dict:
        if not self.ready.is_set():     # (re)starting: a restarted controller starts on this call
            self._wake()
            return {"status": "starting", "nodes_alive": 0, "nodes": self.config.nodes, "nodes_restarting": 0}
        alive = self.config.nodes - len(self.dead)
        return {"status": "ok" if alive == self.config.nodes else "degraded",
                "nodes_alive": alive, "nodes": self.config.nodes,
                "nodes_restarting": len(self.cluster.scheduler.restarting)}

    async def stats(self) -> dict:
        tasks = [r.task for r in self.requests.values()]
        nodes = self.cluster.nodes
        return {
            "policy": self.policy.name, "nodes": self.config.nodes, "stages": self.config.stages,
            "now_s": self.driver.now() if self.driver else 0.0,
            "requests": len(tasks), "completed": self.cluster.metrics.completed,
            "train_done": self.cluster.train_done, "samples_stored": len(self.store),
            "samples_pending": self.store.pending(self.cursor) + len(self.backlog), "adapter_version": self.adapter_version,
            "queues": [{"node": n, "ready": [len(st.ready) for st in node.stages],
                        "busy": [st.busy is not None for st in node.stages],
                        "batch": len(node.batch), "decoding": len(node.joining)} for n, node in enumerate(nodes)],
            "actor_hops": self.hops, "errors": list(self.errors),
            # events sent to HTTP replicas, and the messages that carried them (front_events)
            "front_messages": self.front_sent[0], "front_events": self.front_sent[1],
            "last_trained_node": self.last_trained_node,
            "hops_per_decode_iteration": self.hops / max(1, self.cluster.op_log_dropped + len(self.cluster.op_log)) * self.config.stages,
            "decision_us_p50": _pct(self.cluster.scheduler.decision_us, 50),
            "decision_us_p99": _pct(self.cluster.scheduler.decision_us, 99),
            # everything the controller's schedulers did (policy, cluster, node schedulers)
            "scheduling_us_per_task": (self.driver.scheduling_total_s * 1e6 / max(1, len(self.tasks)))
            if self.driver else 0.0,
            **self._controller_cpu(),
            "scheduling_us_p50": _pct([x * 1e6 for x in self.driver.scheduling_s], 50) if self.driver else 0.0,
            "scheduling_us_p99": _pct([x * 1e6 for x in self.driver.scheduling_s], 99) if self.driver else 0.0,
            "losses": self.losses[-20:],
            "restarts": list(self.restarts), "dead_nodes": dict(self.dead),
            "restarting_nodes": sorted(self.cluster.scheduler.restarting),
            "checkpoint_versions": list(self.ledger.version),
            "samples_since_checkpoint": [len(x) for x in self.ledger.since],
            "checkpoints_uncommitted": len(self.ledger.reported),
            "resumed_tasks": self.cluster.resumed,
            "cancelled": dict(self.cancelled),      # by reason: "stop" (a stop string), "abort" (client gone)
            "unfinished": self.unfinished(),
        }

    def _controller_cpu(self) -> dict:
        """This controller's CPU time since its run started (process time: the event loop
        and Ray's threads), per arriving task, and the arrival rate one core of it would
        sustain at that cost; ``controller_cpu_share``: that CPU time over the wall time
        since (cores in use). Every op of every node passes through this actor today, so
        this counts the tasks' tokens and training ops too, not only their placement, and
        at low arrival rates the controller's idle time as well."""
        cpu = time.process_time() - self.cpu_mark
        per_task = cpu / self.arrived if self.arrived else None
        return {"controller_cpu_s": cpu, "tasks_arrived": self.arrived,
                "controller_cpu_share": cpu / max(time.monotonic() - self.wall_mark, 1e-9),
                "controller_cpu_ms_per_task": None if per_task is None else per_task * 1e3,
                "controller_sustains_tasks_per_s": None if not per_task else 1.0 / per_task}

    async def sample_ledger(self) -> dict:
        """How often each stored sample's training is kept in the adapters (a restart's
        rollback takes back what the node trained since its checkpoint), and how many
        samples were handed to training in this epoch."""
        return {"trained": dict(self.ledger.trained), "taken": self.cursor.next_seq,
                "epoch": self.cursor.epoch, "stored": len(self.store)}

    async def metrics(self):
        """The run's :class:`OnlineResult`: ``summary()`` has ``simulate-online``'s keys."""
        return self.cluster.metrics.result(self.policy.name, list(self.tasks.values()), self.cluster.nodes,
                                           self.config.lemix.slo_s(self.cluster.profile.forward_latency_s),
                                           self.cluster.train_done, self.cluster.scheduler.mean_decision_us)

    async def profile_json(self) -> str:
        """The node profile planning uses now (fitted from observed ops after the warm-up)."""
        return self.cluster.learner.current.model_dump_json(indent=2)

    async def op_log(self) -> list:
        return list(self.cluster.op_log)
