"""Numba's on-disk cache: the registry of cached kernel modules and the stale code it drops, saves shared
by several processes, and closures compiled in several copies (streamattn/runtime/kernel_cache.py)."""

import ast
import importlib
import multiprocessing
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import streamattn  # noqa: F401  (applies lock_cache_saves)
from streamattn.runtime import kernel_cache
from streamattn.runtime.kernel_cache import lock_cache_saves
from test_layout import ROOT, graph, modules

#: Modules with ``cache=True`` kernels that may not register yet, each with why. The test fails once one
#: registers, so that its entry goes.
NOT_YET: dict = {}


def _cached_kernel_modules() -> set:
    """Dotted names of the package's modules that jit anything with ``cache=True`` (read from the source,
    so a new kernel module is found without being listed)."""
    found = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.keyword) and node.arg == "cache" and \
                    isinstance(node.value, ast.Constant) and node.value.value is True:
                found.add(name)
                break
    return found


def test_every_cached_kernel_module_is_registered():
    """A module whose kernels are cached but that never registers keeps running its old machine code
    after a file it inlines changes: every one must call kernel_cache.register on import."""
    found = _cached_kernel_modules()
    assert {"streamattn.kv.backends.cpu", "streamattn.quant.matmul", "streamattn.models.compiled"} <= found
    for name in sorted(found):
        importlib.import_module(name)
    registered = set(kernel_cache.registered())
    assert found - registered == set(NOT_YET)
    assert registered <= found                     # (nothing registers without cached kernels)


#: Numba's names for making compiled code: a module that uses one holds code a kernel may take in.
COMPILERS = {"njit", "jit", "intrinsic", "overload", "overload_method", "register_jitable"}


def _kernel_code(path: Path) -> bool:
    """Whether a module holds code Numba compiles: jitted functions, intrinsics or overloads."""
    return any(isinstance(node, ast.Name) and node.id in COMPILERS or
               isinstance(node, ast.Attribute) and node.attr in COMPILERS
               for node in ast.walk(ast.parse(path.read_text(), str(path))))


def test_registered_dependencies_cover_the_kernel_code_each_module_imports():
    """A registered module's sources take in every module of compiled code it imports, and what the
    unregistered ones among those (the LLVM-IR helpers) import in turn: a dependency left out of
    ``depends_on`` would not drop the cache when it changes."""
    mods, imports = modules(), graph()
    kernel = {n for n, p in mods.items() if _kernel_code(p)}
    assert {"streamattn.kv.backends.cpu_simd", "streamattn.quant.kernels", "streamattn.kv.storage"} <= kernel
    for name in sorted(_cached_kernel_modules()):
        importlib.import_module(name)
    registered = kernel_cache.registered()
    for name, entry in registered.items():
        need, todo = set(), set(imports[name]) & kernel
        while todo:
            dep = todo.pop()
            if dep not in need:
                need.add(dep)
                if dep not in registered:
                    todo |= imports[dep] & kernel
        missing = {d for d in need if str(mods[d].resolve()) not in entry.sources}
        assert not missing, f"{name} imports compiled code its registration leaves out: {sorted(missing)}"


#: Names of Numba's caching internals: no module but kernel_cache.py may use them.
NUMBA_CACHE_NAMES = {"_cache", "_cache_path", "_cache_file", "_index_path", "_index_name", "caching",
                     "IndexDataCacheFile", "FunctionCache", "CacheImpl", "get_cache_path", "cache_path"}


def _numba_cache_uses(path: Path) -> list:
    """Lines of ``path`` that import numba.core.caching or read one of NUMBA_CACHE_NAMES off anything but
    ``self`` (a class's own ``self._cache`` is its own)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("numba"):
            if "caching" in node.module or any(a.name in NUMBA_CACHE_NAMES for a in node.names):
                hits.append(node.lineno)
        elif isinstance(node, ast.Import) and any("caching" in a.name for a in node.names):
            hits.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in NUMBA_CACHE_NAMES and \
                not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            hits.append(node.lineno)
    return hits


def test_only_kernel_cache_touches_numbas_caching_internals(tmp_path):
    """Numba's cache paths and files are private to it and move between versions: one module adapts to
    them, so a Numba upgrade is mended in one place."""
    uses = {name: lines for name, path in modules().items()
            if name != "streamattn.runtime.kernel_cache" and (lines := _numba_cache_uses(path))}
    assert not uses, f"Numba's caching internals used outside kernel_cache.py (module: lines): {uses}"
    assert _numba_cache_uses(ROOT / "runtime" / "kernel_cache.py")         # (the scan sees them where they are)
    probe = tmp_path / "probe.py"
    probe.write_text("import numba.core.caching\nf = g._cache._cache_path\nh = self._cache.get(1)\n")
    assert _numba_cache_uses(probe) == [1, 2, 2]


def _numba_private_imports(path: Path) -> list:
    """Lines of ``path`` that import a private name of Numba's (a name or module path part with a leading
    underscore: ``from numba.np.ufunc.parallel import _iget_num_threads``, ``import numba._helperlib``)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "numba":
            if any(p.startswith("_") for p in node.module.split(".")) or \
                    any(a.name.startswith("_") for a in node.names):
                hits.append(node.lineno)
        elif isinstance(node, ast.Import) and any(
                a.name.split(".")[0] == "numba" and any(p.startswith("_") for p in a.name.split("."))
                for a in node.names):
            hits.append(node.lineno)
    return hits


