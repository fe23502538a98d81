"""An append-only file of JSON lines, fsynced per batch: what the online sample store and
the offline output journal persist before they acknowledge anything.

A batch is written whole or not at all: when a write fails (a full disk, a file system
gone read-only, a bad descriptor), the file is cut back to its last acknowledged byte and
the buffer's leftover text is dropped, so nothing of the refused batch reaches the disk
later, and :class:`~raycolo.errors.StoreFull` names the file. The journal then goes on:
the next batch is tried afresh (once there is space, it succeeds).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from raycolo.errors import ConfigError, StoreFull


class Journal:
    def __init__(self, path: Path, field: str):
        """``field``: the setting or flag that named the file (``sample_store``,
        ``--output``), which errors name."""
        self.path, self.field = Path(path), field
        try:
            self._file = open(self.path, "a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{field}: cannot write {self.path}: {exc.strerror}") from None
        self.acknowledged = self.path.stat().st_size   # bytes of acknowledged batches on disk

    def append(self, text: str, acknowledged: Optional[int] = None) -> None:
        """Persist ``text`` (whole lines) and fsync, or raise StoreFull with nothing of it kept.
        ``acknowledged``: the file's acknowledged bytes now, where other processes append
        to it too (under the caller's lock)."""
        if acknowledged is not None:
            self.acknowledged = acknowledged
        try:
            self._file.write(text)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            self._rollback()
            raise StoreFull(f"{self.field}: {self.path}: {exc.strerror or exc}; nothing was stored") from None
        self.acknowledged = self.path.stat().st_size

    def _rollback(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass                 # closing flushes the refused text: it fails again, and is dropped
        try:
            if self.path.stat().st_size > self.acknowledged:
                os.truncate(self.path, self.acknowledged)
        except OSError:
            pass                 # not writable: the next append fails the same way
        self._file = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()
