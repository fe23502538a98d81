"""The ``raycolo`` command. It sits above the pure core and the Ray actors and wires them:
parser and offline commands (:mod:`.main`), online commands (:mod:`.online`), option models
(:mod:`.options`), flags generated from config fields (:mod:`.flags`)."""
from raycolo.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