def test_only_runtime_imports_numbas_private_names(tmp_path):
    """Numba's private names move between versions: runtime/ adapts to them (with a fallback where one
    moved), so a Numba upgrade cannot break the import of the rest (issue 54)."""
    uses = {name: lines for name, path in modules().items()
            if not name.startswith("streamattn.runtime.") and (lines := _numba_private_imports(path))}
    assert not uses, f"Numba's private names imported outside runtime/ (module: lines): {uses}"
    assert _numba_private_imports(ROOT / "runtime" / "threads.py")          # (the scan sees them where they are)
    probe = tmp_path / "probe.py"
    probe.write_text("from numba.np.ufunc.parallel import _iget_num_threads\nimport numba._helperlib\n"
                     "from numba import njit, prange\nimport numba.np.ufunc\n")
    assert _numba_private_imports(probe) == [1, 2]


def _fake_module(monkeypatch, path: Path, text: str):
    """A module named after ``path``'s stem, its source ``text`` written there, in sys.modules."""
    path.write_text(text)
    mod = types.ModuleType(path.stem)
    mod.__file__ = str(path)
    monkeypatch.setitem(sys.modules, path.stem, mod)
    return mod


def _cache_files(directory: Path, *names):
    """Empty stand-ins for Numba's index and data files of the functions ``names`` (``module.qualname``)."""
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}"
    for name in names:
        (directory / f"{name}-3.{tag}.nbi").write_bytes(b"")
        (directory / f"{name}-3.{tag}.1.nbc").write_bytes(b"")


def _left(directory: Path) -> set:
    return {f.name.split("-")[0] for f in directory.glob("*.nb[ic]")}


def test_a_changed_dependency_drops_its_dependents_cached_code(monkeypatch, tmp_path):
    """ir_helper (IR, not cached) <- kernels_a (registered) <- kernels_b (registered, and it compiles
    layer_c's function): a change to ir_helper drops what kernels_a and kernels_b cached, layer_c's
    compiled function included, and nothing else; an unchanged stamp drops nothing."""
    monkeypatch.setattr(kernel_cache, "_REGISTRY", {})
    helper = _fake_module(monkeypatch, tmp_path / "ir_helper.py", "VERSION = 1\n")
    a = _fake_module(monkeypatch, tmp_path / "kernels_a.py", "# a\n")
    b = _fake_module(monkeypatch, tmp_path / "kernels_b.py", "# b\n")
    layer_c = tmp_path / "layer_c.py"
    layer_c.write_text("def decoder(x):\n    return x\n")
    scope = {}
    exec(compile(layer_c.read_text(), str(layer_c), "exec"), scope)
    directory = kernel_cache.cache_dir(layer_c)
    assert directory == kernel_cache.cache_dir(b.__file__)

    def register_all():
        kernel_cache.register("kernels_a", depends_on=[helper])
        return kernel_cache.register("kernels_b", depends_on=[a], compiles=[scope["decoder"]])

    everything = {"kernels_a.f", "kernels_b.g", "layer_c.decoder", "layer_c.other", "unrelated.h"}
    _cache_files(directory, *everything)
    entry = register_all()                               # no stamp yet: what was cached may be stale
    assert _left(directory) == {"layer_c.other", "unrelated.h"}
    assert entry.depends_on == ("kernels_a",)
    assert set(entry.sources) == {str(Path(m.__file__).resolve()) for m in (helper, a, b)}
    _cache_files(directory, *everything)
    assert register_all().stamp == entry.stamp           # same sources: the cache stays
    assert _left(directory) == everything
    (tmp_path / "ir_helper.py").write_text("VERSION = 2\n")
    assert register_all().stamp != entry.stamp
    assert _left(directory) == {"layer_c.other", "unrelated.h"}


def test_register_refuses_what_it_cannot_follow(monkeypatch, tmp_path):
    """A module that is not imported, a dependency given by name, a compiled function without a source
    file: each a clear error, and the registry as it was."""
    before = kernel_cache.registered()
    with pytest.raises(ValueError, match="module must name an imported module.*'no_such_module'"):
        kernel_cache.register("no_such_module")
    fake = _fake_module(monkeypatch, tmp_path / "kernels_d.py", "# d\n")
    with pytest.raises(TypeError, match="depends_on must hold imported modules.*'streamattn.kv.storage'"):
        kernel_cache.register(fake.__name__, depends_on=["streamattn.kv.storage"])
    with pytest.raises(TypeError, match="compiles must hold Python functions"):
        kernel_cache.register(fake.__name__, compiles=[len])
    assert kernel_cache.registered() == before


