"""Errors meant for people: one line that names the offending field or file."""


class RaycoloError(ValueError):
    """Invalid user input. ``str(err)`` is the single line the CLI prints after ``error:``:
    a message built from a library's text (pandas, pyarrow) or from what the user typed is
    folded into one printable line here, whatever it held."""

    def __init__(self, message: object = "") -> None:
        super().__init__(one_line(message))


def one_line(text: object) -> str:
    """``text`` as one printable line: line breaks become spaces, other characters that
    do not print (control characters, separators) are shown escaped."""
    joined = " ".join(x for x in (line.strip() for line in str(text).split("\n")) if x)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in joined)


class ConfigError(RaycoloError):
    """A config, graph or request file is invalid; the message names the field or file."""


class PlanningError(RaycoloError):
    """The planner cannot find any valid plan (e.g. a model fits on no GPU set)."""


class StoreFull(OSError):
    """A store could not persist a batch (disk full, read-only): nothing of the batch is
    stored, so nothing of it is acknowledged. Raised by the online sample store and the
    offline output journal."""
