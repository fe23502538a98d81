"""The ranks of a tensor-parallel executor: rank 0 leads, the others replay its steps.

Rank 0 holds the scheduler (the engine) and a :class:`TPLeader` in place of its executor:
every step it runs is first broadcast to the other ranks as a typed :class:`TPMessage`
(the step's :class:`SeqChunk` list: token ids, positions, block tables), over a small gloo
side channel, then run on its own shard. Each other rank runs :func:`follow`: receive a
message, run the same step on its shard (the block tables are the same on every rank;
each cache holds its rank's heads), repeat. The all-reduces inside the layers keep the
ranks in lockstep; only rank 0 samples.

:class:`LocalRanks` hosts the other ranks as spawned processes of this machine (one
per device: ``cuda:r``, or the CPU). Process groups: NCCL between distinct GPUs, gloo
otherwise (the CPU, or ranks sharing one GPU); the side channel is always gloo. Rendezvous
on one machine through a file store, the traffic on the loopback interface.
"""
from __future__ import annotations

import multiprocessing as mp
from abc import ABC, abstractmethod
import os
import socket
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Sequence

import torch

from raycolo.engine.executor.batch import SeqChunk
from raycolo.engine.executor.fused import FUSE_PROJECTIONS
from raycolo.engine.executor.idle_group import idle_group
from raycolo.engine.executor.tensor_parallel import TensorParallel

# A collective that waits longer than this fails (a dead rank): the replica fails with it
# and is restarted, instead of hanging on gloo's default of 30 minutes. The environment
# variable sets it for a process and the ranks it spawns (tests shorten it).
COLLECTIVE_TIMEOUT_ENV = "RAYCOLO_TP_COLLECTIVE_TIMEOUT_S"
COLLECTIVE_TIMEOUT_S = float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, 120))


class RankLost(RuntimeError):
    """A rank of the tensor-parallel group is gone: the replica is gone with it (its host
    restarts the whole replica; raycolo/actors/offline/engine_actor.py)."""


class TPOp(Enum):
    LOAD = "load"           # build the executor of a RankSpec (the model loaded, then cut)
    STEP = "step"
    SLEEP = "sleep"
    WAKE_UP = "wake_up"
    STOP = "stop"


@dataclass
class TPMessage:
    op: TPOp
    chunks: list = field(default_factory=list)      # SeqChunk of a STEP
    spec: Optional["RankSpec"] = None               # of a LOAD


@dataclass
class RankSpec:
    """What a follower rank builds: the same model and cache as rank 0, on its device."""

    model_id: str
    seed: int
    dtype: str
    device: str                 # "cpu" or "cuda" (rank r takes cuda:r, modulo the GPUs)
    num_blocks: int
    block_size: int
    cuda_graphs: bool = False
    fuse_projections: bool = FUSE_PROJECTIONS

    def rank_device(self, rank: int) -> str:
        if self.device.startswith("cuda"):
            return f"cuda:{rank % max(1, torch.cuda.device_count())}"
        return self.device


