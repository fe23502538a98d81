"""Packaging checks: every subpackage (``raycolo.policies``, the offline policies, the engine
with its C kernels) and ``raycolo.catalog`` with its package data must import from an
installed copy, not only from the source tree.

These are real builds, no mocks: a regular (non-editable) ``pip install --target`` of the
project, and the editable install of the running test environment.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Things in the checkout that are not part of the source distribution, or that are
# build state (a stale build/ would leak files deleted from the source into the wheel).
_COPY_IGNORE = shutil.ignore_patterns(
    ".venv", ".venv-*", ".git", "build", "dist", "out", "*.egg-info", "__pycache__",
    ".pytest_cache", "*.pyc", "*.png",
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTHON") and k != "PIP_TARGET"}
    env.update(extra)
    return env


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (
        f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
        f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    )
    return proc.stdout


def _has_build_backend() -> bool:
    try:
        import setuptools  # noqa: F401
        import wheel  # noqa: F401
    except ImportError:
        return False
    return True


def test_regular_install_imports_policies_and_catalog(tmp_path):
    # Build from a clean copy of the tree, so the build neither writes build/ or
    # *.egg-info into the checkout nor picks up stale build output from it.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=_COPY_IGNORE)
    target = tmp_path / "site"
    # The build backend of the running environment when it has one (pyproject's
    # build-system: setuptools, wheel): an isolated build fetches them from the index
    # first, which took two of the suite's minutes.
    isolation = ["--no-build-isolation"] if _has_build_backend() else []
    _run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
          "--no-input", "--no-deps", *isolation,
          "--target", str(target), str(src)],
         cwd=tmp_path, env=_clean_env(), timeout=180)
    assert (target / "raycolo" / "policies" / "__init__.py").is_file()

    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    probe = textwrap.dedent("""
        import sys
        # The running interpreter may carry raycolo's editable install (a meta-path
        # finder from a .pth file); drop it so only the target-dir copy can be found.
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not getattr(f, "__module__", "").startswith("__editable__")]
        import raycolo, raycolo.catalog, raycolo.policies
        import raycolo.engine.executor, raycolo.engine.torch_engine  # every subpackage is installed
        from pathlib import Path
        names = raycolo.policies.policy_names()
        assert names, "no policies registered"
        policy_mods = sorted({m.__file__ for n, m in list(sys.modules.items())
                              if n.startswith("raycolo.offline.policies.")})
        spec = raycolo.catalog.get_model("tiny-llama-s")
        assert spec.name == "tiny-llama-s", spec
        ecdfs = list((Path(raycolo.__file__).parent / "data" / "ecdf").glob("*.csv"))
        assert ecdfs, "package data data/ecdf/*.csv not installed"
        kernels = list((Path(raycolo.__file__).parent / "engine" / "executor" / "kernels").glob("*.c"))
        assert kernels, "the executor's C kernels (engine/executor/kernels/*.c) not installed"
        for f in [raycolo.__file__, raycolo.catalog.__file__, raycolo.engine.executor.__file__, *policy_mods]:
            print("MOD", f)
        print("POLICIES", raycolo.policies.__file__)
    """)
    out = _run([sys.executable, "-c", probe], cwd=workdir,
               env=_clean_env(PYTHONPATH=str(target)), timeout=120)

    policies_file = [ln.split(" ", 1)[1] for ln in out.splitlines()
                     if ln.startswith("POLICIES ")]
    assert len(policies_file) == 1, out
    policies_path = Path(policies_file[0]).resolve()
    assert policies_path == (target / "raycolo" / "policies" / "__init__.py").resolve()
    assert REPO not in policies_path.parents

    modules = [Path(ln.split(" ", 1)[1]).resolve() for ln in out.splitlines()
               if ln.startswith("MOD ")]
    assert len(modules) >= 3, out  # raycolo, raycolo.catalog and at least one policy
    for mod in modules:
        assert target.resolve() in mod.parents, f"{mod} not loaded from the installed copy"


def test_editable_install_resolves_to_source_folder(tmp_path):
    # The test environment (make venv) holds raycolo as an editable install; from a
    # directory outside the checkout, raycolo.policies must resolve to <repo>/raycolo/policies.
    probe = textwrap.dedent("""
        import raycolo.catalog, raycolo.policies
        assert raycolo.policies.policy_names()
        print("POLICIES", raycolo.policies.__file__)
        print("CATALOG", raycolo.catalog.__file__)
    """)
    out = _run([sys.executable, "-c", probe], cwd=tmp_path, env=_clean_env(), timeout=120)
    found = dict(ln.split(" ", 1) for ln in out.splitlines()
                 if ln.startswith(("POLICIES ", "CATALOG ")))
    assert Path(found["POLICIES"]).resolve() == (REPO / "raycolo" / "policies" / "__init__.py").resolve()
    assert Path(found["CATALOG"]).resolve() == (REPO / "raycolo" / "catalog.py").resolve()
