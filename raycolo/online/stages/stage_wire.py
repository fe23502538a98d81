"""Typed messages between a node's stage processes over their own process group.

A node loop in stage 0's process tells stage s what to run (a
:mod:`raycolo.online.stages.stage_ops` message) and hears back its
:class:`~raycolo.online.stages.stage_ops.StageResult` over ``torch.distributed`` (the
stages' own processes): no actor call per op. A message is pickled
into a uint8 tensor. It goes as one fixed-size frame (its length, then its first bytes),
and only a message larger than the frame sends the rest as a second tensor, so a decode
step's header costs one send. Headers use tags above every op's point-to-point tag
(those are an op's ``seq`` modulo :data:`~raycolo.online.stages.stage_process.TAG_MOD`), so
they would never match an activation's receive even on one group.

Headers are host data on a gloo group of their own
(:func:`~raycolo.engine.executor.idle_group.idle_group`, passed as ``group``): its timeout
is a week, as a stage waits there for its next op however long its node idles; on the
group of the activations, a node idle past that group's timeout (Ray Train's
``TorchConfig.timeout_s``, 30 minutes) lost its stages.

Pure torch: no Ray.
"""
from __future__ import annotations

import pickle
import struct

import torch

from raycolo.online.stages.stage_process import TAG_MOD

FRAME_BYTES = 1024           # one send carries a message up to this, with its length
DOWN_TAG = TAG_MOD           # stage 0 -> stage s: what to run
UP_TAG = TAG_MOD + 1         # stage s -> stage 0: its result
_LENGTH = struct.Struct("<q")


def send_message(message, dst: int, tag: int, dist, group=None) -> None:
    """Send ``message`` (any picklable object) to rank ``dst`` and wait until it is sent."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    room = FRAME_BYTES - _LENGTH.size
    frame = bytearray(FRAME_BYTES)
    _LENGTH.pack_into(frame, 0, len(data))
    frame[_LENGTH.size:_LENGTH.size + min(room, len(data))] = data[:room]
    dist.send(torch.frombuffer(frame, dtype=torch.uint8), dst, group=group, tag=tag)
    if len(data) > room:
        rest = bytearray(data[room:])
        dist.send(torch.frombuffer(rest, dtype=torch.uint8), dst, group=group, tag=tag)


def recv_message(src: int, tag: int, dist, group=None):
    """Receive the next message rank ``src`` sent with ``tag`` (blocks the calling thread)."""
    frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
    dist.recv(frame, src, group=group, tag=tag)
    head = frame.numpy().tobytes()
    (length,) = _LENGTH.unpack_from(head, 0)
    room = FRAME_BYTES - _LENGTH.size
    if length <= room:
        return pickle.loads(head[_LENGTH.size:_LENGTH.size + length])
    rest = torch.empty(length - room, dtype=torch.uint8)
    dist.recv(rest, src, group=group, tag=tag)
    return pickle.loads(head[_LENGTH.size:] + rest.numpy().tobytes())
