"""Paths users name: files a command reads, and where it will write, checked before any work.

A file to read that is missing, not a regular file or not even a usable name (too long,
a NUL) is one line naming it.

An output path that cannot be written (its directory missing and not creatable, a file
where a directory is promised, a directory where a file is, ``/proc``, a format the
writer does not know) fails with one line naming the flag, before the work whose result
would then be lost. Nothing is written by the check: it opens a temporary file in the
nearest directory that exists (deleted on close), which is what writing there needs.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

from raycolo.bounds import MAX_PATH_CHARS
from raycolo.errors import ConfigError


def check_output(path: str, flag: str, *, directory: bool = False, suffixes: Sequence[str] = (),
                 example: str = "out/result") -> Path:
    """``path`` as the flag ``flag`` will write it: a file (with one of ``suffixes``, none
    meaning the writer's default) or, with ``directory``, a directory that may exist."""
    if not path.strip() or "\x00" in path or len(path) > MAX_PATH_CHARS:
        raise ConfigError(f"{flag}: give a {'directory' if directory else 'file'} name, e.g. {example}")
    try:
        target = Path(path).expanduser()
    except RuntimeError as exc:      # ~unknown-user
        raise ConfigError(f"{flag}: not a usable path: {exc}") from None
    try:
        return _check(target, path, flag, directory, suffixes, example)
    except OSError as exc:          # a name too long for the file system, a loop of links...
        raise ConfigError(f"{flag}: not a usable path: {exc.strerror or exc}") from None


def _check(target: Path, path: str, flag: str, directory: bool, suffixes: Sequence[str], example: str) -> Path:
    if directory:
        if target.exists() and not target.is_dir():
            raise ConfigError(f"{flag}: {path} exists and is not a directory")
    else:
        if target.is_dir():
            raise ConfigError(f"{flag}: {path} is a directory; give a file name, e.g. {example}")
        suffix = target.suffix.lower()
        if suffixes and suffix and suffix not in suffixes:
            raise ConfigError(f"{flag}: '{suffix}' is not a format it writes; use one of " + ", ".join(suffixes))
    where = target if directory and target.is_dir() else target.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise ConfigError(f"{flag}: cannot write under {where}: not a directory")
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot write in {where}: {exc.strerror or exc}") from None
    if any(len(part) > 255 for part in target.parts):
        raise ConfigError(f"{flag}: a name in the path is longer than 255 characters")
    return target


def check_input(path, what: str) -> Path:
    """``path`` as a regular file to read (``what``: "trace file", "request file"...)."""
    text = str(path)
    if not text.strip() or "\x00" in text:
        raise ConfigError(f"{what}: give a file name")
    target = Path(path)
    try:
        exists, regular = target.exists(), target.is_file()
    except OSError as exc:          # a name too long for the file system...
        raise ConfigError(f"{text[:200]}: not a usable path for a {what}: {exc.strerror or exc}") from None
    if not exists:
        raise ConfigError(f"{target}: {what} not found")
    if not regular:
        raise ConfigError(f"{target}: {what} is not a regular file")
    return target


def is_dir(path) -> bool:
    """``Path(path).is_dir()``, False where the name is not even usable (too long, a NUL)."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False
