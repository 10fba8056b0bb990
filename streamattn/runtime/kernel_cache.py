"""Numba's on-disk kernel cache, and the only module that reaches into Numba's caching internals.

Numba keys a compiled function's cache files on its own source file only, not on the LLVM IR it inlines
nor on other compiled functions it calls: after such a file changes (a git pull, an edit), the cached
code would still run the old version. Every module that jits with ``cache=True`` therefore calls
:func:`register` once, naming what its compiled code takes in; the registry drops the module's cache
files once when a stamp of those sources changes (tests/test_kernel_cache.py checks that no such module
is left out).

:func:`variant` names each compiled copy of a closure apart; :func:`lock_cache_saves` makes the saves of
processes sharing a cache directory take turns."""

from __future__ import annotations

import hashlib
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:                 # not POSIX: saves stay unlocked
    fcntl = None


@dataclass(frozen=True)
class Registration:
    """What :func:`register` recorded for one module.

    Attributes
    ----------
    module : its dotted name
    depends_on : dotted names of the modules it named
    sources : every source file its cached code depends on: its own, those of ``depends_on`` and,
        for a registered dependency, that one's ``sources`` (sorted, absolute)
    stamp : sha256 of the sha256 of each of ``sources``' contents, hex; "" where one was unreadable
    """

    module: str
    depends_on: tuple
    sources: tuple
    stamp: str


_REGISTRY: dict[str, Registration] = {}


def register(module: str, depends_on=(), compiles=()) -> Registration:
    """Record that ``module`` (pass ``__name__``) holds ``cache=True`` kernels whose code takes in
    ``depends_on``, and delete its cached machine code if those sources changed since it was cached.

    Call it once per kernel module, before any of its kernels runs (after its imports is the place).

    Parameters
    ----------
    module : str
        The calling module's name; it must be imported (or being imported) and have a source file.
    depends_on : iterable of modules
        The modules whose code the module's compiled functions inline or call: LLVM-IR helper modules,
        other compiled modules, modules whose ``@overload`` it compiles. A registered dependency brings
        its own dependencies along, so only direct ones need naming.
    compiles : iterable of functions
        Python functions defined in another file that this module jits with ``cache=True``
        (``njit(cache=True)(layer.decoder_layer)``): Numba files their code under that other file, and
        it is dropped with this module's.

    Returns
    -------
    Registration
        Also kept for :func:`registered`. Registering a module again replaces its entry and checks again.

    What is dropped: every cache file of every function defined in the module's source file (closures
    made later included, as Numba names the files after the source file), and those of ``compiles``.
    The stamp lives beside them (``<module>.sources.sha256``). Where the cache directory is not
    writable, a source cannot be read, or Numba's internals moved, nothing is deleted (the cache then
    works as Numba has it).

    >>> from streamattn.runtime import kernel_cache                           # doctest: +SKIP
    >>> from streamattn.kv.backends import cpu_simd                           # doctest: +SKIP
    >>> kernel_cache.register(__name__, depends_on=[cpu_simd])                # doctest: +SKIP
    """
    path = _source_of(module)
    depends_on, compiles = tuple(depends_on), tuple(compiles)
    names = []
    for dep in depends_on:
        if not isinstance(dep, types.ModuleType) or not getattr(dep, "__file__", None):
            raise TypeError(f"depends_on must hold imported modules with a source file (got {dep!r} for "
                            f"{module}); pass the module object, e.g. depends_on=[cpu_simd]")
        names.append(dep.__name__)
    drops = [(path, f"{path.stem}.*.nb[ic]")]
    for fn in compiles:
        code = getattr(fn, "__code__", None)
        if code is None or not Path(code.co_filename).is_file():
            raise TypeError(f"compiles must hold Python functions defined in a source file (got {fn!r} for "
                            f"{module}); pass the function that is jitted, e.g. compiles=[layer.decoder_layer]")
        source = Path(code.co_filename).resolve()
        drops.append((source, f"{source.stem}.{fn.__qualname__}-*.nb[ic]".replace("<", "").replace(">", "")))
    sources = {path}
    for dep in depends_on:
        sources.add(Path(dep.__file__).resolve())
        if dep.__name__ in _REGISTRY:
            sources.update(Path(f) for f in _REGISTRY[dep.__name__].sources)
    sources = tuple(sorted(str(f) for f in sources))
    try:            # (per file, so that text moved from one file to the next changes the stamp)
        stamp = hashlib.sha256(b"".join(hashlib.sha256(Path(f).read_bytes()).digest()
                                        for f in sources)).hexdigest()
    except OSError:                          # a source not readable as a file (a zipped install)
        stamp = ""
    entry = Registration(module=module, depends_on=tuple(names), sources=sources, stamp=stamp)
    _REGISTRY[module] = entry
    if stamp:
        _drop_if_changed(f"{module}.sources.sha256", stamp, path, drops)
    return entry


