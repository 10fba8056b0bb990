"""streamattn/memory.py: numba's BLAS probe runs without importing scipy.linalg, and nothing stays hidden."""

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_streamattn_skips_scipy_linalg_and_hides_nothing_after():
    got = _run("""
        import sys
        import streamattn
        from streamattn.models.qmatmul import quantize_rows      # a first compiled call's imports
        import numpy as np
        x = np.ones((1, 32), np.float32)
        quantize_rows(x, np.empty((1, 32), np.int8), np.empty((1, 1), np.float32), np.empty((1, 1), np.float32))
        import numba.np.arraymath as am
        print("linalg" if "scipy.linalg" in sys.modules else "no-linalg", am._HAVE_BLAS,
              "scipy.linalg.cython_blas" in sys.modules)
        try:
            import scipy.linalg.cython_blas                    # later imports work as usual
            print("importable")
        except ImportError:
            print("no-scipy")
    """).split()
    assert got[:3] == ["no-linalg", "False", "False"], got
    assert got[3] in ("importable", "no-scipy")
