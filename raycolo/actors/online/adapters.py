"""The online controller's adapter versions: checkpoints, pins and exports.

A mixin of :class:`~raycolo.actors.online.controller.OnlineController` (it uses the
controller's config, ledger, op queues and ``_paused``). Every ``lora.checkpoint_every``
optimizer steps a node's stages report their adapter through Ray Train (a barrier between
ops); the same weights are written in peft's format under ``versions/v<k>`` and the newest
``serve.pinned_versions`` of them are servable as ``<model>@v<k>``. ``export_adapter``
joins a node's current adapter into one peft directory on demand; SEPARATE's sync op
loads such an export on the serving nodes.

Adapters loaded while serving (vLLM's ``POST /v1/load_lora_adapter``) are registered here,
the one registry every HTTP replica asks: each is checked against the model and the
deployment's LoRA, copied in the deployment's shape under ``loaded/lora-<n>`` and served
by the same mechanism as a saved version (a request pins that directory).
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import json
import shutil
import time
from pathlib import Path
from typing import Optional

from raycolo.engine.executor.adapters import AdapterError, check_adapter, convert_adapter, export_adapter
from raycolo.engine.executor.stage import LoraSettings
from raycolo.engine.executor.stage_ops import EvalBatch, ReadAdapter, SaveCheckpoint
from raycolo.online.driver import OpLost
from raycolo.online.samples import clip_sample, to_ranges, training_rows

MAX_LOADED_ADAPTERS = 64       # adapters loaded over HTTP at a time (each a copy on storage)


class AdapterVersions:
    async def held_out_loss(self, pairs: list, node: int = 0) -> float:
        """Loss of the model on ``pairs`` (prompt, completion), forward only, on ``node``."""
        return (await self._evaluate(pairs, node))["loss"]

    async def held_out_preference(self, pairs: list, node: int = 0) -> dict:
        """MACE's alignment metrics on held-out preference pairs (prompt, chosen, rejected),
        forward only, on ``node``: ``win_rate`` and ``clpd`` (raycolo.engine.executor.losses)."""
        out = await self._evaluate(pairs, node)
        return {"win_rate": out["win_rate"], "clpd": out["clpd"], "pairs": len(pairs)}

    async def _evaluate(self, samples: list, node: int) -> dict:
        """A forward-only pass of ``samples`` through ``node``'s stages, between its ops."""
        self.oob_seq -= 1
        samples = [clip_sample(x, self.config.lora.max_len) for x in samples]
        rows, _ = training_rows(samples)
        shape = (len(rows), max(len(p) + len(c) for p, c in rows))
        results = await self._paused(node, [EvalBatch(seq=self.oob_seq, after=self.oob_seq, shape=shape,
                                                      samples=samples) for _ in range(self.config.stages)])
        last = results[-1]
        return {"loss": last.loss, "win_rate": last.win_rate, "clpd": last.clpd}

    async def _checkpoint(self, node: int) -> None:
        """Every stage reports its adapter through Ray Train (a barrier), between ops."""
        self.adapter_version += 1
        version = self.adapter_version

        def payloads() -> list:      # built once the node's ops are done: what the adapter holds now
            held = json.dumps(to_ranges(self.ledger.holds(node)))
            # Recorded now, not after the reports came back: stage 0 may see Ray Train
            # commit the checkpoint (checkpoint_committed) before this coroutine resumes,
            # and a commit of a version not yet reported would be dropped for good.
            self.ledger.report(node, version)
            out = []
            for _ in range(self.config.stages):
                self.oob_seq -= 1
                out.append(SaveCheckpoint(seq=self.oob_seq, version=version,
                                          cursor=json.dumps(self.cursor.__dict__), held=held))
            return out

        try:
            results = await self._paused(node, payloads)
        except OpLost:
            return           # the group restarted first: it resumes from the previous checkpoint
        # No op of the node ran during the pause: the checkpoint holds the samples trained
        # so far; they count as kept once Ray Train commits it (checkpoint_committed).
        await self._keep_version(version, [r.state for r in results])

    def _version_dir(self, version) -> Path:
        """The directory a request pins: saved version ``k`` (an int), or a loaded
        adapter's handle (a str, :meth:`load_adapter`)."""
        if isinstance(version, str):
            return self.adapter_dir / "loaded" / version
        return self.adapter_dir / "versions" / f"v{version}"

    def _servable(self, version) -> bool:
        """Whether a request may pin ``version`` now: a saved version still servable, or
        the handle of an adapter loaded now."""
        if isinstance(version, str):
            return any(a["handle"] == version for a in self.loaded.values())
        return version in self.versions

    async def _keep_version(self, version: int, states: list) -> None:
        """Make checkpoint ``version`` servable as ``<model>@v<version>``: its adapter in
        peft's format on disk (every stage loads its layers' part when a request pins it),
        the newest ``serve.pinned_versions`` of them listed; older ones leave the list, and
        their files go unless an unfinished request still runs on them."""
        keep = self.config.serve.pinned_versions
        if keep == 0:
            return
        await asyncio.to_thread(export_adapter, states, self._lora_settings(), self._version_dir(version),
                                self.config.model_loading_config.model_id)
        held = sorted(self.versions + [version])
        self.versions = held[-keep:]
        pinned = {r.version for r in self.requests.values() if r.finish_reason is None}
        for old in held[:-keep]:      # no longer listed: its files go once nothing runs on it
            if old not in pinned:
                await asyncio.to_thread(shutil.rmtree, self._version_dir(old), True)

    async def adapter_versions(self) -> list[int]:
        """The saved adapter versions requests may pin (``<model>@v<k>``), oldest first."""
        return list(self.versions)

    async def checkpoint_committed(self, node: int, epoch: int, version: int, committed: Optional[int]) -> None:
        """Stage 0 of ``node`` saw Ray Train commit up to ``committed`` after reporting
        ``version``."""
        if epoch != self.epochs[node]:
            return           # the group restarted meanwhile (the ledger dropped its reports)
        if committed is None or committed < version:
            self.ledger.reported.pop((node, version), None)
            self.errors.append(f"node {node}: adapter checkpoint v{version} was not committed by Ray Train "
                               f"(last committed: {committed})")
            return
        self.ledger.commit(node, version)

    async def _stage_states(self, node: int) -> list[dict]:
        """Every stage's adapter weights, pulled between ops."""
        payloads = []
        for _ in range(self.config.stages):
            self.oob_seq -= 1
            payloads.append(ReadAdapter(seq=self.oob_seq))
        return [r.state for r in await self._paused(node, payloads)]

    async def export_adapter(self, directory: str, node: Optional[int] = None) -> str:
        """Join the adapter of ``node``'s stages (default: the node that trained last) into
        one directory in peft's format (adapter_config.json, adapter_model.safetensors)."""
        node = self.last_trained_node if node is None else node
        states = await self._stage_states(node)
        return str(export_adapter(states, self._lora_settings(), directory,
                                  self.config.model_loading_config.model_id))

    def _lora_settings(self) -> LoraSettings:
        cfg = self.config
        return LoraSettings(cfg.lora.rank, cfg.lora.alpha, tuple(cfg.lora.target_modules), cfg.lora.lr,
                            cfg.model_loading_config.seed)

    async def _export_for_sync(self, version: int) -> None:
        """SEPARATE: the training group's adapter, exported once per synced version."""
        if version not in self.exports:
            target = self.adapter_dir / f"v{version}"
            self.exports[version] = asyncio.get_running_loop().create_task(self.export_adapter(str(target)))
        await self.exports[version]

    # -- adapters loaded while serving (POST /v1/load_lora_adapter) ------------------------------
    @functools.cached_property
    def _lora_layout(self) -> tuple[dict, dict]:
        """The deployment's adapter weights (key -> shape) and the model's linear layers."""
        from raycolo.engine.executor.adapters import lora_shapes, model_linears

        return lora_shapes(self.model_config, self._lora_settings()), model_linears(self.model_config)

    @functools.cached_property
    def _adapter_lock(self) -> asyncio.Lock:
        return asyncio.Lock()

    @functools.cached_property
    def _handles(self) -> itertools.count:
        return itertools.count(1)

    @functools.cached_property
    def _drops(self) -> set:
        return set()                   # deletions of unloaded adapters' copies under way

    def _reserved_name(self, name: str) -> bool:
        """A name the served model's variants use: ``<model>``, ``<model>@base``, ``<model>@v<k>``
        (anything ``<model>@...``)."""
        served = self.config.served_model_name()
        return name == served or name.startswith(served + "@")

    async def load_adapter(self, name: str, path: str, load_inplace: bool = False) -> dict:
        """Serve the peft LoRA adapter at ``path`` as model ``name``: ``{"loaded": name}``, or
        ``{"status", "message", "param", "code"}`` saying why not (vLLM's errors: a name
        loaded already is a 400 unless ``load_inplace``, a path with nothing there a 404).
        It is checked against the model and the deployment's LoRA (rank at most
        ``lora.rank``, only modules it adapts), then written in the deployment's shape to
        ``loaded/lora-<n>``: requests naming it pin that copy, so later changes to ``path``
        do not reach them. ``load_inplace`` replaces an adapter of that name (requests
        running on the old one finish on it)."""
        def refuse(status: int, message: str, param: str, code: str) -> dict:
            return {"status": status, "message": message, "param": param, "code": code}

        allowed = self.config.serve.lora_load_dirs
        if not allowed:
            return refuse(403, "loading adapters over HTTP is off: the deployment's serve.lora_load_dirs names "
                          "no directory to load them from", "lora_path", "adapter_loading_disabled")
        try:
            source = Path(path).resolve()       # symlinks too: the directory it really is
        except (OSError, ValueError, RuntimeError):
            source = None
        if source is None or not any(source.is_relative_to(Path(d).resolve()) for d in allowed):
            return refuse(403, f"lora_path: adapters are loaded only from under serve.lora_load_dirs "
                          f"({', '.join(allowed)})", "lora_path", "path_not_allowed")
        if self._reserved_name(name):
            return refuse(400, f"The lora adapter name '{name}' conflicts with a served base model "
                          f"('{self.config.served_model_name()}' and its '@base' and '@v<k>' variants).",
                          "lora_name", "adapter_name_conflict")
        async with self._adapter_lock:
            if name in self.loaded and not load_inplace:
                return refuse(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                              "the adapter in place, set 'load_inplace' to True.", "lora_name",
                              "adapter_already_loaded")
            if name not in self.loaded and len(self.loaded) >= MAX_LOADED_ADAPTERS:
                return refuse(400, f"{MAX_LOADED_ADAPTERS} adapters are loaded already, the most at a time; "
                              "unload one first (POST /v1/unload_lora_adapter)", "lora_name", "too_many_adapters")
            handle = f"lora-{next(self._handles)}"
            expected, linears = await asyncio.to_thread(lambda: self._lora_layout)

            def convert():
                info = check_adapter(source, self.model_config, self._lora_settings(), exact=False,
                                     expected=expected, linears=linears)
                convert_adapter(info, self._lora_settings(), expected, self._version_dir(handle),
                                self.config.model_loading_config.model_id)
                return info

            try:
                info = await asyncio.to_thread(convert)
            except AdapterError as exc:
                await asyncio.to_thread(shutil.rmtree, self._version_dir(handle), True)
                message = f"Loading lora adapter '{name}' failed: {path}: {exc}"
                if exc.missing:            # vLLM: "No adapter found" is a 404
                    return refuse(404, message, "lora_path", "adapter_not_found")
                return refuse(400, message, "lora_path", "invalid_adapter")
            old = self.loaded.get(name)
            self.loaded[name] = {"name": name, "path": str(path), "handle": handle, "rank": info.rank,
                                 "created": int(time.time())}
            if old is not None:
                self._drop_loaded(old["handle"])
        return {"loaded": name}

    async def unload_adapter(self, name: str) -> dict:
        """Stop serving loaded adapter ``name``: ``{"unloaded": name}``, or a 404 (vLLM's)
        for a name not loaded. Requests running on it finish on it; its copy goes after them."""
        async with self._adapter_lock:
            entry = self.loaded.pop(name, None)
        if entry is None:
            loaded = ", ".join(f"'{n}'" for n in self.loaded) or "none"
            return {"status": 404, "message": f"The lora adapter '{name}' cannot be found (loaded: {loaded}).",
                    "param": "lora_name", "code": "adapter_not_found"}
        self._drop_loaded(entry["handle"])
        return {"unloaded": name}

    def _drop_loaded(self, handle: str) -> None:
        """Delete an unloaded adapter's copy once no unfinished request pins it."""
        async def drop():
            while any(r.version == handle and r.finish_reason is None for r in self.requests.values()):
                await asyncio.sleep(0.5)
            await asyncio.to_thread(shutil.rmtree, self._version_dir(handle), True)

        task = asyncio.get_running_loop().create_task(drop())
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)

    async def resolve_adapter(self, name: str) -> Optional[str]:
        """The handle a request for loaded adapter ``name`` pins (``version`` of
        :meth:`admit`), or None when no adapter of that name is loaded."""
        entry = self.loaded.get(name)
        return None if entry is None else entry["handle"]

    async def loaded_adapters(self) -> list[dict]:
        """The adapters loaded now, in load order: name, path, rank, created."""
        return [{k: v for k, v in a.items() if k != "handle"} for a in self.loaded.values()]
