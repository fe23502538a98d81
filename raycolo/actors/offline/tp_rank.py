"""The other ranks of a tensor-parallel torch replica as Ray actors in its placement group.

A replica of ``tp`` GPUs holds a placement group of ``tp`` bundles. Its
:class:`~raycolo.actors.offline.engine_actor.EngineActor` runs in bundle 0 and is rank 0
(the scheduler, sampling); :class:`RayRanks` starts one :class:`TPRankActor` in each other
bundle, which joins the process group and replays rank 0's steps
(:func:`raycolo.engine.executor.tp_ranks.follow`). The rank actors are owned by the engine
actor: when it dies they die with it, and a rank's death fails rank 0's next collective
within ``COLLECTIVE_TIMEOUT_S``, so a replica is one unit to the controller's restart path.
Rendezvous through a file store where every bundle is on rank 0's Ray node (nothing
listens on a port), else a TCP store on that node's IP.
"""
from __future__ import annotations

import os

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raycolo.engine.executor.tp_ranks import RankInfo, Ranks, free_port, local_address

START_TIMEOUT_S = 300


def _here(rank: int) -> RankInfo:
    context = ray.get_runtime_context()
    return RankInfo(rank, os.getpid(), context.get_node_id(), ray.util.get_node_ip_address(),
                    tuple(str(g) for g in ray.get_gpu_ids()))


@ray.remote(num_cpus=0, max_concurrency=2)
class TPRankActor:
    def __init__(self, rank: int):
        self.rank = rank

    def where(self) -> RankInfo:
        return _here(self.rank)

    def run(self, world: int, address: str, backend: str, threads: int) -> int:
        """Join the group and follow rank 0 until it says stop; the steps run."""
        import torch
        import torch.distributed as dist

        from raycolo.engine.executor.tp_ranks import follow, init_rank

        torch.set_num_threads(max(1, threads))
        tp, channel = init_rank(self.rank, world, address, backend)
        try:
            return follow(channel, tp)
        finally:
            dist.destroy_process_group()


class RayRanks(Ranks):
    """Ranks 1..world-1 in bundles 1..world-1 of this actor's placement group."""

    def __init__(self, world: int, device: str, threads: int = 1):
        self.threads = threads
        self.device = device
        pg = ray.util.get_current_placement_group()
        if pg is None or len(pg.bundle_specs) < world:
            raise RuntimeError(f"tensor_parallel_size {world}: the replica's placement group has "
                               f"{0 if pg is None else len(pg.bundle_specs)} bundles")
        self.pg = pg
        gpus = device.startswith("cuda")
        self.actors = [TPRankActor.options(
            num_gpus=1, max_restarts=0,             # its bundle's GPU (logical on a CPU cluster)
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
        ).remote(r) for r in range(1, world)]
        self.where = ray.get([a.where.remote() for a in self.actors], timeout=START_TIMEOUT_S)
        node = ray.get_runtime_context().get_node_id()
        address = (local_address() if all(w.node_id == node for w in self.where)
                   else f"tcp://{ray.util.get_node_ip_address()}:{free_port()}")
        super().__init__(world, "nccl" if gpus else "gloo", address)

    def _start_others(self, address: str) -> None:
        self.loops = [a.run.remote(self.world, address, self.backend, self.threads) for a in self.actors]

    def _stop_others(self) -> None:
        try:
            ray.get(self.loops, timeout=30)
        except Exception:              # noqa: BLE001 - a rank that died or hangs: killed below
            pass
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []

    def describe(self) -> list[RankInfo]:
        return [_here(0)] + list(self.where)

    def alive(self) -> bool:
        """A rank's loop ends only when told to stop: one that ended (within a moment of
        the failed collective, as Ray learns of the death) is a rank lost."""
        ended, _ = ray.wait(self.loops, num_returns=1, timeout=2.0)
        return not ended
