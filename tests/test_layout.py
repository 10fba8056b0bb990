"""The package's architecture, checked from its source: no import cycles, and the attention core imports
nothing above it.

Every module's AST is read (never imported): all imports count, function-local ones included, since an
import hidden in a function is still a dependency, and so do lazy ones by name (``importlib.import_module``
or ``__import__`` of a string literal). A name built at run time (an f-string) cannot be followed: the
package has none but one plug-in point (:func:`test_every_import_names_its_module`).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "streamattn"
#: The rooms above the attention core (kv/ and runtime/): packed weights, model files,
#: text, the forward pass, the decode engine, and the tools and entry points built on them.
UPPER = ("streamattn.quant", "streamattn.gguf", "streamattn.text", "streamattn.models", "streamattn.engine",
         "streamattn.bench", "streamattn.serve", "streamattn.scale", "streamattn.cli")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict:
    """{module name: path} of every .py file of the package at ``root``."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _lazy_import(node):
    """The module a call ``importlib.import_module(...)`` / ``import_module(...)`` / ``__import__(...)``
    names: its first argument, a str constant or an f-string (returned as an ast node then), else None."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return arg


def imports(name: str, path: Path, known, prefix: str = "streamattn") -> set:
    """Modules of the package ``prefix`` that ``name`` imports anywhere in its source (``from X import y``
    counts as X.y when that is a module, else X; a lazy import by a string literal counts too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(mod := _lazy_import(node), str):
            found.add(mod)
        elif isinstance(node, ast.Import):
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
    return {m for m in found if m == prefix or m.startswith(prefix + ".")} - {name}


def graph(root: Path = ROOT) -> dict:
    mods = modules(root)
    return {n: imports(n, p, mods, root.name) for n, p in mods.items()}


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
    assert "streamattn.kv.backends.gpu" in g["streamattn.kv.cache"]            # function-local: device="auto"
    assert "streamattn.kv.storage" in g["streamattn.kv.backends"]              # relative, two levels
    assert "streamattn.kv.state" not in g["streamattn.kv.cache"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _package(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_planted_circle_through_lazy_imports_is_found(tmp_path):
    """A circle closed only by function-local and lazy imports (by name, which an import statement scan
    would miss) is still a circle."""
    pkg = _package(tmp_path / "planted", {
        "__init__.py": "",
        "a.py": "from planted import b\n",
        "b.py": "def f():\n    from . import c\n    return c\n",
        "c.py": "import importlib\n\ndef g():\n    return importlib.import_module('planted.d')\n",
        "d.py": "def h():\n    return __import__('planted.a')\n",
    })
    g = graph(pkg)
    assert g["planted.c"] == {"planted.d"} and g["planted.d"] == {"planted.a"}
    assert find_cycle(g) == ["planted.a", "planted.b", "planted.c", "planted.d", "planted.a"]
    (pkg / "d.py").write_text("def h():\n    return None\n")
    assert find_cycle(graph(pkg)) is None


#: Imports by a name the caller gives, on purpose: a Ray Serve replica builds the app its deployment names
#: ("module:function"; streamattn.serve's by default, which ray_serve also imports by name).
CALLER_NAMED = {"streamattn.scale.ray_serve"}


def test_every_import_names_its_module():
    """No lazy import by a name built at run time (the graph could not see where it leads), except where
    the caller names the module (:data:`CALLER_NAMED`)."""
    built = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(_lazy_import(node), ast.AST):
                built.add(name)
    assert built == CALLER_NAMED
    assert "streamattn.serve" in graph()["streamattn.scale.ray_serve"]


def test_no_import_cycle_among_streamattn_modules():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_attention_core_imports_no_upper_layer():
    """The attention core (kv/, runtime/) knows nothing of packed weights, model files,
    text, models, the decode engine, tooling, serving or the CLI."""
    bad = {n: sorted(m for m in deps if m.startswith(UPPER))
           for n, deps in graph().items()
           if not n.startswith(UPPER) and n != "streamattn.cli"}
    assert {n: d for n, d in bad.items() if d} == {}


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


def package_graph(g: dict) -> dict:
    """``g`` with each module replaced by its room: the subpackage it sits in (``streamattn.gguf``), or
    itself for a top-level module; imports within a room dropped."""
    room = lambda n: ".".join(n.split(".")[:2])                  # noqa: E731
    out: dict = {}
    for n, deps in g.items():
        out.setdefault(room(n), set()).update(room(m) for m in deps if room(m) != room(n))
    return out


def test_no_import_cycle_among_packages():
    """Rooms import one way: two packages whose modules import each other (no module cycle, yet a
    package cycle: ``gguf.loader`` -> ``models.config`` -> ``gguf.metadata``) make one room of two."""
    assert find_cycle(package_graph({"p.a.x": {"p.b.y"}, "p.b.z": {"p.a.w"}, "p.a.w": set(), "p.b.y": set()}))
    cycle = find_cycle(package_graph(graph()))
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


def test_runtime_imports_no_other_room():
    """runtime/ is the floor: every room may use it, so it uses none of them."""
    bad = {n: sorted(m for m in deps if not m.startswith("streamattn.runtime"))
           for n, deps in graph().items() if n.startswith("streamattn.runtime")}
    assert {n: d for n, d in bad.items() if d} == {}


def test_the_top_level_holds_rooms_not_loose_modules():
    """Beside the rooms, the package's top level has only its front door and the CLI."""
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert loose == ["__init__.py", "cli.py"]
    assert {"kv", "runtime"} <= {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
