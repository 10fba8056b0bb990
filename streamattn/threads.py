"""CPU threads: how idle pool workers wait (set once, at import) and the thread counts of the two pools.

Importing streamattn applies :data:`RUNTIME_ENV` as defaults, before numpy loads OpenBLAS and before
Numba's first parallel launch loads GNU libgomp (Numba's 'omp' threading layer on Linux; both runtimes
read these variables once, when they load): a short libgomp spin for idle workers, OpenBLAS's shortest
sleep timeout, and Numba's threading layer named explicitly. A value the user exported wins (an exported
OMP_WAIT_POLICY also keeps libgomp's own spin count for that policy). The settings cannot reach a runtime
loaded before streamattn was imported (e.g. numpy imported first: OpenBLAS keeps spinning);
:func:`runtime_report` says what took effect. :func:`set_threads` sets one count for both pools,
:func:`threads` does so inside a ``with`` block.

Why a short spin rather than a long one or none: docs/DESIGN.md §15; the measurements: docs/PERF.md
(figures once in module docstrings) and docs/END_TO_END.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys

#: Environment defaults applied at import (``os.environ.setdefault``: an exported value wins).
RUNTIME_ENV = {
    "GOMP_SPINCOUNT": "3000",            # libgomp: idle workers spin 3,000 turns, then block
    "OPENBLAS_THREAD_TIMEOUT": "4",      # OpenBLAS: idle workers sleep after 2^4 cycles (its minimum), not 2^28
}
if sys.platform.startswith("linux"):      # numba's Linux wheels ship the omp layer (GNU libgomp)
    RUNTIME_ENV["NUMBA_THREADING_LAYER"] = "omp"   # explicit, not "whichever of tbb/omp/workqueue loads first"


def _loaded(fragment: str) -> bool:
    """Whether a shared library whose path contains ``fragment`` is mapped into this process (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            return any(fragment in line for line in f)
    except OSError:
        return False


def _configure_runtime() -> dict:
    """Apply :data:`RUNTIME_ENV` as defaults; returns which runtimes were already loaded (too late)."""
    late = {"openblas": "numpy" in sys.modules, "libgomp": _loaded("libgomp")}
    for key, value in RUNTIME_ENV.items():
        if key == "GOMP_SPINCOUNT" and "OMP_WAIT_POLICY" in os.environ:
            continue                              # the user's policy keeps its own spin count
        os.environ.setdefault(key, value)
    if "numba" in sys.modules:                    # numba read NUMBA_THREADING_LAYER at its import
        import numba
        if (numba.config.THREADING_LAYER == "default" and "NUMBA_THREADING_LAYER" in RUNTIME_ENV
                and "NUMBA_THREADING_LAYER" not in _USER_SET):
            numba.config.THREADING_LAYER = RUNTIME_ENV["NUMBA_THREADING_LAYER"]
    return late


#: What :func:`runtime_report` reads back: our defaults, and the policy a user may export instead.
REPORTED = ("OMP_WAIT_POLICY", *RUNTIME_ENV)
_USER_SET = {k: os.environ[k] for k in REPORTED if k in os.environ}
_LATE = _configure_runtime()


def runtime_report() -> dict:
    """What the thread runtimes of this process were told, and whether it reached them.

    Returns
    -------
    dict
        ``env``: each :data:`REPORTED` key with the value the C runtime sees (``getenv``, None: unset);
        ``user_set``: the keys the user had exported (their values won); ``late``: runtimes already
        loaded before streamattn was imported (``{"openblas": bool, "libgomp": bool}``: True means the
        default could not apply); ``threading_layer``: Numba's layer once a parallel kernel has run,
        else None.

    Examples
    --------
    >>> runtime_report()["env"]["OPENBLAS_THREAD_TIMEOUT"] is not None
    True
    """
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    env = {k: (libc.getenv(k.encode()) or b"").decode() or None for k in REPORTED}
    layer = None
    if "numba" in sys.modules:
        import numba
        try:
            layer = numba.threading_layer()
        except ValueError:                        # no parallel kernel has run yet
            layer = None
    return {"env": env, "user_set": dict(_USER_SET), "late": dict(_LATE), "threading_layer": layer}


_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


def _openblas(names=_SETTERS):
    import numpy as np
    here = os.path.dirname(np.__file__)
    for path in glob.glob(os.path.join(here, "..", "numpy.libs", "*openblas*")) + \
            glob.glob(os.path.join(here, ".dylibs", "*openblas*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            if hasattr(lib, name):
                return getattr(lib, name)
    return None


def set_threads(n: int) -> dict:
    """Use ``n`` threads for numpy's OpenBLAS (when found) and for Numba parallel kernels.

    Returns what was set: ``{"blas": bool, "numba": int}``.

    Examples
    --------
    >>> set_threads(1)["numba"]
    1
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be an integer >= 1 (got {n!r})")
    import numba
    n_numba = min(n, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n_numba)
    setter = _openblas()
    if setter is not None:
        setter(n)
    return {"blas": setter is not None, "numba": n_numba}


def many_threads() -> bool:
    """Whether Numba runs more than one thread for this Python thread: what the kernels' drivers ask before
    each call. After the first call it reads Numba's own ctypes getter, which does not check the pool as
    ``numba.get_num_threads()`` does (docs/DESIGN.md §16)."""
    global _thread_count
    if _thread_count is None:
        import numba
        numba.get_num_threads()                          # launches the pool once: the getter is valid after
        try:
            from numba.np.ufunc.parallel import _get_num_threads
            _thread_count = _get_num_threads
        except ImportError:                              # numba internals moved: the public call
            _thread_count = numba.get_num_threads
    return _thread_count() > 1


_thread_count = None


@contextlib.contextmanager
def threads(n: int):
    """Context manager: :func:`set_threads` ``(n)`` inside, the previous counts restored after."""
    import numba
    getter = _openblas(tuple(s.replace("set_", "get_") for s in _SETTERS))
    old_blas = int(getter()) if getter is not None else None
    old_numba = numba.get_num_threads()
    set_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(old_numba)
        if old_blas is not None:
            _openblas()(old_blas)
