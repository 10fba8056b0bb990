"""Process memory: what streamattn does to keep ``streamattn generate`` small (docs/PERF.md, 2026-12-01).

Peak RSS of ``streamattn generate`` on SmolLM2-135M (705-token prompt, 1 thread, fp16 cache, prefill
chunk 256): 331 MB before both of these, 315 after the first, 284 after the second.

- **No scipy.linalg for numba's BLAS probe.** ``numba.np.arraymath`` imports ``scipy.linalg`` when it is
  itself imported (on the first compiled call), only to set a flag that picks np.correlate's inner
  product; where scipy is installed that import is 29 MB of RSS. The kernels here call no BLAS.
  :func:`import_numba_arraymath` (run by ``import streamattn``) imports that module with
  ``scipy.linalg.cython_blas`` hidden for the moment, so the probe answers "no BLAS"; jitted code that
  does need BLAS (``np.dot``) still imports scipy when it is compiled.
- **LLVM's pages go once the kernels are loaded.** :func:`release_compiler_pages` (run by
  ``warm_model``, so by the CLI and the server before they serve) has the kernel reclaim the clean
  pages of Numba's LLVM library, which only compiling and loading kernels execute.
"""

from __future__ import annotations

import ctypes
import sys

_PROBED = "scipy.linalg.cython_blas"


def import_numba_arraymath() -> None:
    """Import ``numba.np.arraymath`` (once) with ``scipy.linalg.cython_blas`` hidden during the import."""
    if "numba.np.arraymath" in sys.modules:
        return
    hidden = _PROBED not in sys.modules
    if hidden:
        sys.modules[_PROBED] = None               # "import scipy.linalg.cython_blas" raises ImportError
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        if hidden and _PROBED in sys.modules and sys.modules[_PROBED] is None:
            del sys.modules[_PROBED]


MADV_PAGEOUT = 21                 # Linux 5.4+: reclaim these pages now (clean file pages are just dropped)


def release_compiler_pages(library: str = "libllvmlite") -> int:
    """Ask the kernel to reclaim the resident pages of LLVM's shared library (read-only and executable
    mappings only); returns the bytes of mappings advised (0 where this is not Linux, or madvise fails).

    The 179 MB library runs only while Numba compiles or loads a kernel; once the model is warm
    (:func:`streamattn.models.generate.warm_model`) decoding never executes it, yet the pages that
    loading touched stayed in the process's resident set: 52 MB of code and 16 MB of read-only data
    with SmolLM2, a fifth of it. They are clean file pages, so reclaiming loses nothing: a later
    compile reads them back from the file (a few ms). Nothing writable is advised."""
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
