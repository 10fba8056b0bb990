"""Compile kernel sources through CuPy's low-level NVRTC binding, with no GPU and no driver.

Needs the ``gpu-check`` extra (cupy-cuda12x, nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12).
CuPy >= 14 finds the NVRTC wheel's library itself (cuda-pathfinder); for older CuPy, ``nvrtc()``
preloads ``libnvrtc.so.12`` from the wheel with ctypes first.
Usable as a script: ``PYTHONPATH=.:tests python tests/nvrtc_check.py`` prints the ptxas summary.
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
from dataclasses import dataclass, field

from streamattn.kv.backends import gpu_source

ARCHS = ("sm_80", "sm_90")


def _wheel_dir(package: str) -> str | None:
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        if os.path.isdir(os.path.join(root, package)):
            return os.path.join(root, package)
    return None


def nvrtc():
    """The ``cupy.cuda.nvrtc`` module with a loadable libnvrtc; raises ImportError/OSError if none."""
    from cupy.cuda import nvrtc as binding
    try:
        binding.getVersion()
    except Exception:
        lib_dir = _wheel_dir("cuda_nvrtc")
        libs = sorted(glob.glob(os.path.join(lib_dir, "lib", "libnvrtc.so*"))) if lib_dir else []
        if not libs:
            raise
        ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
        binding.getVersion()
    return binding


def include_options() -> list[str]:
    """-I to the CUDA runtime wheel's headers (the kernels include none today; kept for future ones)."""
    folder = _wheel_dir("cuda_runtime")
    return [f"-I{os.path.join(folder, 'include')}"] if folder else []


@dataclass
class Entry:
    """ptxas facts of one kernel entry."""
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    stack: int = -1
    smem: int = 0


@dataclass
class Compiled:
    kind: str
    arch: str
    log: str
    lowered: dict[str, str]  # readable name -> lowered (mangled) name
    entries: dict[str, Entry] = field(default_factory=dict)  # mangled name -> facts
    cubin_bytes: int = 0


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, Entry]:
    """Per-entry registers, stack, spills and shared memory from a ``-Xptxas -v`` log."""
    entries: dict[str, Entry] = {}
    current = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = entries.setdefault(m.group(1), Entry())
        elif current is not None and (m := _FRAME.search(line)):
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current is not None and (m := _REGS.search(line)):
            current.registers = int(m.group(1))
            current.smem = int(m.group(2) or 0)
    return entries


def compile_kind(kind: str, arch: str, *, source: str | None = None) -> Compiled:
    """Compile every specialisation of ``kind`` for ``arch`` with the backend's options plus -Xptxas -v."""
    binding = nvrtc()
    names = [n for n in gpu_source.all_specs() if n.split("_")[0] == kind]
    prog = binding.createProgram(source or gpu_source.source(kind), f"{kind}.cu", [], [])
    try:
        for name in names:
            binding.addNameExpression(prog, gpu_source.name_expression(name))
        options = [*gpu_source.NVRTC_OPTIONS, *gpu_source.CUPY_ADDED_OPTIONS, f"-arch={arch}", "-Xptxas", "-v", *include_options()]
        try:
            binding.compileProgram(prog, options)
        except binding.NVRTCError as err:
            raise RuntimeError(f"NVRTC failed on {kind} for {arch}: {err}\n{binding.getProgramLog(prog)}") from err
        log = binding.getProgramLog(prog)
        lowered = {n: binding.getLoweredName(prog, gpu_source.name_expression(n)) for n in names}
        return Compiled(kind, arch, log, lowered, parse_ptxas(log), len(binding.getCUBIN(prog)))
    finally:
        binding.destroyProgram(prog)


if __name__ == "__main__":
    for arch in ARCHS:
        for kind in gpu_source.SOURCES:
            c = compile_kind(kind, arch)
            for name, mangled in c.lowered.items():
                e = c.entries[mangled]
                print(f"{arch} {name:20s} regs {e.registers:3d}  smem {e.smem:6d}  "
                      f"spills {e.spill_stores}/{e.spill_loads}  stack {e.stack}")
