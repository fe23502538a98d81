"""The ``raycolo`` command. It sits above the pure core and the Ray actors and wires them:
parser and offline commands (:mod:`.main`), online commands (:mod:`.online`), option models
(:mod:`.options`), flags generated from config fields (:mod:`.flags`).

``main`` and ``build_parser`` are imported on first use, so ``python -m raycolo.cli.flags``
runs its module without the whole command loaded first."""
from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from raycolo.cli.main import main as run

    return run(argv)


def build_parser():
    from raycolo.cli.main import build_parser as build

    return build()


__all__ = ["build_parser", "main"]
