"""Process memory: what importing streamattn does to keep ``streamattn generate`` small.

**No scipy.linalg for numba's BLAS probe.** ``numba.np.arraymath`` imports ``scipy.linalg`` when it is
itself imported (on the first compiled call), only to set a flag that picks np.correlate's inner
product; where scipy is installed that import is 29 MB of RSS. The kernels here call no BLAS.
:func:`import_numba_arraymath` imports that module with ``scipy.linalg.cython_blas`` hidden for the
moment, so the probe answers "no BLAS"; jitted code that does need BLAS (``np.dot``) still imports
scipy when it is compiled. Peak RSS of ``streamattn generate`` (SmolLM2-135M, 705-token prompt, 1
thread): 332 -> 315 MB (docs/PERF.md, 2026-12-01, with what else was tried).
"""

from __future__ import annotations

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