class Channel:
    """Rank 0's messages to the others, over a gloo group."""

    def __init__(self, group):
        self.group = group

    def send(self, message: TPMessage) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.group)

    def recv(self) -> TPMessage:
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Every rank got here (after a load: a rank's first step then never waits on
        another's loading within the collective timeout)."""
        import torch.distributed as dist

        dist.barrier(group=self.group)


@dataclass
class _Step:
    chunks: list
    batch: object

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens


class TPLeader:
    """Rank 0's executor: the same interface as :class:`ModelExecutor`; each step, sleep and
    wake-up goes to the other ranks first."""

    paged = True

    def __init__(self, executor, channel: Channel, ranks=None):
        self.executor, self.channel, self.ranks = executor, channel, ranks

    def __getattr__(self, name):          # cache, config, device, graphs, ...
        return getattr(self.executor, name)

    def batch(self, chunks: Sequence[SeqChunk]) -> _Step:
        return _Step([SeqChunk(list(c.tokens), c.start, list(c.table), c.num_tokens) for c in chunks],
                     self.executor.batch(chunks))

    def execute(self, step: _Step, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        try:
            self.channel.send(TPMessage(TPOp.STEP, step.chunks))
            return self.executor.execute(step.batch, hidden)
        except Exception as exc:
            if self.ranks is not None and not self.ranks.alive():
                raise RankLost(f"a tensor-parallel rank of this replica is gone ({exc})") from exc
            raise

    def sleep(self) -> None:
        self.channel.send(TPMessage(TPOp.SLEEP))
        self.executor.sleep()

    def wake_up(self) -> None:
        self.channel.send(TPMessage(TPOp.WAKE_UP))
        self.executor.wake_up()

    def close(self) -> None:
        """Stop the other ranks (their processes end)."""
        if self.ranks is not None:
            self.ranks.close()


def follow(channel: Channel, tp: TensorParallel, executor=None) -> int:
    """A follower rank's loop: run what rank 0 sends until it says stop; returns the steps run."""
    steps = 0
    while True:
        message = channel.recv()
        if message.op is TPOp.STOP:
            return steps
        if message.op is TPOp.LOAD:
            executor = None                              # the old shard goes first
            executor = build_rank_executor(message.spec, tp)
            channel.barrier()
        elif message.op is TPOp.SLEEP:                   # as the engine sleeps: cache freed,
            executor.sleep()                             # weights to host memory
            if executor.device.type != "cpu":
                executor.model.to("cpu")
                torch.cuda.empty_cache()
        elif message.op is TPOp.WAKE_UP:
            if executor.device.type != "cpu":
                executor.model.to(executor.device)
            executor.wake_up()
        else:
            executor.execute(executor.batch(message.chunks))
            steps += 1


@dataclass(frozen=True)
class RankInfo:
    """Where one rank of a replica runs (a replica's record in report.json lists them)."""

    rank: int
    pid: int
    node_id: str = ""
    node_ip: str = ""
    gpu_ids: tuple = ()


def local_address() -> str:
    """A rendezvous for ranks on one machine: a file store (a TCP store would listen on
    every address), in a fresh directory of its own."""
    import os
    import tempfile

    return "file://" + os.path.join(tempfile.mkdtemp(prefix="raycolo-tp-"), "store")


def _interfaces() -> set[str]:
    """The machine's network interfaces by name (none where a sandbox refuses to list them:
    gloo then picks its own)."""
    try:
        return {name for _, name in socket.if_nameindex()}
    except OSError:
        return set()


def _interface_to(address: str) -> Optional[str]:
    """The interface this machine reaches ``tcp://host:port``'s host through (None where
    that cannot be told). Gloo otherwise binds where the hostname resolves, 127.0.1.1 on
    many Debian and Ubuntu machines, which the ranks of other nodes cannot reach."""
    import urllib.parse

    try:
        import psutil

        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((urllib.parse.urlsplit(address).hostname, 9))    # UDP: sends nothing
            ip = probe.getsockname()[0]
        finally:
            probe.close()
        return next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == ip for a in addrs)),
                    None)
    except (OSError, ImportError, TypeError, ValueError):
        return None


def init_rank(rank: int, world: int, address: str, backend: str) -> tuple[TensorParallel, Channel]:
    """Join the tensor-parallel group (this process's default group) and its side channel.
    Ranks of one machine (a ``file://`` rendezvous) talk over the loopback interface."""
    import datetime
    import os

    import torch.distributed as dist

    interface = "lo" if address.startswith("file://") else _interface_to(address)
    if interface in _interfaces():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)

    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    # not the default group: with its timeout, a replica idle for 2 minutes lost its followers.
    # A follower whose rank 0 died goes with it (a daemon process, an actor rank 0 owns).
    side = idle_group(dist)
    return TensorParallel(rank, world, dist.group.WORLD), Channel(side)


