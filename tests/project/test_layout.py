"""The layout's rules, checked on the source itself (docs/layout.md):

* no import cycles between raycolo's modules, counting the imports inside functions too
  (only ``if TYPE_CHECKING:`` blocks are left out: they never run);
* Ray is imported only under ``raycolo.actors`` (all Ray code) and ``raycolo.cli`` (which
  wires both halves); no other module imports either of them;
* the engine sits below both products: ``raycolo.engine`` imports neither
  ``raycolo.offline`` nor ``raycolo.online``, and those two do not import each other;
* no file over 500 lines and no class over 20 methods;
* every file docs/architecture.md and the README name by path exists;
* the tests mirror the package: tests/<cli|engine|offline|online|project|serve>/, helpers in
  tests/support/, no test module over 500 lines.

Imports are read with ``ast`` from every file, the way Python resolves them, and the
cycles are found by networkx (strongly connected components).
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "raycolo"
OUTER = ("raycolo.actors", "raycolo.cli")   # the only homes of Ray and of the wiring
MAX_LINES = 500
MAX_METHODS = 20


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _runtime_nodes(tree: ast.AST):
    """Every node that can run: all of them but the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every raycolo module (and 'ray') that ``name`` imports, wherever the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t == "ray" or t.startswith("ray."):
                found.add("ray")
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    for name, path in mods.items():
        g.add_node(name)
        for target in _imports(name, path, mods):
            g.add_edge(name, target)
    return g


def test_no_import_cycles_even_through_lazy_imports():
    g = _graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_ray_lives_only_in_actors_and_the_cli():
    g = _graph()
    leaks = sorted(f"{m} -> {t}" for m, t in g.edges
                   if not m.startswith(OUTER) and (t == "ray" or t.startswith(OUTER)))
    assert not leaks, f"pure modules importing Ray or the Ray package: {leaks}"
    # and the check can fail: the actors do import Ray
    assert any(t == "ray" for m, t in g.edges if m.startswith("raycolo.actors"))


PRODUCTS = ("raycolo.offline", "raycolo.online")
ABOVE_THE_ENGINE = PRODUCTS + OUTER + ("raycolo.gpu_check",)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_engine_sits_below_both_products():
    """``raycolo.engine`` imports neither product (nor Ray's packages, nor the GPU check that
    sits above both), and the two products do not import each other: every arrow between
    those layers points down."""
    g = _graph()
    up = sorted(f"{m} -> {t}" for m, t in g.edges
                if _within(m, "raycolo.engine") and any(_within(t, p) for p in ABOVE_THE_ENGINE))
    across = sorted(f"{m} -> {t}" for m, t in g.edges for a, b in (PRODUCTS, PRODUCTS[::-1])
                    if _within(m, a) and _within(t, b))
    assert not up, f"the engine imports above itself: {up}"
    assert not across, f"the products import each other: {across}"
    # and the check can fail: both products do import the engine
    assert all(any(_within(m, p) and _within(t, "raycolo.engine") for m, t in g.edges) for p in PRODUCTS)


def test_file_and_class_sizes():
    too_long, too_wide = [], []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > MAX_METHODS:
                    too_wide.append(f"{path.relative_to(REPO)}:{node.name}: {len(methods)} methods")
    assert not too_long and not too_wide, "\n".join(too_long + too_wide)


MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "add", "discard", "update",
            "setdefault"}


def _controller_roles() -> dict[str, ast.ClassDef]:
    """The online controller's classes: ControllerState (what every role reads, which the
    controller itself sets), OnlineController and each role over the state."""
    roles = {}
    for path in (PKG / "actors" / "online").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and (node.name in ("ControllerState", "OnlineController") or any(
                    getattr(b, "id", "") == "ControllerState" for b in node.bases)):
                roles[node.name] = node
    return roles


def _self_attr(node) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
        and node.value.id == "self" else None


def test_each_of_the_online_controllers_fields_has_one_owner():
    """Every field of the online controller is written by one role only: set in that role's
    own ``_<role>_init`` (or where the role starts), assigned, item-assigned or changed in
    place (``append``, ``pop``, ...) by it alone; another role asks it through a method.
    The controller's own fields (ControllerState, set by OnlineController) are what every
    role reads. Every field a role reads is someone's."""
    roles = _controller_roles()
    assert len(roles) >= 10, sorted(roles)
    tie = {"ControllerState", "OnlineController"}
    writers: dict[str, set] = {}
    members = {b.name for role in roles.values() for b in role.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))}
    declared = {n.target.id for n in roles["ControllerState"].body if isinstance(n, ast.AnnAssign)}
    for name, role in roles.items():
        for node in ast.walk(role):
            target = None
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                target = _self_attr(node)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                target = _self_attr(node.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                target = _self_attr(node.func.value)
            if target is not None and target not in members:
                writers.setdefault(target, set()).add(name)
    shared = sorted(f"self.{attr}: {sorted(w)}" for attr, w in writers.items() if len(w - tie) > 1
                    or (w - tie and w & tie and attr not in declared))
    assert not shared, f"fields written by more than one role: {shared}"
    known = set(writers) | declared
    unknown = sorted({f"{name}: self.{attr}" for name, role in roles.items() for n in ast.walk(role)
                      if (attr := _self_attr(n)) and attr not in known and attr not in members})
    assert not unknown, unknown
    # and the check can fail: each role owns something
    assert all(any(name in w for w in writers.values()) for name in roles if name not in tie)


TEST_FOLDERS = ("cli", "engine", "offline", "online", "project", "serve")   # tests/<folder>/, and support/


def test_the_tests_mirror_the_package():
    """Every test module sits in a folder of tests/ named for what it tests (a subfolder of
    one may share a fixture), the helpers and references in tests/support/, and no test
    module is over MAX_LINES lines."""
    tests = REPO / "tests"
    misplaced, too_long = [], []
    for path in tests.rglob("*.py"):
        rel = path.relative_to(tests)
        if path.name in ("conftest.py", "__init__.py"):
            continue
        if rel.parts[0] == "support":
            if path.name.startswith("test_"):
                misplaced.append(f"{rel}: a test module among the helpers")
            continue
        if len(rel.parts) < 2 or rel.parts[0] not in TEST_FOLDERS or not path.name.startswith("test_"):
            misplaced.append(str(rel))
        if path.read_text().count("\n") > MAX_LINES:
            too_long.append(f"{rel}: {path.read_text().count(chr(10))} lines")
    assert not misplaced and not too_long, "\n".join(misplaced + too_long)
    assert sum(1 for _ in tests.rglob("test_*.py")) > 50      # and the walk found them


PATH_IN_DOCS = r"(?<![\w/.-])((?:raycolo|bench|tests|tools|jobs|examples|docs)/[\w/.-]*\w\.(?:py|md|yaml|json|csv))"


def test_every_path_the_docs_name_exists():
    """docs/architecture.md and the README name files by their path from the repository's
    root (the request walks, the drawings, the tables): each exists."""
    import re

    named = set()
    for doc in (REPO / "docs" / "architecture.md", REPO / "README.md"):
        named |= set(re.findall(PATH_IN_DOCS, doc.read_text()))
    assert len(named) > 50
    assert not [p for p in sorted(named) if not (REPO / p).exists()]
