"""Adapters loaded while serving (vLLM's ``POST /v1/load_lora_adapter``).

A role of the online controller (``ctl.<role>``, see :mod:`.state`): the one
registry every HTTP replica asks. Each adapter is checked against the model and the
deployment's LoRA, copied in the deployment's shape under ``loaded/lora-<n>`` and served
by the same mechanism as a saved version (a request pins that directory).
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import shutil
import time
from pathlib import Path
from typing import Optional

from raycolo.online.serving.messages import AdapterRefusal


MAX_LOADED_ADAPTERS = 64       # adapters loaded over HTTP at a time (each a copy on storage)


class LoadedAdapters:
    def __init__(self, ctl) -> None:
        """This role's own state (it alone writes these); ``ctl`` is the OnlineController."""
        self.ctl = ctl
        self.loaded: dict[str, dict] = {}             # adapters loaded over HTTP, by name (online_adapters.py)

    @functools.cached_property
    def _lora_layout(self) -> tuple[dict, dict]:
        """The deployment's adapter weights (key -> shape) and the model's linear layers."""
        from raycolo.online.stages.peft_format import lora_shapes, model_linears

        return lora_shapes(self.ctl.model_config, self.ctl.adapters.lora_settings()), model_linears(self.ctl.model_config)

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
        served = self.ctl.config.served_model_name()
        return name == served or name.startswith(served + "@")

    async def load_adapter(self, name: str, path: str, load_inplace: bool = False) -> Optional[AdapterRefusal]:
        """Serve the peft LoRA adapter at ``path`` as model ``name``: None once it is, or an
        :class:`AdapterRefusal` saying why not (vLLM's errors: a name
        loaded already is a 400 unless ``load_inplace``, a path with nothing there a 404).
        It is checked against the model and the deployment's LoRA (rank at most
        ``lora.rank``, only modules it adapts), then written in the deployment's shape to
        ``loaded/lora-<n>``: requests naming it pin that copy, so later changes to ``path``
        do not reach them. ``load_inplace`` replaces an adapter of that name (requests
        running on the old one finish on it)."""
        refuse = AdapterRefusal
        allowed = self.ctl.config.serve.lora_load_dirs
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
                          f"('{self.ctl.config.served_model_name()}' and its '@base' and '@v<k>' variants).",
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
            expected, linears = await self.ctl.in_thread(lambda: self._lora_layout)
            from raycolo.online.stages.peft_format import AdapterError, check_adapter, convert_adapter  # imported ^

            def convert():
                info = check_adapter(source, self.ctl.model_config, self.ctl.adapters.lora_settings(), exact=False,
                                     expected=expected, linears=linears)
                convert_adapter(info, self.ctl.adapters.lora_settings(), expected, self.ctl.adapters.version_dir(handle),
                                self.ctl.config.model_loading_config.model_id)
                return info

            try:
                info = await self.ctl.in_thread(convert)
            except AdapterError as exc:
                await asyncio.to_thread(shutil.rmtree, self.ctl.adapters.version_dir(handle), True)
                message = f"Loading lora adapter '{name}' failed: {path}: {exc}"
                if exc.missing:            # vLLM: "No adapter found" is a 404
                    return refuse(404, message, "lora_path", "adapter_not_found")
                return refuse(400, message, "lora_path", "invalid_adapter")
            old = self.loaded.get(name)
            self.loaded[name] = {"name": name, "path": str(path), "handle": handle, "rank": info.rank,
                                 "created": int(time.time())}
            if old is not None:
                self._drop_loaded(old["handle"])
        return None

    async def unload_adapter(self, name: str) -> Optional[AdapterRefusal]:
        """Stop serving loaded adapter ``name``: None once stopped, or a 404 (vLLM's)
        for a name not loaded. Requests running on it finish on it; its copy goes after them."""
        async with self._adapter_lock:
            entry = self.loaded.pop(name, None)
        if entry is None:
            loaded = ", ".join(f"'{n}'" for n in self.loaded) or "none"
            return AdapterRefusal(404, f"The lora adapter '{name}' cannot be found (loaded: {loaded}).",
                                  "lora_name", "adapter_not_found")
        self._drop_loaded(entry["handle"])
        return None

    def _drop_loaded(self, handle: str) -> None:
        """Delete an unloaded adapter's copy once no unfinished request pins it."""
        async def drop():
            while any(r.version == handle and r.finish_reason is None for r in self.ctl.desk.requests.values()):
                await asyncio.sleep(0.5)
            await asyncio.to_thread(shutil.rmtree, self.ctl.adapters.version_dir(handle), True)

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
