"""streamattn.runtime.cpu_target: the kernels are chosen for the CPU Numba compiles for, and a target they
cannot run on is refused by name at import (it was LLVM aborting the process). Each case runs in a
fresh interpreter, since Numba reads NUMBA_CPU_NAME / NUMBA_CPU_FEATURES once."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import llvmlite.binding as llvm
import pytest

ROOT = Path(__file__).resolve().parents[1]
x86 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 features")


def _run(code, tmp_path, **env):
    full = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(tmp_path), **env}
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=600)


@x86
def test_a_target_without_f16c_is_refused_by_name(tmp_path):
    r = _run("import streamattn", tmp_path, NUMBA_CPU_NAME="generic")
    assert r.returncode != 0
    assert "RuntimeError" in r.stderr and "NUMBA_CPU_NAME=generic" in r.stderr and "F16C" in r.stderr
    assert "LLVM ERROR" not in r.stderr


@x86
def test_kernels_follow_numba_cpu_features_not_the_host(tmp_path):
    """The host's features less AVX-512 and AMX: the 8-lane kernels are chosen (on an AVX-512 host
    the 16-lane ones, picked from the host's features, made LLVM abort), and a float16 attention runs."""
    host = llvm.get_host_cpu_features().flatten().split(",")
    if "+f16c" not in host or "+avx2" not in host:
        pytest.skip("this CPU has no F16C or AVX2")
    less = ",".join("-" + f[1:] if f[1:].startswith(("avx512", "amx")) else f for f in host)
    code = """
import numpy as np
from streamattn import CacheSpec, KVCache, attend
from streamattn.runtime import cpu_target
from streamattn.kv.backends import cpu_simd
from streamattn.quant import kernels
assert not cpu_target.has("avx512f") and cpu_target.has("f16c")
assert not cpu_simd._AVX512 and not kernels.WIDE and kernels.LANES == 8
c = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=64, dtype="float16"))
k = np.arange(64, dtype=np.float32).reshape(1, 1, 1, 64) / 64
c.append(k, 2 * k)
out, lse = attend(k, c, backend="cpu")
assert np.array_equal(out, (2 * k).astype(np.float16).astype(np.float32)), out
print("ok")
"""
    r = _run(code, tmp_path, NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES=less)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
