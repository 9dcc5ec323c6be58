"""The house's structure (issue 48), drawn from its imports: no import circles — counting the imports made inside
functions too, which hide a circle without removing it — and no module grown past what one reader holds."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flashdraft"
LONGEST = 550  # lines: ~500, and a little room; a module past it is split along its seam


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports() -> dict[str, set[str]]:
    """module → the flashdraft modules it imports anywhere in its body."""
    mods = modules()
    graph = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    graph[name].add(target if target in mods else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names)
        graph[name] = {t for t in graph[name] if t in mods and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_house_has_no_import_circles():
    graph = imports()
    assert graph["flashdraft.artifact.ownership"] and graph["flashdraft.train.data"]  # the drawing sees imports
    assert circles(graph) == []


def test_the_drawing_finds_a_circle_when_there_is_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_outgrows_one_reader():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > LONGEST}
    assert long == {}


def test_each_package_is_a_face_and_its_stage_lives_in_a_named_module():
    """A package's __init__ says what it offers in a few lines; the run is in a module named for it."""
    faces = {path: len(path.read_text().splitlines()) for path in PACKAGE.rglob("__init__.py")}
    assert faces and {str(path.relative_to(PACKAGE)): n for path, n in faces.items() if n >= 40} == {}
    for stage in ("generate", "tokenize", "train", "evaluate"):
        assert (PACKAGE / stage / "stage.py").is_file()


def test_no_import_runs_back_up_to_a_package_that_holds_the_module():
    """A module never imports its own package's face (which imports the module: a circle the drawing would hide
    behind the package's name)."""
    graph = imports()
    # the root's face (flashdraft/__init__.py: __version__) imports nothing, so reading it closes no circle
    upward = {name: sorted(t for t in targets if name.startswith(t + ".") and graph[t])
              for name, targets in graph.items()}
    assert {name: up for name, up in upward.items() if up} == {}


def test_test_machinery_is_not_in_the_product():
    """SeaweedFS, stand-in servers and forwarders live in tests/servers.py: no product module imports tests."""
    assert not (PACKAGE / "testing.py").exists()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            assert not any(name == "tests" or name.startswith("tests.") for name in names), path
