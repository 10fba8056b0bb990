"""Process memory: two steps that keep the resident set of ``streamattn generate`` small, and one that
keeps the cyclic garbage collector out of a model's load (:func:`paused_gc`).

- :func:`import_numba_arraymath` (run by ``import streamattn``) imports ``numba.np.arraymath`` with
  numba's BLAS probe answering "no BLAS" for that import only, so scipy.linalg is not imported for it.
- :func:`release_compiler_pages` (run by ``warm_model``, so by the CLI and the server before they serve)
  has the kernel reclaim the clean pages of Numba's LLVM library, which only compiling and loading
  kernels execute.

Why each is safe: docs/DESIGN.md §11; what each saves: docs/perf/2026-12-01.md (peak RSS).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys


def import_numba_arraymath() -> None:
    """Import ``numba.np.arraymath`` (once) with numba's BLAS probe answering "no BLAS" for that import.

    The probe (``numba.np.linalg.ensure_blas``) is replaced by one that raises ImportError only while
    the module imports, then restored there and in arraymath, so jitted code that does use BLAS
    (``np.dot``) still finds scipy when it is compiled. Nothing else is hidden: other imports of scipy
    work throughout."""
    if "numba.np.arraymath" in sys.modules:
        return
    import numba.np.linalg as linalg
    real = linalg.ensure_blas

    def no_probe():
        raise ImportError("numba's BLAS probe skipped at import (streamattn/runtime/memory.py)")

    linalg.ensure_blas = no_probe
    try:
        import numba.np.arraymath as arraymath
    finally:
        linalg.ensure_blas = real
    if getattr(arraymath, "ensure_blas", None) is no_probe:
        arraymath.ensure_blas = real


@contextlib.contextmanager
def paused_gc():
    """Context manager: Python's cyclic garbage collector off inside, as it was after (also on an error).

    For work that makes many objects that outlive it (a model's load: its vocabulary, its tokenizer's
    parts): a full collection inside would traverse them only to find them alive. Garbage made inside is
    collected after, as usual."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def trim_heap() -> None:
    """Hand the heap's free pages back to the kernel (glibc ``malloc_trim``; nothing elsewhere). The loader
    calls it after moving each weight, so freed copies do not stay resident (docs/PERF.md)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


MADV_PAGEOUT = 21                 # Linux 5.4+: reclaim these pages now (clean file pages are just dropped)


def release_compiler_pages(library: str = "libllvmlite") -> int:
    """Ask the kernel to reclaim the resident pages of LLVM's shared library (read-only and executable
    mappings only); returns the bytes of mappings advised (0 where this is not Linux, or madvise fails).

    The library runs only while Numba compiles or loads a kernel; once the model is warm
    (:func:`streamattn.engine.generate.warm_model`) decoding never executes it, yet the pages that loading touched stay resident.
    MADV_PAGEOUT never discards data: clean file pages are dropped and read back from the file when
    next used (a later compile still works, a little slower); relocated read-only data (private,
    dirty) goes to swap where there is swap, else stays. A page another process also maps is not
    reclaimed. Nothing writable is advised."""
    try:
        with open("/proc/self/maps") as f:
            maps = [line.split() for line in f if library in line]
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return 0
    done = 0
    for fields in maps:
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if "w" in fields[1]:
            continue
        if libc.madvise(start, end - start, MADV_PAGEOUT) == 0:
            done += end - start
    return done
