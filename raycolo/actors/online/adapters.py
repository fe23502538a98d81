"""The online controller's adapter versions: checkpoints, pins and exports.

A role of the online controller (``ctl.<role>``, see :mod:`.state`). Every ``lora.checkpoint_every``
optimizer steps a node's stages report their adapter through Ray Train (a barrier between
ops); the same weights are written in peft's format under ``versions/v<k>`` and the newest
``serve.pinned_versions`` of them are servable as ``<model>@v<k>``. ``export_adapter``
joins a node's current adapter into one peft directory on demand; SEPARATE's sync op
loads such an export on the serving nodes.

Adapters loaded over HTTP are in :mod:`.loaded_adapters`.
"""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Optional

from raycolo.online.stages.lora_settings import LoraSettings
from raycolo.online.stages.stage_ops import EvalBatch, ReadAdapter, SaveCheckpoint
from raycolo.online.driver import OpLost
from raycolo.online.samples import clip_sample, to_ranges, training_rows


class AdapterVersions:
    def __init__(self, ctl) -> None:
        """This role's own state (it alone writes these); ``ctl`` is the OnlineController."""
        self.ctl = ctl
        self.adapter_version = 0
        self.exports: dict[int, asyncio.Task] = {}
        self.versions: list[int] = []                 # adapter versions servable as @v<k>
        self.oob_seq = -1_000_000     # seq numbers of out-of-band payloads (checkpoint, lora)

    def resume_version(self, version: int) -> None:
        """Take up an earlier deployment's adapter version (the nodes restored it)."""
        self.adapter_version = version

    async def held_out_loss(self, pairs: list, node: int = 0) -> float:
        """Loss of the model on ``pairs`` (prompt, completion), forward only, on ``node``."""
        return (await self._evaluate(pairs, node))["loss"]

    async def held_out_preference(self, pairs: list, node: int = 0) -> dict:
        """MACE's alignment metrics on held-out preference pairs (prompt, chosen, rejected),
        forward only, on ``node``: ``win_rate`` and ``clpd`` (raycolo.online.stages.losses)."""
        out = await self._evaluate(pairs, node)
        return {"win_rate": out["win_rate"], "clpd": out["clpd"], "pairs": len(pairs)}

    async def _evaluate(self, samples: list, node: int) -> dict:
        """A forward-only pass of ``samples`` through ``node``'s stages, between its ops."""
        self.oob_seq -= 1
        samples = [clip_sample(x, self.ctl.config.lora.max_len) for x in samples]
        rows, _ = training_rows(samples)
        shape = (len(rows), max(len(p) + len(c) for p, c in rows))
        results = await self.ctl.runner.paused(node, [EvalBatch(seq=self.oob_seq, after=self.oob_seq, shape=shape,
                                                      samples=samples) for _ in range(self.ctl.config.stages)])
        last = results[-1]
        return {"loss": last.loss, "win_rate": last.win_rate, "clpd": last.clpd}

    async def checkpoint(self, node: int) -> None:
        """Every stage reports its adapter through Ray Train (a barrier), between ops."""
        self.adapter_version += 1
        version = self.adapter_version

        def payloads() -> list:      # built once the node's ops are done: what the adapter holds now
            held = json.dumps(to_ranges(self.ctl.ledger.holds(node)))
            # Recorded now, not after the reports came back: stage 0 may see Ray Train
            # commit the checkpoint (checkpoint_committed) before this coroutine resumes,
            # and a commit of a version not yet reported would be dropped for good.
            self.ctl.ledger.report(node, version)
            out = []
            for _ in range(self.ctl.config.stages):
                self.oob_seq -= 1
                out.append(SaveCheckpoint(seq=self.oob_seq, version=version,
                                          cursor=json.dumps(self.ctl.pump.cursor.__dict__), held=held))
            return out

        try:
            results = await self.ctl.runner.paused(node, payloads)
        except OpLost:
            return           # the group restarted first: it resumes from the previous checkpoint
        # No op of the node ran during the pause: the checkpoint holds the samples trained
        # so far; they count as kept once Ray Train commits it (checkpoint_committed).
        await self._keep_version(version, [r.state for r in results])

    def version_dir(self, version) -> Path:
        """The directory a request pins: saved version ``k`` (an int), or a loaded
        adapter's handle (a str, :meth:`load_adapter`)."""
        if isinstance(version, str):
            return self.ctl.adapter_dir / "loaded" / version
        return self.ctl.adapter_dir / "versions" / f"v{version}"

    def servable(self, version) -> bool:
        """Whether a request may pin ``version`` now: a saved version still servable, or
        the handle of an adapter loaded now."""
        if isinstance(version, str):
            return any(a["handle"] == version for a in self.ctl.loras.loaded.values())
        return version in self.versions

    async def _keep_version(self, version: int, states: list) -> None:
        """Make checkpoint ``version`` servable as ``<model>@v<version>``: its adapter in
        peft's format on disk (every stage loads its layers' part when a request pins it),
        the newest ``serve.pinned_versions`` of them listed; older ones leave the list, and
        their files go unless an unfinished request still runs on them."""
        keep = self.ctl.config.serve.pinned_versions
        if keep == 0:
            return
        await self.ctl.in_thread(self._export, states, self.version_dir(version))
        held = sorted(self.versions + [version])
        self.versions = held[-keep:]
        pinned = {r.version for r in self.ctl.desk.requests.values() if r.finish_reason is None}
        for old in held[:-keep]:      # no longer listed: its files go once nothing runs on it
            if old not in pinned:
                await asyncio.to_thread(shutil.rmtree, self.version_dir(old), True)

    async def adapter_versions(self) -> list[int]:
        """The saved adapter versions requests may pin (``<model>@v<k>``), oldest first."""
        return list(self.versions)

    async def checkpoint_committed(self, node: int, epoch: int, version: int, committed: Optional[int]) -> None:
        """Stage 0 of ``node`` saw Ray Train commit up to ``committed`` after reporting
        ``version``."""
        if epoch != self.ctl.workers.epochs[node]:
            return           # the group restarted meanwhile (the ledger dropped its reports)
        if committed is None or committed < version:
            self.ctl.ledger.uncommitted(node, version)
            self.ctl.note_error(f"node {node}: adapter checkpoint v{version} was not committed by Ray Train "
                               f"(last committed: {committed})")
            return
        self.ctl.ledger.commit(node, version)

    async def _stage_states(self, node: int) -> list[dict]:
        """Every stage's adapter weights, pulled between ops."""
        payloads = []
        for _ in range(self.ctl.config.stages):
            self.oob_seq -= 1
            payloads.append(ReadAdapter(seq=self.oob_seq))
        return [r.state for r in await self.ctl.runner.paused(node, payloads)]

    async def export_adapter(self, directory: str, node: Optional[int] = None) -> str:
        """Join the adapter of ``node``'s stages (default: the node that trained last) into
        one directory in peft's format (adapter_config.json, adapter_model.safetensors)."""
        node = self.ctl.runner.last_trained_node if node is None else node
        return str(self._export(await self._stage_states(node), directory))

    def _export(self, states: list[dict], directory) -> Path:
        from raycolo.online.stages.peft_format import export_adapter    # torch: not at the controller's start

        return export_adapter(states, self.lora_settings(), directory, self.ctl.config.model_loading_config.model_id)

    def lora_settings(self) -> LoraSettings:
        cfg = self.ctl.config
        return LoraSettings(cfg.lora.rank, cfg.lora.alpha, tuple(cfg.lora.target_modules), cfg.lora.lr,
                            cfg.model_loading_config.seed)

    async def export_for_sync(self, version: int) -> None:
        """SEPARATE: the training group's adapter, exported once per synced version."""
        if version not in self.exports:
            target = self.ctl.adapter_dir / f"v{version}"
            self.exports[version] = asyncio.get_running_loop().create_task(self.export_adapter(str(target)))
        await self.exports[version]
