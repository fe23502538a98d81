"""Shared matplotlib plumbing: a headless backend and one way to write a figure."""
from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: servers and CI have no display
    import matplotlib.pyplot as plt
    return plt


IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".eps", ".ps", ".tif", ".tiff")


def save_figure(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