KERNEL = """
from numba import njit
import helper_ir
{register}

@njit(cache=True)
def f():
    return helper_ir.value()
"""


def _run_kernel(directory: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory), str(ROOT.parent)])}
    env.pop("NUMBA_CACHE_DIR", None)                   # (the cache beside the files, in tmp_path)
    code = "import kernel; print(kernel.f(), sum(kernel.f.stats.cache_hits.values()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=directory, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.parametrize("register", [False, True])
def test_numba_alone_runs_a_changed_helper_stale_and_the_registry_does_not(tmp_path, register):
    """The hazard, end to end in fresh processes: a cached kernel calls a helper from another file; after
    the helper changes, Numba loads the old machine code (the first case), unless the kernel's module
    registered the helper (the second), which compiles afresh once and then hits its cache again."""
    (tmp_path / "helper_ir.py").write_text("from numba import njit\n\n@njit\ndef value():\n    return 1\n")
    line = "from streamattn.runtime import kernel_cache\nkernel_cache.register(__name__, depends_on=[helper_ir])"
    (tmp_path / "kernel.py").write_text(KERNEL.format(register=line if register else ""))
    assert _run_kernel(tmp_path) == ["1", "0"]
    assert _run_kernel(tmp_path) == ["1", "1"]                  # (from the cache)
    (tmp_path / "helper_ir.py").write_text("from numba import njit\n\n@njit\ndef value():\n    return 2\n")
    assert _run_kernel(tmp_path) == (["2", "0"] if register else ["1", "1"])
    if register:
        assert _run_kernel(tmp_path) == ["2", "1"]

KEYS = 40


def _save_many(path, tag, start):
    from numba.core import caching
    assert lock_cache_saves() and caching.IndexDataCacheFile.save.locked_by_streamattn
    cache = caching.IndexDataCacheFile(path, "f", ("stamp", 1))
    start.wait()
    for i in range(KEYS):
        cache.save((tag, i), f"{tag}:{i}")


def _run_savers(path):
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(2)
    ps = [ctx.Process(target=_save_many, args=(str(path), tag, start)) for tag in "ab"]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
        assert p.exitcode == 0
    from numba.core import caching
    cache = caching.IndexDataCacheFile(str(path), "f", ("stamp", 1))
    return {(tag, i): cache.load((tag, i)) for tag in "ab" for i in range(KEYS)}


def test_saves_from_two_processes_keep_every_entry(tmp_path):
    """Two processes saving 40 entries each into one function's cache at once: every key loads back
    its own data (unlocked, they pick the same data-file numbers and overwrite each other)."""
    got = _run_savers(tmp_path)
    assert got == {(tag, i): f"{tag}:{i}" for tag in "ab" for i in range(KEYS)}
    assert (tmp_path / "f.nbi.lock").exists()


def _env_names(dispatcher):
    """The environment names of a dispatcher's compiled overloads, the per-process counter left out."""
    return {re.sub(r"B\d+v\d+", "", cres.fndesc.env_name) for cres in dispatcher.overloads.values()}


@pytest.mark.skipif(not __import__("streamattn.quant.matmul", fromlist=["HAVE_KERNELS"]).HAVE_KERNELS,
                    reason="the packed kernels need AVX2")
def test_copies_of_a_closure_have_their_own_environment_names():
    """The packed-matmul drivers of two weight kinds, serial and parallel, are copies of one closure
    with the same argument types: their compiled environments must be named apart, or a process that
    loads two of them compiled elsewhere at the same counter value reuses one's constants for both."""
    import gguf
    from gguf.quants import quantize

    from streamattn.models import compiled
    from streamattn.kv.backends import cpu
    from streamattn.quant.matmul import KernelPlan, qdrivers, qmatmul
    from streamattn.quant.weights import pack
    rng = np.random.default_rng(0)
    W = rng.standard_normal((32, 64)).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    plan = KernelPlan()
    names = []                      # per driver: its overloads' names (other tests may add signatures)
    for t in ("Q8_0", "Q4_0"):
        w = pack("w", t, quantize(W, getattr(gguf.GGMLQuantizationType, t)), W.shape)
        for parallel in (False, True):
            qmatmul(x, w, parallel=parallel, group_rows=plan.rows, vnni=plan.vnni, amx=plan.amx)
            names.append(_env_names(qdrivers(w.kind, w.group, plan.rows, w.lanes, plan.vnni, plan.amx)[parallel]))
    assert all(names) and sum(map(len, names)) == len(set().union(*names))
    quals = [f.py_func.__qualname__ for f in (compiled.stored_16, compiled.stored_16_parallel, compiled.stored_quantized,
                                              compiled.stored_quantized_parallel, cpu.attend_pages,
                                              cpu._attend_pages_serial)]
    assert len(set(quals)) == len(quals)
