"""The suite's two lanes. `make test` runs pytest-xdist with ``-n 2 --dist loadscope``: two
worker processes, each running its lane's modules one after another (tests/conftest.py
makes a lane xdist's unit of work).

- ``deployments``: the modules that start a raycolo deployment (Ray Serve and/or Ray
  Train stage groups on a local cluster of their own: about a minute of CPU per start).
- ``in-process``: every other module: in-process tests, the offline runtime's local
  clusters, CLI runs.

A package whose fixture is package-scoped goes to one lane whole, so its deployment starts
once. Both lanes may hold a Ray cluster at the same time: a test that asks Ray's state API
names its own cluster's address, and nothing runs ``ray stop`` (it kills every cluster on
the machine). tests/project/test_layout.py checks that every module starting a deployment
is listed here.
"""
from __future__ import annotations

DEPLOYMENTS, IN_PROCESS = "deployments", "in-process"
DEPLOYMENT_LANE = ("tests/online/test_online_live.py", "tests/online/test_online_multinode.py",
                   "tests/online/test_online_faults.py", "tests/online/test_online_elastic.py",
                   "tests/serve/checkpoints/", "tests/serve/deployment/", "tests/serve/test_serve_adapters.py",
                   "tests/serve/test_serve_run.py", "tests/serve/test_serve_demo.py")


def lane_of(relpath: str) -> str:
    """The lane of the test module at ``relpath`` (a POSIX path from the repository root)."""
    return DEPLOYMENTS if relpath.startswith(DEPLOYMENT_LANE) else IN_PROCESS
