"""Errors meant for people: one line that names the offending field or file."""


class RaycoloError(ValueError):
    """Invalid user input. ``str(err)`` is the single line the CLI prints after ``error:``."""


class ConfigError(RaycoloError):
    """A config, graph or request file is invalid; the message names the field or file."""


class PlanningError(RaycoloError):
    """The planner cannot find any valid plan (e.g. a model fits on no GPU set)."""
