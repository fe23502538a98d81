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


def _controller_classes() -> tuple[dict[str, ast.ClassDef], dict[str, ast.ClassDef]]:
    """The online controller's own classes (ControllerState, OnlineController) and its
    roles: each class in actors/online built with the controller (``__init__(self, ctl)``),
    by the attribute the controller keeps it in (its ``ROLES``)."""
    classes = {node.name: node for path in (PKG / "actors" / "online").glob("*.py")
               for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
    tie = {name: classes[name] for name in ("ControllerState", "OnlineController")}
    tree = ast.parse((PKG / "actors" / "online" / "controller.py").read_text())
    table = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "ROLES")
    roles = {k.value: classes[v.id] for k, v in zip(table.keys, table.values)}
    return tie, roles


def _chain(node) -> list[str]:
    """``self.a.b.c`` -> ["a", "b", "c"]; [] for anything not rooted at ``self``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return parts[::-1] if isinstance(node, ast.Name) and node.id == "self" else []


def _writes(cls: ast.ClassDef):
    """Each attribute chain under ``self`` that ``cls`` assigns, item-assigns, deletes or
    changes in place (MUTATORS)."""
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            yield _chain(node)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            yield _chain(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            yield _chain(node.func.value)


def _members(cls: ast.ClassDef) -> set[str]:
    return {b.name for b in cls.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))} | \
        {c[0] for c in _writes(cls) if len(c) == 1} | \
        {b.target.id for b in cls.body if isinstance(b, ast.AnnAssign)}


def test_the_online_controllers_roles_are_objects_that_own_their_fields():
    """The online controller is made of role objects: each role is built with the controller
    (``ctl``), sets its fields and alone writes them; it reads another role's as
    ``self.ctl.<role>.<field>`` and asks it for a change through a method, and reads the
    controller's shared fields as ``self.ctl.<field>``. No role writes through ``self.ctl``,
    and the controller writes no role's fields. Every name read through ``self.ctl`` exists."""
    tie, roles = _controller_classes()
    assert len(roles) >= 8, sorted(roles)
    tie_members = set().union(*(_members(c) for c in tie.values())) | set(roles)
    wrong = []
    for attr, role in roles.items():
        if role.bases:
            wrong.append(f"{role.name} inherits {[ast.unparse(b) for b in role.bases]}: a role is an object")
        mine = _members(role)
        wrong += [f"{role.name} writes self.{'.'.join(c)}" for c in _writes(role) if c[:1] == ["ctl"] and len(c) > 1]
        for node in ast.walk(role):
            chain = _chain(node)
            if not chain:
                continue
            if chain[0] != "ctl":
                if chain[0] not in mine:
                    wrong.append(f"{role.name} reads self.{chain[0]}, which it never sets")
            elif len(chain) >= 2 and chain[1] not in tie_members:
                wrong.append(f"{role.name} reads self.ctl.{chain[1]}: no such field, method or role")
            elif len(chain) >= 3 and chain[1] in roles and chain[2] not in _members(roles[chain[1]]):
                wrong.append(f"{role.name} reads self.ctl.{chain[1]}.{chain[2]}: {roles[chain[1]].name} has none")
    for cls in tie.values():
        wrong += [f"{cls.name} writes self.{'.'.join(c)} of a role" for c in _writes(cls) if c[:1] and c[0] in roles
                  and len(c) > 1]
    assert not wrong, "\n".join(sorted(set(wrong)))
    # and the check can fail: every role owns something another role or the controller reads
    reads = {(c[1], c[2]) for cls in [*roles.values(), *tie.values()] for n in ast.walk(cls)
             if len(c := _chain(n)) >= 3 and c[0] == "ctl"} | \
        {(c[0], c[1]) for cls in tie.values() for n in ast.walk(cls) if len(c := _chain(n)) >= 2 and c[0] in roles}
    assert {r for r, _ in reads} >= set(roles), sorted(set(roles) - {r for r, _ in reads})


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
