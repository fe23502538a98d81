"""The online controller's state, declared in one place.

:class:`~raycolo.actors.online.controller.OnlineController` is one Ray actor made of
roles, each a class in its own module over this state: the worker groups' registry and
lifecycle (:mod:`.workers`), the op runner (:mod:`.op_runner`), the request desk
(:mod:`.requests`), the sample pump (:mod:`.sample_pump`), adapter versions and loaded
adapters (:mod:`.adapters`, :mod:`.loaded_adapters`), reports (:mod:`.reports`) and the
node links (:mod:`.nodes`). Every attribute a role reads or writes is set (or declared)
here, so no role relies on one it cannot see. Roles call one another's methods through
the actor (``self``): a request's ``submit`` starts the workers (``WorkerGroups.start``).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from raycolo.actors.online.placement_groups import PlacementGroups
from raycolo.online.config import OnlineConfig, layer_bounds, live_profile, model_hf_config
from raycolo.online.driver import ClusterDriver
from raycolo.online.samples import Cursor, SampleStore, TrainingLedger
from raycolo.online.scheduling.cluster import Cluster
from raycolo.online.stage_messages import ServedRequest
from raycolo.online.tasks import OnlineTask


@dataclass
class LiveRequest(ServedRequest):
    """A request's events (raycolo.online.serving.messages.StreamEvent) go to its stream."""

    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted_s: float = 0.0


class ControllerState:
    """Everything the controller's roles share. Set in ``__init__``, except these, which
    their role sets when it starts (declared here all the same):"""

    _loop: asyncio.AbstractEventLoop        # workers._launch: the actor's event loop
    cpu_mark: float                          # mark_cpu: process CPU time at the mark
    wall_mark: float                         # mark_cpu: monotonic time at the mark
    arrived: int                             # tasks arrived since the mark
    # the node links (nodes.NodeLinks._links_init)
    inbox: list[list]
    inbox_ready: list[asyncio.Event]
    pauses: dict[tuple[int, int], asyncio.Future]
    pause_tokens: int
    eras: list[int]
    stopping: bool

    def __init__(self, config: dict, name: str, namespace: str):
        from raycolo.engine.models import load_tokenizer
        from raycolo.online.policies import make_online_policy

        self.config = OnlineConfig.model_validate(config)
        self.name, self.namespace = name, namespace
        cfg = self.config
        self.tokenizer = load_tokenizer(cfg.model_loading_config.model_id)
        self.model_config = model_hf_config(cfg.model_loading_config.model_id)
        self.bounds = layer_bounds(self.model_config.num_hidden_layers, cfg.stages)
        profile = live_profile(cfg, self.model_config)
        self.policy = make_online_policy(cfg.policy, cfg.lemix, nodes=cfg.nodes, train_rate=cfg.train_rate)
        self.cluster = Cluster(self.policy, profile, cfg.nodes, cfg.lemix)
        self.store = SampleStore(cfg.sample_store)
        self.cursor = Cursor()
        self.driver: Optional[ClusterDriver] = None
        self.queues = {(n, s): asyncio.Queue() for n in range(cfg.nodes) for s in range(cfg.stages)}
        self.waiting: dict[tuple[int, int, int], asyncio.Future] = {}
        self.workers: dict[str, dict] = {}
        self.epochs = [0] * cfg.nodes
        self.registered = [set() for _ in range(cfg.nodes)]
        self.ready = asyncio.Event()
        self.requests: dict[int, LiveRequest] = {}
        self.tasks: dict[int, OnlineTask] = {}
        self.train_tasks: dict[int, list] = {}
        self.train_seqs: dict[int, list[int]] = {}          # training task -> its samples' seqs
        self.ledger = TrainingLedger(cfg.nodes)             # which samples the adapters keep
        self.restarts: list[dict] = []                       # node, reason, time, lost, replayed
        self.dead: dict[int, str] = {}                       # node -> why its worker group is gone
        self.losses: list[tuple[float, int, float]] = []    # (time, task, loss)
        # ids stay unique across restarts of this actor: a request accepted before a crash
        # is never mistaken for one accepted after (microseconds since the epoch)
        self.first_id = self.next_id = time.time_ns() // 1000
        self.adapter_version = 0
        self.trained_steps = [0] * cfg.nodes
        self.gates = [asyncio.Event() for _ in range(cfg.nodes)]
        for g in self.gates:
            g.set()
        self.inflight = [0] * cfg.nodes
        self.fit_futures = []
        self.errors: list[str] = []
        self.hops = 0
        self.run_token = uuid.uuid4().hex[:8]
        self.adapter_dir = Path(cfg.storage_path) / f"adapter-{self.run_token}"
        run = cfg.adapter_fingerprint() if cfg.resume else self.run_token
        self.groups = PlacementGroups(Path(cfg.storage_path) / f"placement-groups-{run}.json", self.errors)
        self.last_trained_node = 0
        self.exports: dict[int, asyncio.Task] = {}
        self.versions: list[int] = []                 # adapter versions servable as @v<k>
        self.loaded: dict[str, dict] = {}             # adapters loaded over HTTP, by name (online_adapters.py)
        self.oob_seq = -1_000_000     # seq numbers of out-of-band payloads (checkpoint, lora)
        self.background: set[asyncio.Task] = set()   # checkpoints under way
        self.rejections = 0                           # admissions refused (429)
        self.auto_train = False                       # samples arrive over HTTP: train them as they come
        self.adapter_changed_s = time.time()          # the served adapter last changed
        self.fronts: set[str] = set()                 # HTTP replicas attached (serve/app.py)
        self.muxes: dict[str, asyncio.Queue] = {}     # HTTP replica -> its requests' events (front_events)
        self.front_sent = [0, 0]                      # front_events: messages, events in them
        self.busy_s: dict = {}                        # (node, stage) -> seconds of ops run (monitor)
        self.device: dict = {}                        # (node, stage) -> its device's last reading
        self.sends: dict = {}                         # (node, stage) -> (sends held, sends posted)
        self.busy_seen = 0                            # op_log entries counted into busy_s
        self._starting: Optional[asyncio.Task] = None      # the launch of the stage workers
        self._partial: Optional[asyncio.TimerHandle] = None  # serve with the nodes there are (_serve_partial)
        self.cancelled: dict[str, int] = {}           # requests ended early, by reason: stop, abort (client gone)
        self.restored: dict[int, tuple] = {}          # node -> (version, seqs held, cursor) of an earlier run
        self.resumption: Optional[dict] = None        # what this deployment took up from an earlier one
        self.train_runs = [0] * cfg.nodes             # Ray Train runs started per node (a new one after its controller died)
        self._flush_timer: Optional[asyncio.TimerHandle] = None   # trains a partial micro-batch of HTTP samples
        self.backlog: list[int] = []                  # resumed samples to train, fed in as training tasks finish
        # (node, stage) -> seqs of its sends that their receivers consumed: told to it with
        # its next op, so it lets go of them (gloo's isend reports completion only to wait())
        self.received: dict[tuple[int, int], list[int]] = {}
