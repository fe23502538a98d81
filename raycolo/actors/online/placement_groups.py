"""The placement groups of a deployment's worker groups, remembered on disk.

Ray removes a placement group with the job that created it, not with the actor; a
controller that restarts reads this file to release the groups of dead worker groups.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


class PlacementGroups:
    """Node -> the placement group holding its stage workers, in ``path`` (JSON)."""

    def __init__(self, path: Path, errors: list[str]):
        self.path, self.errors = path, errors

    def note(self, node: int, group: Optional[str]) -> None:
        """Remember (on disk: a restarted controller reads it) the placement group that
        holds node ``node``'s stage workers."""
        if not group:
            return
        path = self.path
        held = json.loads(path.read_text()) if path.exists() else {}
        if held.get(str(node)) != group:
            held[str(node)] = group
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(held))
            tmp.replace(path)

    def release(self, nodes=None) -> None:
        """Remove the placement groups of worker groups whose Ray Train controller died.
        Ray removes a placement group with the job that created it, not with the actor, and
        Ray Train's own cleaner needs the dashboard's state API; without this, their GPUs
        stay reserved and a new run of the node never starts."""
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

        path = self.path
        if not path.exists():
            return
        held = json.loads(path.read_text())
        for node, group in list(held.items()):
            if nodes is not None and int(node) not in nodes:
                continue
            pg = PlacementGroup(PlacementGroupID(bytes.fromhex(group)))
            if placement_group_table(pg).get("state") not in (None, "REMOVED"):
                remove_placement_group(pg)
                self.errors.append(f"node {node}: released the placement group {group[:12]} of a dead worker group")
            del held[node]
        path.write_text(json.dumps(held))
