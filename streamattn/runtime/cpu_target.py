"""The CPU features Numba compiles streamattn's kernels for, read once and checked.

The code generators pick instructions by feature (AVX-512 or AVX2 widths, VNNI, AMX), so they must ask
what Numba compiles for, not what the host has: with ``NUMBA_CPU_NAME`` set (Numba's advice for caches
shared between machines) Numba compiles for that CPU and ``NUMBA_CPU_FEATURES`` (default: none beyond
the CPU model's), and an AVX-512 intrinsic chosen from the host's features aborted LLVM. The kernels'
float16 conversions need F16C: without it LLVM calls ``__extendhfsf2``, which Numba's JIT cannot
resolve ("LLVM ERROR: Symbol not found", the process killed), so such a target is refused at import
with the variables named instead.
"""

from __future__ import annotations

import functools
import os


@functools.cache
def features() -> frozenset:
    """Feature names (without the '+') Numba's JIT compiles for: ``NUMBA_CPU_FEATURES`` when Numba uses
    one (it does once ``NUMBA_CPU_NAME`` is set, empty unless given), else the host's."""
    import llvmlite.binding as llvm
    from numba.core import config
    flat = config.CPU_FEATURES if config.CPU_FEATURES is not None else llvm.get_host_cpu_features().flatten()
    return frozenset(f[1:] for f in flat.split(",") if f.startswith("+"))


def has(feature: str) -> bool:
    """Whether Numba compiles for a CPU with ``feature`` (LLVM's name: "avx2", "avx512vnni", "f16c")."""
    return feature in features()


def check() -> None:
    """Raise RuntimeError when Numba's target lacks what every kernel needs (F16C on x86)."""
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64") or has("f16c"):
        return
    name = os.environ.get("NUMBA_CPU_NAME", "(unset)")
    given = os.environ.get("NUMBA_CPU_FEATURES", "(unset)")
    raise RuntimeError(
        f"Numba compiles for NUMBA_CPU_NAME={name} with NUMBA_CPU_FEATURES={given}: a CPU without F16C, "
        "which streamattn's float16 conversions need (LLVM would abort the process on the first kernel). "
        "Unset NUMBA_CPU_NAME to compile for this CPU, or give the features to compile for, F16C among them: "
        "NUMBA_CPU_FEATURES=+sse4.2,+avx,+avx2,+fma,+f16c (AVX2 machines) or a machine's "
        "`python -c \"import llvmlite.binding as l; print(l.get_host_cpu_features().flatten())\"`.")
