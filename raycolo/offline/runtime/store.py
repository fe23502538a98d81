"""Where a run's outputs live: an append-only journal, then one parquet table.

Every finished request is appended to ``outputs.jsonl`` and fsynced *before* the
controller passes it downstream or counts it done, so a stopped or crashed job loses
nothing it has acknowledged. A resubmitted job with the same output directory reads the
journal back and skips those requests. ``manifest.json`` fingerprints the application,
its input and the seed: resuming into a directory written by a different job is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Optional

from raycolo.errors import ConfigError, StoreFull
from raycolo.journal import Journal

JOURNAL = "outputs.jsonl"
TABLE = "outputs.parquet"
MANIFEST = "manifest.json"


def fingerprint(*parts: object) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else json.dumps(part, sort_keys=True, default=str).encode()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:16]


class OutputStore:
    def __init__(self, out_dir: str | Path, job_fingerprint: str, description: Optional[dict] = None):
        self.dir = Path(out_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--output: cannot create {self.dir}: {exc.strerror}") from None
        if not os.access(self.dir, os.W_OK):
            raise ConfigError(f"--output: {self.dir} is not writable")
        manifest = self.dir / MANIFEST
        if manifest.exists():
            try:
                earlier = json.loads(manifest.read_text())
            except (OSError, json.JSONDecodeError):
                raise ConfigError(f"--output: {manifest} is unreadable; use a new directory") from None
            if earlier.get("fingerprint") != job_fingerprint:
                raise ConfigError(f"--output: {self.dir} holds outputs of a different job "
                                  f"(application, input or seed differ); use a new directory")
        else:
            manifest.write_text(json.dumps({"fingerprint": job_fingerprint, **(description or {})},
                                           indent=2, default=str))
        self.journal_path = self.dir / JOURNAL
        self.done: dict[str, dict] = {}
        if self.journal_path.exists():
            lines = self.journal_path.read_bytes().split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash mid-write: that request runs again
                self.done[record["key"]] = record
            if lines and lines[-1].strip():  # an unterminated last line: end it cleanly
                with open(self.journal_path, "ab") as f:
                    f.write(b"\n")
        self._journal = Journal(self.journal_path, "--output")

    def append(self, records: Iterable[dict]) -> None:
        """Persist finished requests (fsynced) before anything counts them done. A full or
        read-only disk raises StoreFull: none of ``records`` is kept, everything before
        them is, and the same job run again with the same output directory goes on from
        there."""
        records = list(records)
        if not records:
            return
        for record in records:
            if record["key"] in self.done:
                raise RuntimeError(f"request {record['key']} would be written twice")
        try:
            self._journal.append("".join(json.dumps(r, default=float) + "\n" for r in records))
        except StoreFull as exc:
            raise StoreFull(f"{exc} ({len(self.done)} outputs kept in {self.dir}: free space and run the "
                            f"same job with the same output directory to go on)") from None
        for record in records:
            self.done[record["key"]] = record

    def write_table(self) -> Path:
        import pandas as pd

        frame = pd.DataFrame(list(self.done.values()))
        if len(frame):
            frame = frame.sort_values(["node", "index"], kind="stable").reset_index(drop=True)
        path = self.dir / TABLE
        frame.to_parquet(path, index=False)
        return path

    def close(self) -> None:
        self._journal.close()
