"""Build and drive the CPU emulation of the CUDA kernels (cuda_emu.h) from Python through ctypes.

``build`` writes the exact text the GPU backend compiles (streamattn.kv.backends.gpu_source.source) next
to a generated translation unit that includes it after cuda_emu.h, and compiles a shared library with g++.
``Emulator.attend`` then runs streamattn.kv.backends.gpu_plan.attend_with, the GPU backend's own
orchestration, with numpy arrays and this launcher (``Emulator.gemv``, ``Emulator.embed``: gpu_gemv's plans;
``Emulator.layer``: gpu_layer's plans).
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np

from streamattn.kv.backends import gpu_gemv, gpu_plan, gpu_source

HERE = Path(__file__).resolve().parent
CXX_FLAGS = ("-std=c++20", "-O2", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing",
             "-Wall", "-Wno-unused-variable", "-Wno-unknown-pragmas")


def have_compiler() -> bool:
    """True when g++ is on PATH."""
    return shutil.which("g++") is not None


def build(out_dir: Path, *, sources: dict[str, str] | None = None, specs: list[str] | None = None,
          extra_flags: tuple[str, ...] = (), entries: dict[str, tuple[str, str]] | None = None) -> Path:
    """Compile the emulation library; return the path of the .so.

    Parameters
    ----------
    out_dir : Path
        Where the sources, the generated unit and the library go.
    sources : dict, optional
        kind -> source text; default: the loader's text for every kind (``gpu_source.source``).
    specs : list of str, optional
        Specialisations to instantiate (readable names); default all.
    extra_flags : tuple of str
        More g++ flags, e.g. ``("-fsanitize=thread",)``.
    entries : dict, optional
        Launch name -> (kind, C++ name expression), instead of ``specs``: kernels of sources under kinds
        of their own (several planted variants of one kernel in one build).
    """
    unit = write_unit(out_dir, sources=sources, specs=specs, entries=entries)
    lib = out_dir / "libemu.so"
    cmd = ["g++", *CXX_FLAGS, *extra_flags, f"-I{HERE}", f"-I{out_dir}", str(unit), "-o", str(lib)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"g++ failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    return lib


def write_unit(out_dir: Path, *, sources: dict[str, str] | None = None, specs: list[str] | None = None,
               entries: dict[str, tuple[str, str]] | None = None) -> Path:
    """Write the kernel texts and the translation unit that includes them; return the unit's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sources or {kind: gpu_source.source(kind) for kind in gpu_source.SOURCES}
    specs = specs or gpu_source.all_specs()
    lines = ['#include "cuda_emu.h"']
    for kind, text in sources.items():
        # Each kind in its own namespace with the include guard reset: like NVRTC's separate programs,
        # every kernel sees its own copy of the shared header (a planted change stays in its kind).
        (out_dir / f"{kind}.cu").write_text(text)
        lines += [f"namespace sa_{kind} {{", "#undef STREAMATTN_COMMON_CUH", f'#include "{kind}.cu"', "}"]
    if entries is None:
        entries = {name: (name.split("_")[0], gpu_source.name_expression(name)) for name in specs
                   if name.split("_")[0] in sources}
    rows = [f'        {{"{name}", emu::entry(&sa_{kind}::{expression})}},' for name, (kind, expression) in entries.items()]
    lines += ["const std::map<std::string, emu::Entry>& emu_table() {",
              "    static const std::map<std::string, emu::Entry> table = {", *rows, "    };",
              "    return table;", "}", ""]
    unit = out_dir / "emu_unit.cpp"
    unit.write_text("\n".join(lines))
    return unit


class Emulator:
    """A loaded emulation library: ``launch`` runs one kernel, ``attend``, ``gemv`` and ``layer`` the backend's
    plans."""

    def __init__(self, lib: Path, *, timeout_s: float = 60.0):
        self._lib = ctypes.CDLL(str(lib))
        self._lib.emu_launch.restype = ctypes.c_int
        self.timeout_s = timeout_s
        self.launches: list[str] = []  # names launched, in order (tests check the plan's choices)

    def launch(self, name: str, grid, block, args) -> None:
        """Run kernel ``name`` on ``grid`` x ``block``; args: numpy arrays, np.int32, np.float32, np.float64."""
        keep = []  # ctypes values must outlive the call
        for a in args:
            if isinstance(a, np.ndarray):
                if not a.flags.c_contiguous:
                    raise ValueError(f"argument {len(keep)} of {name} must be C-contiguous")
                keep.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, np.int32):
                keep.append(ctypes.c_int32(int(a)))
            elif isinstance(a, np.float32):
                keep.append(ctypes.c_float(float(a)))
            elif isinstance(a, np.float64):
                keep.append(ctypes.c_double(float(a)))
            else:
                raise TypeError(f"argument {len(keep)} of {name}: unsupported type {type(a).__name__}")
        argv = (ctypes.c_void_p * len(keep))(*[ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in keep])
        err = ctypes.create_string_buffer(512)
        rc = self._lib.emu_launch(name.encode(), *[ctypes.c_uint(int(x)) for x in grid],
                                  *[ctypes.c_uint(int(x)) for x in block], argv,
                                  ctypes.c_double(self.timeout_s), err, ctypes.c_int(len(err)))
        if rc:
            raise RuntimeError(f"emulated launch of {name} failed ({rc}): {err.value.decode()}")
        self.launches.append(name)

    def attend(self, q, k, v, lengths, counts, *, window, sinks, scale, splits=None, sm_count=2, q_sink=None,
               softcap=None):
        """The GPU backend's attend, emulated (same plan, same kernels)."""
        return gpu_plan.attend_with(np, self.launch, q, k, v, np.asarray(lengths), np.asarray(counts),
                                    window=window, sinks=sinks, scale=scale, sm_count=sm_count, splits=splits,
                                    q_sink=q_sink, softcap=softcap)

    def gemv(self, weight, x, *, out=None):
        """The GPU backend's packed gemv, emulated (same plan, same kernels)."""
        return gpu_gemv.gemv_with(np, self.launch, weight, x, out=out)

    def embed(self, weight, ids, *, scale=1.0, out=None):
        """The GPU backend's embedding rows of a packed matrix, emulated (same plan, same kernels)."""
        return gpu_gemv.embed_with(np, self.launch, weight, ids, scale=scale, out=out)

    def layer(self, plan, *args, **kwargs):
        """A layer kernel's plan of streamattn.kv.backends.gpu_layer (e.g. ``rms_norm_with``), emulated."""
        return plan(np, self.launch, *args, **kwargs)


def build_tsan_program(out_dir: Path, *, sources: dict[str, str] | None = None) -> Path:
    """Compile tsan_main.cpp with the kernels under ThreadSanitizer; return the executable's path."""
    write_unit(out_dir, sources=sources, specs=["decode_f16_hd64", "prefill_bf16_hd64"])
    exe = out_dir / "tsan_check"
    flags = [f for f in CXX_FLAGS if f not in ("-shared", "-fPIC", "-O2")]
    cmd = ["g++", *flags, "-O1", "-g", "-fsanitize=thread", f"-I{HERE}", f"-I{out_dir}",
           str(out_dir / "emu_unit.cpp"), str(HERE / "tsan_main.cpp"), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"g++ failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    return exe
