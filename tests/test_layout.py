"""The package's architecture, checked from its source: no import cycles, layers import downwards only,
no module over the size a reader can hold.

Every module's AST is read (never imported): all imports count, function-local ones included, since an
import hidden in a function is still a dependency.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "streamattn"
MAX_LINES = 400
UPPER = ("streamattn.models", "streamattn.engine", "streamattn.bench", "streamattn.serve", "streamattn.scale",
         "streamattn.cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    """{module name: path} of every .py file of the package."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(name: str, path: Path, known) -> set:
    """streamattn modules that ``name`` imports anywhere in its source (``from X import y`` counts as
    X.y when that is a module, else X)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
    return {m for m in found if m == "streamattn" or m.startswith("streamattn.")} - {name}


def graph() -> dict:
    mods = modules()
    return {n: imports(n, p, mods) for n, p in mods.items()}


def find_cycle(g: dict):
    """A list of modules forming a cycle in ``g``, or None (depth-first search)."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        state[n] = "done"
        stack.pop()
        return None
    for n in sorted(g):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_the_import_graph_sees_every_kind_of_import():
    g = graph()
    assert "streamattn.backends.gpu" in g["streamattn.cache"]            # function-local: device="auto"
    assert "streamattn.storage" in g["streamattn.backends"]              # relative, two levels
    assert "streamattn.state" not in g["streamattn.cache"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_streamattn_modules():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_engine_imports_no_upper_layer():
    """The engine (top-level modules and backends/) knows nothing of models, tooling, serving or the CLI."""
    bad = {n: sorted(m for m in deps if m.startswith(UPPER))
           for n, deps in graph().items()
           if not n.startswith(UPPER) and n != "streamattn.cli"}
    assert {n: d for n, d in bad.items() if d} == {}


@pytest.mark.parametrize("name,path", sorted(modules().items()))
def test_no_module_over_400_lines(name, path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT.parent)}: {lines} lines; split it by concern"


def test_design_references_point_into_the_repository():
    """Every "DESIGN.md §n" cited by code or docs is docs/DESIGN.md, and its section n exists."""
    import re
    repo = ROOT.parent
    design = (repo / "docs" / "DESIGN.md").read_text()
    sections = set(re.findall(r"^## (\d+)\.", design, re.M))
    bad = []
    for path in [*repo.glob("streamattn/**/*.py"), *repo.glob("tests/**/*.py"), *repo.glob("scripts/*"),
                 *repo.glob("benchmarks/*.py"), *repo.glob("kernels/*"), *repo.glob("*.md")]:
        if path.is_file() and path.suffix not in (".so", ".o"):
            if path.name == "test_layout.py":
                continue
            for m in re.finditer(r"(\S*)DESIGN\.md((?:,?\s*§\s*\d+)+)", path.read_text(errors="replace")):
                cited = re.findall(r"\d+", m.group(2))
                if not m.group(1).endswith("docs/") or not set(cited) <= sections:
                    bad.append(f"{path.relative_to(repo)}: {m.group(0)}")
    assert bad == [] and len(sections) >= 10, bad