def build_rank_executor(spec: RankSpec, tp: TensorParallel):
    """This rank's model shard and executor: only the shard read from a safetensors
    checkpoint (:mod:`.shard_load`), else the model loaded whole in host memory and cut;
    only the shard goes to the device."""
    from raycolo.engine.executor.model import ModelExecutor
    from raycolo.engine.executor.shard_load import load_rank_model

    device = spec.rank_device(tp.rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    model, _ = load_rank_model(spec.model_id, spec.seed, spec.dtype, tp)     # the device gets this rank's shard
    return ModelExecutor(model, spec.num_blocks, spec.block_size, cuda_graphs=spec.cuda_graphs, tp=tp,
                         fuse_projections=spec.fuse_projections, device=device)


def _follower_main(rank: int, world: int, address: str, backend: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    tp, channel = init_rank(rank, world, address, backend)
    try:
        follow(channel, tp)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks(ABC):
    """The ranks of one tensor-parallel replica, seen from rank 0 (this process): how the
    others are started is a subclass's :meth:`_start_others`. :meth:`load` builds an
    executor on all of them; :meth:`close` stops them."""

    def __init__(self, world: int, backend: str, address: str):
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size: this process already belongs to a process group")
        self.world, self.backend, self.address = world, backend, address
        self._start_others(address)
        self.tp, self.channel = init_rank(0, world, address, backend)
        self.leader: Optional[TPLeader] = None

    @abstractmethod
    def _start_others(self, address: str) -> None:
        """Start ranks 1..world-1, each joining the group at ``address``."""

    @abstractmethod
    def _stop_others(self) -> None:
        """Wait for the other ranks to end (they were told to stop), ending any that hang."""

    @abstractmethod
    def describe(self) -> list[RankInfo]:
        """Every rank's place, rank 0 first."""

    @abstractmethod
    def alive(self) -> bool:
        """Whether every other rank is still running (asked after a collective failed)."""

    def load(self, spec: RankSpec, model=None) -> "TPLeader":
        """Every rank builds ``spec``'s executor; rank 0 cuts ``model`` (already loaded on its
        device) or loads its own. Returns rank 0's :class:`TPLeader`."""
        from raycolo.engine.executor.model import ModelExecutor

        self.channel.send(TPMessage(TPOp.LOAD, spec=spec))
        if model is None:
            executor = build_rank_executor(spec, self.tp)
        else:
            executor = ModelExecutor(model, spec.num_blocks, spec.block_size, cuda_graphs=spec.cuda_graphs,
                                     tp=self.tp, fuse_projections=spec.fuse_projections,
                                     device=spec.rank_device(0))
        try:
            self.channel.barrier()
        except RuntimeError as exc:          # a rank that died loading (gloo: its connection closed)
            raise RankLost(f"a tensor-parallel rank of this replica did not load ({exc})") from exc
        self.leader = TPLeader(executor, self.channel, self)
        return self.leader

    def close(self) -> None:
        """Stop the other ranks, wait for them, leave the group."""
        import torch.distributed as dist

        if self.channel is None:
            return
        try:
            self.channel.send(TPMessage(TPOp.STOP))
        except Exception:               # noqa: BLE001 - a rank already gone: stop the rest anyway
            pass
        finally:
            self.channel = None
            self._stop_others()
            if dist.is_initialized():
                dist.destroy_process_group()
            if self.address.startswith("file://"):
                import shutil
                shutil.rmtree(os.path.dirname(self.address[len("file://"):]), ignore_errors=True)


class LocalRanks(Ranks):
    """Ranks 1..world-1 as spawned processes of this machine (rank r on ``cuda:r``, or the
    CPU); NCCL where each rank has a GPU of its own, else gloo."""

    def __init__(self, world: int, device: str = "cpu"):
        backend = "nccl" if device.startswith("cuda") and torch.cuda.device_count() >= world else "gloo"
        super().__init__(world, backend, local_address())

    def _start_others(self, address: str) -> None:
        ctx = mp.get_context("spawn")
        self.processes = [ctx.Process(target=_follower_main, args=(r, self.world, address, self.backend),
                                      daemon=True) for r in range(1, self.world)]
        for p in self.processes:
            p.start()

    def _stop_others(self) -> None:
        for p in self.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self.processes = []

    def describe(self) -> list[RankInfo]:
        return [RankInfo(0, os.getpid())] + [RankInfo(r, p.pid) for r, p in enumerate(self.processes, start=1)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)
