"""Reading a YAML file that a person wrote: every way it can be wrong is one line that
names the file (missing, unreadable, not UTF-8, not YAML, nested too deeply)."""
from __future__ import annotations

from pathlib import Path

import yaml

from raycolo.errors import ConfigError

MAX_DEPTH = 100        # levels of [ ] and { } nesting (PyYAML takes seconds to fail at thousands)


def flow_depth(text: str) -> int:
    """The deepest nesting of flow brackets in ``text``, quoted strings and comments left out."""
    depth = deepest = 0
    quote = None
    comment = False
    for ch in text:
        if comment:
            comment = ch != "\n"
        elif quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            comment = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


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
    if ("[[" in text or "{{" in text or "[{" in text or "{[" in text) and flow_depth(text) > MAX_DEPTH:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply (more than {MAX_DEPTH} levels)")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