def registered() -> dict:
    """{module name: :class:`Registration`} of every module registered in this process so far."""
    return dict(_REGISTRY)


def cache_dir(source) -> Path:
    """The directory where Numba caches the functions defined in the file ``source`` (as Numba chooses
    it: ``NUMBA_CACHE_DIR``, else ``__pycache__`` beside the file, else a user-wide directory).
    OSError if Numba has none for it."""
    stand_in = types.FunctionType((lambda: None).__code__.replace(co_filename=str(source)), {})
    try:
        from numba.core import caching
        return Path(caching.FunctionCache(stand_in).cache_path)
    except (ImportError, AttributeError, RuntimeError) as e:   # numba's internals moved, or no locator
        raise OSError(f"Numba has no cache directory for {source}: {e}") from e


def _source_of(module: str) -> Path:
    mod = sys.modules.get(module) if isinstance(module, str) else None
    file = getattr(mod, "__file__", None)
    if not file:
        raise ValueError(f"module must name an imported module with a source file (got {module!r}); "
                         "call register(__name__, ...) from the module itself")
    return Path(file).resolve()


def _drop_if_changed(marker: str, stamp: str, home: Path, drops) -> None:
    """Delete the files matching each ``(source, pattern)`` of ``drops`` in ``source``'s cache directory,
    then record ``stamp`` in ``marker`` beside ``home``'s cache, unless ``marker`` holds ``stamp``."""
    try:
        path = cache_dir(home) / marker
        if path.exists() and path.read_text() == stamp:
            return
        for source, pattern in drops:
            for f in cache_dir(source).glob(pattern):
                f.unlink(missing_ok=True)
        path.write_text(stamp)
    except OSError:
        pass


def lock_cache_saves() -> bool:
    """Serialise Numba's cache saves across processes: each save holds an exclusive ``flock`` on a file
    beside the function's index (``<index>.lock``). Returns whether the lock is in place.

    Why: a save reads the index, picks the first data-file number no entry uses, then writes the index
    and the data. Two processes compiling different specialisations of one function at once (pytest
    workers, Ray workers, two CLIs after an upgrade) both pick the same number; the index then names
    one's key beside the other's code, and a later process loads the wrong machine code under that
    key — seen here as ``'descr' is NULL`` when a packed-matmul driver of one weight kind ran with
    another kind's environment (docs/DESIGN.md §14). Loads need no lock: the data file is written to
    a temporary name and renamed, and an entry whose file is not there yet is a cache miss."""
    if fcntl is None:
        return False
    try:
        from numba.core import caching
        cls = caching.IndexDataCacheFile
        save = cls.save
    except (ImportError, AttributeError):    # numba's internals moved: saves stay as they are
        return False
    if getattr(save, "locked_by_streamattn", False):
        return True

    def locked_save(self, key, data):
        try:
            fd = os.open(f"{self._index_path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        except (OSError, AttributeError):
            return save(self, key, data)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return save(self, key, data)
        finally:
            os.close(fd)                     # (releases the lock)

    locked_save.locked_by_streamattn = True
    cls.save = locked_save
    return True


def variant(fn, tag: str):
    """``fn`` (a closure from a kernel factory) renamed ``<qualname>__<tag>``, before it is jitted with
    ``cache=True``; returns it.

    Numba names a compiled function's environment (its constants: dtype objects, strings) after its
    qualname, argument types and a per-process counter, and a process that loads a second function
    whose environment name is taken reuses the first one's (``numba.core.environment._rebuild_env``).
    Copies of one closure (the serial and parallel loops, the packed-matmul drivers of each weight
    kind) share qualname and argument types, so two of them compiled by different processes at the
    same counter value collided once both were loaded: a driver then read another's constants
    (``'descr' is NULL`` under pytest's two workers, docs/DESIGN.md §14). ``tag`` must tell the copies
    of a closure apart and be usable in a file name (it also names the copy's cache files)."""
    fn.__qualname__ = f"{fn.__qualname__}__{tag}"
    return fn
