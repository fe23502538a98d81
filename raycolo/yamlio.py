"""Reading a YAML file that a person wrote: every way it can be wrong is one line that
names the file (missing, unreadable, not UTF-8, not YAML, nested too deeply)."""
from __future__ import annotations

from pathlib import Path

import yaml

from raycolo.errors import ConfigError


def load_yaml(path: str | Path):
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
