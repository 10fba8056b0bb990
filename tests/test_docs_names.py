"""Every code name the living docs cite in backticks resolves: a path exists, a dotted name imports.

The docs are README.md and docs/*.md. docs/perf/ is left out: its dated files record what the code was
called on the day, and renaming a module must not rewrite the history.

What counts as a cited name (anything else in backticks is prose, a command, a key or a value):

- a path: ``streamattn/serve/protocol.py``, ``kernels/*.cu``, or one relative to the package
  (``engine/grammar.py``), optionally with ``::name`` (``models/compiled.py::run_layer``);
- a dotted name whose first part is the package, one of its top-level modules or packages
  (``quant.weights.pack``, ``state.rewind``, ``streamattn.engine.grammar.GrammarError``), a module
  deeper down whose name is unique (``llvm_ir.load16``) or a class the package defines (``KVCache.head``, ``Tokenizer.apply_chat``); a call's arguments are dropped
  (``KVCache.head(m+1)`` is ``KVCache.head``).

A dotted name resolves when the longest importable module prefix, tried with and without
``streamattn.``, has the rest as attributes. Modules are imported, nothing is called, so no kernel is
compiled.
"""
from __future__ import annotations

import ast
import importlib
import re
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "streamattn"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ROOTS = ("streamattn/", "tests/", "benchmarks/", "scripts/", "kernels/", "docs/")

SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[\w.*{},\-]+(/[\w.*{},\-]+)*/?(::[\w.]+)?$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def _top_level() -> set:
    """The package's top-level module and subpackage names (``state``, ``quant``, ...)."""
    names = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    return names | {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}


def _classes() -> tuple:
    """From the source (nothing imported): class name -> modules that define it at top level, and
    (class name, attribute) pairs that instances have but the class may not: ``self.x = ...`` in a
    method, or an annotated field (a dataclass field without a default is no class attribute)."""
    where: dict = {}
    fields: set = set()
    for path in PKG.rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module)
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                            and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        fields.add((node.name, sub.attr))
                fields.update((node.name, a.target.id) for a in node.body
                              if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name))
    return where, fields


def _submodules() -> dict:
    """A module's own name -> its dotted path, for modules below the top level whose name is unique
    (``llvm_ir.load16`` is ``streamattn.runtime.llvm_ir.load16``)."""
    seen: dict = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if len(parts) > 2 and parts[-1] != "__init__":
            seen.setdefault(parts[-1], []).append(".".join(parts))
    return {k: v[0] for k, v in seen.items() if len(v) == 1 and k not in GGUF_KEY_ROOTS}


#: Names of modules that are also the first part of GGUF metadata keys (``tokenizer.ggml.pre``,
#: ``gemma2.attn_logit_softcapping``, ``rope.dimension_count``): the docs cite the keys far more often.
GGUF_KEY_ROOTS = {"tokenizer", "rope", "llama", "gemma2", "gemma3", "phi3", "qwen2", "qwen3"}


TOP, SUB = _top_level(), _submodules()
CLASSES, FIELDS = _classes()


@lru_cache(maxsize=None)
def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _resolves(dotted: str) -> bool:
    """``dotted`` as module prefix + attributes, with and without the ``streamattn.`` prefix."""
    parts = dotted.split(".")
    for prefix in ("streamattn.", ""):
        for i in range(len(parts), 0, -1):
            module = _import(prefix + ".".join(parts[:i]))
            if module is None:
                continue
            obj = module
            for attr in parts[i:]:
                obj = getattr(obj, attr, _MISSING)
                if obj is _MISSING:
                    break
            else:
                return True
            break                                  # the longest module prefix decides
    return False


_MISSING = object()


def _check_path(span: str) -> str | None:
    """None if ``span`` names an existing file (and its ``::name``), else why not."""
    path, _, name = span.partition("::")
    bases = [REPO] if path.startswith(ROOTS) else [PKG, REPO]
    hits = [f for base in bases for f in base.glob(path.rstrip("/"))] if any(c in path for c in "*{") \
        else [base / path for base in bases if (base / path).exists()]
    if "{" in path:                                  # out/bench/bench.{json,png}: a brace list, not globbed
        return None
    if not hits:
        return "no such file"
    if name:
        f = hits[0]
        if f.suffix == ".py" and f.is_relative_to(PKG):
            module = ".".join(f.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            if not _resolves(f"{module}.{name}"):
                return f"{name} not in {module}"
        elif not re.search(rf"^\s*(def|class)\s+{re.escape(name.split('.')[0])}\b|^{re.escape(name)}\s*=",
                           f.read_text(errors="replace"), re.M):
            return f"{name} not defined in {f.relative_to(REPO)}"
    return None


def _check(span: str) -> str | None:
    """None if ``span`` is not a code name or resolves; else why it does not."""
    span = span.strip()
    if " " in span or span.startswith("."):           # prose, a command, a call with arguments, ./local
        return None
    if "/" in span and PATH.match(span) and (span.startswith(ROOTS) or (PKG / span.split("/")[0]).exists()):
        return _check_path(span)
    name = re.sub(r"\(.*\)$", "", span).removesuffix("()")
    if not DOTTED.match(name) or name.endswith(".py"):    # llama.py alone: a file named in its context
        return None
    first = name.split(".")[0]
    if first == "streamattn" or first in TOP:
        return None if _resolves(name) else "does not resolve"
    if first in SUB:
        return None if _resolves(SUB[first] + name[len(first):]) else f"does not resolve in {SUB[first]}"
    if first in CLASSES:
        rest = name.split(".", 1)[1]
        if (first, rest) in FIELDS:
            return None
        return None if any(_resolves(f"{m}.{name}") for m in CLASSES[first]) else \
            f"{rest} not on {first} ({', '.join(CLASSES[first])})"
    return None


def cited_names(text: str):
    for m in SPAN.finditer(text):
        yield m.group(1)


def dangling(paths=DOCS) -> list:
    bad = []
    for doc in paths:
        for span in cited_names(doc.read_text()):
            why = _check(span)
            if why:
                bad.append(f"{doc.relative_to(REPO)}: `{span}`: {why}")
    return bad


def test_every_cited_name_resolves():
    assert dangling() == []


def test_a_wrong_name_is_caught(tmp_path):
    """Planted wrong names are reported; right ones, prose and commands are not."""
    doc = tmp_path / "x.md"
    doc.write_text("`state.rewind` `streamattn/kv/cache.py` `state.no_such_function` `engine/no_such.py` "
                   "`KVCache.no_such_method` `models/compiled.py::no_such` `str.format` `--threads 2`\n")
    found = [span for span in cited_names(doc.read_text()) if _check(span)]
    assert found == ["state.no_such_function", "engine/no_such.py", "KVCache.no_such_method",
                     "models/compiled.py::no_such"]
