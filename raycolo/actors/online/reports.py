"""The online controller's read-only reports: training status, health, stats, the
figures the HTTP front exports as metrics, and the run's result.

A role of :class:`~raycolo.actors.online.controller.OnlineController` (``ctl.reports``): it
reads the controller's cluster, driver and ledger and the other roles' fields, and
changes nothing but its own running sums of stage busy time and hop timings.
"""
from __future__ import annotations

import time

import ray

from raycolo.online.serving.beacon import Beacon, BeaconAddress


def _pct(values, q) -> float:
    import numpy as np
    return float(np.percentile(values, q)) if len(values) else 0.0


class Reports:
    def __init__(self, ctl) -> None:
        """This role's own state (it alone writes these); ``ctl`` is the OnlineController."""
        self.ctl = ctl
        self.liveness = Beacon(ray.util.get_node_ip_address())   # its end tells nodes and replicas at once
        self.hops = 0
        self.device: dict = {}                        # (node, stage) -> its device's last reading
        self.sends: dict = {}                         # (node, stage) -> (sends held, sends posted)
        self.busy_s: dict = {}                        # (node, stage) -> seconds of ops run (monitor)
        self.busy_seen = 0                            # op_log entries counted into busy_s

    def beacon(self) -> BeaconAddress:
        """Where to watch this controller's process end (:mod:`raycolo.online.serving.beacon`)."""
        return self.liveness.address

    def reset_busy(self) -> None:
        """Busy fractions count a new cluster's ops from zero."""
        self.busy_s, self.busy_seen = {}, 0

    def hop(self) -> None:
        """One call from a stage worker or a node loop reached this actor."""
        self.hops += 1

    def reset_hops(self) -> None:
        self.hops = 0

    def note_readings(self, node: int, stage: int, device, sends) -> None:
        """A stage's last device reading and its sends' counts (each None: none new)."""
        if device is not None:
            self.device[(node, stage)] = device
        if sends is not None:
            self.sends[(node, stage)] = sends

    async def train_status(self) -> dict:
        trained = sum(1 for n in self.ctl.ledger.trained.values() if n > 0)
        last = max(((n, v) for n, v in enumerate(self.ctl.ledger.version) if v),
                    key=lambda x: x[1], default=None)
        return {"received": len(self.ctl.pump.store), "trained": trained,
                "pending": self.ctl.pump.pending(), "adapter_version": self.ctl.adapters.adapter_version,
                "last_checkpoint": None if last is None else {"node": last[0], "version": last[1]},
                "pinned_versions": list(self.ctl.adapters.versions), "resumed": self.ctl.workers.resumption}

    async def monitor(self) -> dict:
        """The figures the HTTP front exports as gauges (raycolo/actors/serve/front_metrics.py)."""
        now = self.ctl.driver.now() if self.ctl.driver else 0.0
        nodes = self.ctl.cluster.nodes
        running = sum(len(node.batch) + len(node.joining) for node in nodes)
        log, busy = self.ctl.cluster.op_log, self.busy_s
        offset = self.ctl.cluster.op_log_dropped
        for start, end, n, st, _kind, _ids in log[max(0, self.busy_seen - offset):]:   # ops logged since the last call
            busy[(n, st)] = busy.get((n, st), 0.0) + (end - start)
        self.busy_seen = offset + len(log)
        result = await self.metrics()
        status = await self.train_status()
        return {
            "running": running, "waiting": max(0, self.ctl.desk.unfinished() - running),
            "samples_trained": status["trained"], "samples_pending": status["pending"],
            "optimizer_steps": sum(self.ctl.runner.trained_steps), "adapter_version": self.ctl.adapters.adapter_version,
            "adapter_staleness_s": time.time() - self.ctl.runner.adapter_changed_s,
            "slo_attainment": result.slo_attainment,
            "decision_us_p50": _pct(self.ctl.cluster.scheduler.decision_us, 50),
            "nodes_alive": self.ctl.config.nodes - len(self.ctl.workers.dead),
            # where replicas place requests while this controller is down (serving/node_inbox.py)
            "node_inboxes": [w["node_inbox"] for key, w in sorted(self.ctl.workers.by_name.items())
                             if w["stage"] == 0 and w.get("node_inbox") and w["node"] not in self.ctl.workers.dead],
            "node_load": {n: len(node.batch) + len(node.joining) for n, node in enumerate(nodes)},
            "restarting_nodes": sorted(self.ctl.cluster.scheduler.restarting),
            "stages": [{"node": n, "stage": st, "busy_fraction": min(1.0, busy.get((n, st), 0.0) / now) if now else 0.0,
                        "memory_bytes": nodes[n].stages[st].used_bytes,
                        "device": self.device.get((n, st)),
                        "sends_held": self.sends.get((n, st), (0, 0))[0],
                        "sends_posted": self.sends.get((n, st), (0, 0))[1]}
                       for n in range(self.ctl.config.nodes) for st in range(self.ctl.config.stages)],
        }

    async def last_node(self) -> int:
        """The live node that trained last (its adapter is the freshest)."""
        node = self.ctl.runner.last_trained_node
        return node if node not in self.ctl.workers.dead else next(n for n in range(self.ctl.config.nodes) if n not in self.ctl.workers.dead)

    async def health(self) -> dict:
        if not self.ctl.ready.is_set():     # (re)starting: a restarted controller starts on this call
            self.ctl.workers.wake()
            return {"status": "starting", "nodes_alive": 0, "nodes": self.ctl.config.nodes, "nodes_restarting": 0}
        alive = self.ctl.config.nodes - len(self.ctl.workers.dead)
        return {"status": "ok" if alive == self.ctl.config.nodes else "degraded",
                "nodes_alive": alive, "nodes": self.ctl.config.nodes,
                "nodes_restarting": len(self.ctl.cluster.scheduler.restarting)}

    async def stats(self) -> dict:
        tasks = [r.task for r in self.ctl.desk.requests.values()]
        nodes = self.ctl.cluster.nodes
        return {
            "policy": self.ctl.policy.name, "nodes": self.ctl.config.nodes, "stages": self.ctl.config.stages,
            "now_s": self.ctl.driver.now() if self.ctl.driver else 0.0,
            "requests": len(tasks), "completed": self.ctl.cluster.metrics.completed,
            "train_done": self.ctl.cluster.train_done, "samples_stored": len(self.ctl.pump.store),
            "samples_pending": self.ctl.pump.pending(), "adapter_version": self.ctl.adapters.adapter_version,
            "queues": [{"node": n, "ready": [len(st.ready) for st in node.stages],
                        "busy": [st.busy is not None for st in node.stages],
                        "batch": len(node.batch), "decoding": len(node.joining),
                        # of each stage's paged KV pool: blocks its running requests reserved
                        "kv_blocks_reserved": node.kv.reserved, "kv_blocks": node.kv.blocks}
                       for n, node in enumerate(nodes)],
            "actor_hops": self.hops, "errors": list(self.ctl.errors),
            # events sent to HTTP replicas, and the messages that carried them (front_events)
            "front_messages": self.ctl.desk.front_sent[0], "front_events": self.ctl.desk.front_sent[1],
            "last_trained_node": self.ctl.runner.last_trained_node,
            "hops_per_decode_iteration": self.hops / max(1, self.ctl.cluster.op_log_dropped + len(self.ctl.cluster.op_log)) * self.ctl.config.stages,
            "decision_us_p50": _pct(self.ctl.cluster.scheduler.decision_us, 50),
            "decision_us_p99": _pct(self.ctl.cluster.scheduler.decision_us, 99),
            # everything the controller's schedulers did (policy, cluster, node schedulers)
            "scheduling_us_per_task": (self.ctl.driver.scheduling_total_s * 1e6 / max(1, len(self.ctl.desk.tasks)))
            if self.ctl.driver else 0.0,
            **self._controller_cpu(),
            "scheduling_us_p50": _pct([x * 1e6 for x in self.ctl.driver.scheduling_s], 50) if self.ctl.driver else 0.0,
            "scheduling_us_p99": _pct([x * 1e6 for x in self.ctl.driver.scheduling_s], 99) if self.ctl.driver else 0.0,
            "losses": self.ctl.runner.losses[-20:],
            "restarts": list(self.ctl.workers.restarts), "dead_nodes": dict(self.ctl.workers.dead),
            "start_timeline": self.ctl.workers.start_timeline(),
            "restarting_nodes": sorted(self.ctl.cluster.scheduler.restarting),
            "checkpoint_versions": list(self.ctl.ledger.version),
            "samples_since_checkpoint": [len(x) for x in self.ctl.ledger.since],
            "checkpoints_uncommitted": len(self.ctl.ledger.reported),
            "resumed_tasks": self.ctl.cluster.resumed,
            "cancelled": dict(self.ctl.desk.cancelled),      # by reason: "stop" (a stop string), "abort" (client gone)
            "unfinished": self.ctl.desk.unfinished(),
            # the most requests admitted and unfinished at once (serve.max_ongoing_requests bounds it)
            "peak_ongoing": self.ctl.desk.peak_ongoing,
        }

    def _controller_cpu(self) -> dict:
        """This controller's CPU time since its run started (process time: the event loop
        and Ray's threads), per arriving task, and the arrival rate one core of it would
        sustain at that cost; ``controller_cpu_share``: that CPU time over the wall time
        since (cores in use). Every op of every node passes through this actor today, so
        this counts the tasks' tokens and training ops too, not only their placement, and
        at low arrival rates the controller's idle time as well."""
        cpu = time.process_time() - self.ctl.cpu_mark
        per_task = cpu / self.ctl.desk.arrived if self.ctl.desk.arrived else None
        return {"controller_cpu_s": cpu, "tasks_arrived": self.ctl.desk.arrived,
                "controller_cpu_share": cpu / max(time.monotonic() - self.ctl.wall_mark, 1e-9),
                "controller_cpu_ms_per_task": None if per_task is None else per_task * 1e3,
                "controller_sustains_tasks_per_s": None if not per_task else 1.0 / per_task}

    async def sample_ledger(self) -> dict:
        """How often each stored sample's training is kept in the adapters (a restart's
        rollback takes back what the node trained since its checkpoint), and how many
        samples were handed to training in this epoch."""
        return {"trained": dict(self.ctl.ledger.trained), "taken": self.ctl.pump.cursor.next_seq,
                "epoch": self.ctl.pump.cursor.epoch, "stored": len(self.ctl.pump.store)}

    async def metrics(self):
        """The run's :class:`OnlineResult`: ``summary()`` has ``simulate-online``'s keys."""
        return self.ctl.cluster.metrics.result(self.ctl.policy.name, list(self.ctl.desk.tasks.values()), self.ctl.cluster.nodes,
                                           self.ctl.config.lemix.slo_s(self.ctl.cluster.profile.forward_latency_s),
                                           self.ctl.cluster.train_done, self.ctl.cluster.scheduler.mean_decision_us)

    async def profile_json(self) -> str:
        """The node profile planning uses now (fitted from observed ops after the warm-up)."""
        return self.ctl.cluster.learner.current.model_dump_json(indent=2)

    async def op_log(self) -> list:
        return list(self.ctl.cluster.op_log)
