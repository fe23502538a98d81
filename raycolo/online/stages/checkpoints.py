"""A node's newest committed adapter checkpoint, read from its Ray Train run directory.

Ray Train rewrites ``checkpoint_manager_snapshot.json`` in the run's directory at each
commit; its ``latest_checkpoint_result`` names the newest committed checkpoint's
directory and the metrics reported with it (``adapter_version``). Stage s's part of the
adapter is ``stage-<s>.safetensors`` there; stage 0 also saved the sample sequence
numbers that version was trained on (``held.json``, as ``[start, end)`` runs) and the
store cursor (``cursor.json``).

Read by the controller (what a node that is not back yet still holds) and by the stage
workers (a group that outlived its controller rolls back to it before it registers with
the new one). Pure: files only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SNAPSHOT = "checkpoint_manager_snapshot.json"


@dataclass(frozen=True)
class CommittedCheckpoint:
    version: int                    # the adapter version saved
    directory: str                  # the checkpoint's directory (stage-<s>.safetensors, ...)
    held: list                      # [start, end) runs of the samples it was trained on
    cursor: Optional[dict]          # the store cursor saved with it (raycolo.online.samples.Cursor)

    def stage_weights(self, stage: int) -> str:
        return str(Path(self.directory) / f"stage-{stage}.safetensors")


def newest_committed(run_dir: str) -> Optional[CommittedCheckpoint]:
    """The newest checkpoint Ray Train committed in ``run_dir``, or None (none yet, or the
    snapshot caught mid-rewrite)."""
    run = Path(run_dir)
    try:
        latest = json.loads((run / SNAPSHOT).read_text())["latest_checkpoint_result"]
        found = run / latest["checkpoint_dir_name"]
        version = int(latest["metrics"]["adapter_version"])
        held = json.loads((found / "held.json").read_text()) if (found / "held.json").exists() else []
        cursor = json.loads((found / "cursor.json").read_text()) if (found / "cursor.json").exists() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return CommittedCheckpoint(version, str(found), held, cursor)
