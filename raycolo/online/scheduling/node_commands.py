"""What the control plane tells a node's loop, and what the loop starts from: typed
messages from the online controller to the first stage of a node (``stage.data_plane:
node``, :mod:`raycolo.online.stages.node_pipeline`). Each is applied by the loop at its own
time; the events it logs bring the effect back to the controller's mirror of the node
(:mod:`raycolo.online.scheduling.node_events`), so the mirror applies it at the same point.

Pure: no torch, no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from raycolo.online.scheduling.node import NodeScheduler
from raycolo.generation import FinishReason
from raycolo.online.stage_messages import ServedRequest
from raycolo.online.tasks import OnlineTask


@dataclass(frozen=True, slots=True)
class NodeSetup:
    """What a node's loop starts from: the controller's mirror of the node as it stands
    (so both number ops and timers alike), the deployment's clock (``t0_wall``: the wall
    time its second 0 was), and where adapters are read from."""

    node: NodeScheduler
    t0_wall: float
    dpo_beta: float
    max_len: int
    sync_root: str          # SEPARATE's synced weights: <sync_root>/v<k>
    era: int = 0            # how many times the controller replaced the node's scheduler (Adopt)


@dataclass(frozen=True, slots=True)
class Serve:
    """An inference request placed on the node (``pinned_dir``: its adapter version's
    directory, where it is served by a saved version)."""

    request: ServedRequest
    pinned_dir: Optional[str] = None


@dataclass(frozen=True, slots=True)
class Train:
    """A training task placed on the node, with its samples."""

    task: OnlineTask
    samples: list


@dataclass(frozen=True, slots=True)
class Cancel:
    """End request ``task_id`` at its next token, without it (``reason``: its finish reason)."""

    task_id: int
    reason: FinishReason


@dataclass(frozen=True, slots=True)
class Sync:
    """SEPARATE: the weights of ``version`` training tasks are ready to load."""

    version: int


@dataclass(frozen=True, slots=True)
class Pause:
    """Start nothing new; once nothing is in flight, say so in a report (``paused``)."""

    token: int


@dataclass(frozen=True, slots=True)
class OutOfBand:
    """While paused: run ``messages`` (one per stage, stage order), answer each to the
    controller, then carry on."""

    messages: list


@dataclass(frozen=True, slots=True)
class Adopt:
    """The policy changed between runs (nothing in flight): schedule with ``setup`` from now."""

    setup: NodeSetup


NodeCommand = Union[Serve, Train, Cancel, Sync, Pause, OutOfBand, Adopt]
