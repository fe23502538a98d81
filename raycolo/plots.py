"""Shared matplotlib plumbing: a headless backend and one way to write a figure."""
from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: servers and CI have no display
    import matplotlib.pyplot as plt
    return plt


IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".eps", ".ps", ".tif", ".tiff")


def check_image_path(path: str, flag: str) -> None:
    """A plot path whose suffix names an image format this module writes (none: PNG), so a
    typo fails before any work with one line naming the flag."""
    from raycolo.errors import ConfigError

    suffix = Path(path).suffix.lower()
    if not path.strip() or "\x00" in path:
        raise ConfigError(f"{flag}: give a file name, e.g. out/plot.png")
    if suffix and suffix not in IMAGE_SUFFIXES:
        raise ConfigError(f"{flag}: '{suffix}' is not an image format; use one of "
                          + ", ".join(IMAGE_SUFFIXES))


def save_figure(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
