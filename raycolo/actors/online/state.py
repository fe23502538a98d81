"""What the online controller's roles share: the deployment's config, model and cluster,
which the controller itself sets (:class:`ControllerState`), and a live request.

:class:`~raycolo.actors.online.controller.OnlineController` is one Ray actor made of role
objects, each a class in its own module: the worker groups' registry and lifecycle
(:mod:`.workers`), the op runner (:mod:`.op_runner`), the request desk (:mod:`.requests`),
the sample pump (:mod:`.sample_pump`), adapter versions and loaded adapters
(:mod:`.adapters`, :mod:`.loaded_adapters`), reports (:mod:`.reports`) and the node links
(:mod:`.nodes`). Each role is built with the controller (``ctl``), sets its own fields in
its ``__init__`` and alone writes them; another role reads them as ``ctl.<role>.<field>``
and asks for a change through a method of the role (a restarted node's samples:
``ctl.pump.resume_samples``; a lost node's waiting ops: ``ctl.runner.fail_waiting``).
``tests/project/test_layout.py`` checks that no role writes another's fields or the
controller's. The fields here are the controller's: roles read them as ``ctl.<field>``,
and report into ``errors`` through :meth:`ControllerState.note_error`.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Optional

from raycolo.actors.online.library_imports import LIBRARY_IMPORTS, importing
from raycolo.actors.online.placement_groups import PlacementGroups
from raycolo.online.config import OnlineConfig, layer_bounds, live_profile, model_fields, model_hf_config
from raycolo.online.driver import ClusterDriver
from raycolo.online.samples import TrainingLedger
from raycolo.online.scheduling.cluster import Cluster
from raycolo.generation import FinishReason
from raycolo.online.serving.messages import EventKind, StreamEvent
from raycolo.online.stage_messages import ServedRequest


@dataclass
class LiveRequest(ServedRequest):
    """A request's events (raycolo.online.serving.messages.StreamEvent) go to its stream."""

    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted_s: float = 0.0

    def fail(self, why: str) -> None:
        """End the request with an error: its stream gets ``why``."""
        self.finish_reason = FinishReason.ERROR
        self.events.put_nowait(StreamEvent(EventKind.ERROR, why))


class ControllerState:
    """What every role reads (set in ``__init__``, and by the controller's own methods)."""

    cpu_mark: float                          # mark_cpu: process CPU time at the mark
    wall_mark: float                         # mark_cpu: monotonic time at the mark

    def __init__(self, config: dict, name: str, namespace: str):
        from raycolo.online.policies import make_online_policy

        self.config = OnlineConfig.model_validate(config)
        self.name, self.namespace = name, namespace
        cfg = self.config
        self._tokenizer: Optional[asyncio.Future] = None    # loaded at its first need (eos_token_ids)
        self._warming: Optional[threading.Thread] = None
        fields = model_fields(cfg.model_loading_config.model_id)
        self.bounds = layer_bounds(int(fields["num_hidden_layers"]), cfg.stages)
        profile = live_profile(cfg, fields)
        self.policy = make_online_policy(cfg.policy, cfg.lemix, nodes=cfg.nodes, train_rate=cfg.train_rate)
        self.cluster = Cluster(self.policy, profile, cfg.nodes, cfg.lemix)
        self.driver: Optional[ClusterDriver] = None
        self.ready = asyncio.Event()
        self.ledger = TrainingLedger(cfg.nodes)             # which samples the adapters keep
        # ids stay unique across restarts of this actor: a request accepted before a crash
        # is never mistaken for one accepted after (microseconds since the epoch)
        self.first_id = time.time_ns() // 1000
        self.gates = [asyncio.Event() for _ in range(cfg.nodes)]
        for g in self.gates:
            g.set()
        self.errors: list[str] = []
        self.run_token = uuid.uuid4().hex[:8]
        self.adapter_dir = Path(cfg.storage_path) / f"adapter-{self.run_token}"
        run = cfg.adapter_fingerprint() if cfg.resume else self.run_token
        self.groups = PlacementGroups(Path(cfg.storage_path) / f"placement-groups-{run}.json", self.errors)

    async def eos_token_ids(self) -> frozenset:
        """The checkpoint's EOS set, from its tokenizer (torch and transformers: seconds to
        load), loaded in a thread at the first need: the HTTP replicas send each request's
        stop ids, so a (re)starting controller serves them without it."""
        if self._tokenizer is None:
            self._tokenizer = asyncio.ensure_future(self.in_thread(_load_tokenizer,
                                                                   self.config.model_loading_config.model_id))
        return (await self._tokenizer).eos_token_ids

    def warm_up(self) -> None:
        """Import, in a thread, what the first adapter export needs (torch: a stage's
        adapter state arrives as tensors; peft: the adapter's config), while the stage
        workers start. Imported by the event loop at that export instead, they stalled every
        admission for up to 1.6 s (bench/faults.py, 2-core VM). Started once the controller
        served, the import (about 5 s on 2 cores) held up the first requests: 4.95 s to the
        first token right after the start, 0.05 s ten seconds later (2026-12-01)."""
        if self._warming is None:
            self._warming = threading.Thread(target=_warm_imports, daemon=True, name="warm-imports")
            self._warming.start()

    @staticmethod
    async def in_thread(fn, *args):
        """``fn(*args)`` in a thread, never beside another thread of this process that may
        import the ML libraries for the first time (:mod:`.library_imports`)."""
        return await asyncio.to_thread(importing, fn, *args)

    @cached_property
    def model_config(self):
        """The model's transformers config (a loaded adapter's checks need it; built at first use)."""
        return model_hf_config(self.config.model_loading_config.model_id)

    def note_error(self, message: str) -> None:
        """Record what went wrong (the deployment's errors: stop() and the reports give them)."""
        self.errors.append(message)


def _load_tokenizer(model_id: str):
    from raycolo.engine.models import load_tokenizer

    return load_tokenizer(model_id)


def _warm_imports() -> None:
    with LIBRARY_IMPORTS:
        import peft  # noqa: F401

        import raycolo.online.stages.peft_format  # noqa: F401  (torch)
