"""streamattn/runtime/memory.py: numba's BLAS probe runs without importing scipy.linalg, and nothing stays hidden."""

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_streamattn_skips_scipy_linalg_and_hides_nothing_after():
    got = _run("""
        import sys
        import streamattn
        from streamattn.quant.matmul import quantize_rows      # a first compiled call's imports
        import numpy as np
        x = np.ones((1, 32), np.float32)
        quantize_rows(x, np.empty((1, 32), np.int8), np.empty((1, 1), np.float32), np.empty((1, 1), np.float32),
                      np.empty((1, 2), np.int32))
        import numba.np.arraymath as am
        import numba.np.linalg as la
        print("linalg" if "scipy.linalg" in sys.modules else "no-linalg", am._HAVE_BLAS,
              am.ensure_blas is la.ensure_blas and la.ensure_blas.__module__ == "numba.np.linalg")
        try:
            import scipy.linalg.cython_blas                    # later imports work as usual
            print("importable")
        except ImportError:
            print("no-scipy")
    """).split()
    assert got[:3] == ["no-linalg", "False", "True"], got           # the probe is numba's own again
    assert got[3] in ("importable", "no-scipy")


def test_release_compiler_pages_drops_llvm_pages_and_compiling_still_works():
    """The pages only this process maps (Private_Clean: the test's parent may map LLVM's library too, and
    the kernel never reclaims a page another process maps) leave the resident set; a fresh compile after
    it, and a call of a function compiled before it, still work. This process (pytest, which has loaded
    numba) first hands its own pages back, so that the child's are its own."""
    from streamattn.runtime.memory import release_compiler_pages
    release_compiler_pages()
    got = _run("""
        import numpy as np
        from numba import njit
        from streamattn.runtime.memory import release_compiler_pages

        def llvm_private_kb():
            total, inside = 0, False
            for line in open("/proc/self/smaps"):
                head = line.split()
                if "-" in head[0] and ":" not in head[0]:
                    inside = "libllvmlite" in line and "w" not in head[1]
                elif inside and head[0] == "Private_Clean:":
                    total += int(head[1])
            return total

        @njit
        def f(a):
            return a.sum()

        f(np.ones(3))
        before = llvm_private_kb()
        advised = release_compiler_pages()
        after = llvm_private_kb()

        @njit
        def g(a):
            return a.sum() * 2                          # a fresh compile reads the pages back

        print(before, advised, after, g(np.ones(3)), f(np.ones(4)))
    """).split()
    before, advised, after = int(got[0]), int(got[1]), int(got[2])
    assert got[3:] == ["6.0", "4.0"]
    assert advised > 0, "madvise(MADV_PAGEOUT) refused (Linux < 5.4?)"
    if before < 10_000:                                  # KB: LLVM's code the compile touched
        pytest.skip(f"another process on this host maps LLVM's pages too ({before} KB private here): "
                    "the kernel reclaims no shared page, so there is nothing to measure")
    assert after <= before // 4, (before, after)


def test_paused_gc_pauses_and_puts_back_what_was():
    import gc
    from streamattn.runtime.memory import paused_gc
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with paused_gc():
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()                 # off before: left off
    finally:
        gc.enable()
