"""``python -m raycolo.gpu_check`` (``make gpu-check``): see the package's docstring."""
import sys

from raycolo.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
