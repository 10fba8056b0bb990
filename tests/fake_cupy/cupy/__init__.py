"""A stand-in for CuPy, backed by numpy and the CPU emulation harness: dry runs of GPU-only code.

Put ``tests/fake_cupy`` first on PYTHONPATH (and ``STREAMATTN_FAKE_CUPY_LIB`` = a library from
tests/cuda_emu/emu.py ``build``) to run streamattn.kv.backends.gpu, tests/test_gpu_device.py and
benchmarks/gpu_decode.py on a machine without a GPU. It covers only the CuPy calls those make, and
proves their wiring (names, arguments, shapes), not their speed.
"""
from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

import numpy as _np

__version__ = "0.0-fake"
float16, float32, uint8, uint16, uint32, int32, int64 = (_np.float16, _np.float32, _np.uint8, _np.uint16,
                                                         _np.uint32, _np.int32, _np.int64)
float64, int8, nan = _np.float64, _np.int8, _np.nan   # (a KVCache on the device: tests/test_gpu_device.py)


#: What a real device would pay for, counted: "sync" (a value read back to the host: get, bool, int, float,
#: item, tolist) and "upload" (asarray of host data). Tests reset and read it (tests/test_gpu_cache.py).
counts = {"sync": 0, "upload": 0}


class ndarray(_np.ndarray):
    """numpy array that claims to live on a device."""

    @property
    def __cuda_array_interface__(self):
        return self.__array_interface__

    def get(self):
        counts["sync"] += 1
        return _np.array(self)

    def _read(self, convert):
        counts["sync"] += 1
        return convert(_np.asarray(self))

    def __bool__(self):
        return self._read(bool)

    def __int__(self):
        return self._read(int)

    def __float__(self):
        return self._read(float)

    def item(self, *args):
        counts["sync"] += 1
        return _np.asarray(self).item(*args)

    def tolist(self):
        counts["sync"] += 1
        return _np.asarray(self).tolist()

    def all(self, *args, **kwargs):     # 0-d on the "device", as CuPy's: reading it is a sync
        return _dev(_np.asarray(_np.ndarray.all(_np.asarray(self), *args, **kwargs)))

    def any(self, *args, **kwargs):
        return _dev(_np.asarray(_np.ndarray.any(_np.asarray(self), *args, **kwargs)))

    @property
    def data(self):
        return _Pointer(self)


class _Pointer:
    def __init__(self, arr):
        self.arr = arr

    def copy_from_device_async(self, src, nbytes, stream=None):
        self.arr.view(_np.uint8).reshape(-1)[:nbytes] = src.arr.view(_np.uint8).reshape(-1)[:nbytes]


def _dev(x):
    return _np.asarray(x).view(ndarray)


def _upload(a):
    if not isinstance(a, ndarray):
        counts["upload"] += 1


def asarray(a, dtype=None):
    _upload(a)
    return _dev(_np.asarray(a, dtype=dtype))


def ascontiguousarray(a, dtype=None):
    _upload(a)
    return _dev(_np.ascontiguousarray(a, dtype=dtype))


def empty(shape, dtype=float32):
    return _dev(_np.empty(shape, dtype))


for _name in ("repeat", "einsum", "exp", "log", "abs", "zeros", "zeros_like", "full", "full_like", "where", "maximum",
              "isfinite", "isnan", "concatenate", "arange"):
    setattr(sys.modules[__name__], _name, (lambda f: lambda *a, **k: _dev(f(*a, **k)))(getattr(_np, _name)))

_rng = _np.random.default_rng(0)
random = types.SimpleNamespace(
    standard_normal=lambda shape, dtype=float32: _dev(_rng.standard_normal(shape, dtype=_np.float32).astype(dtype)),
    randint=lambda low, high=None, size=None, dtype=int64: _dev(_rng.integers(low, high, size=size, dtype=dtype)))


def _emulator():
    if "emu" not in _state:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for cuda_emu
        from cuda_emu import emu
        _state["emu"] = emu.Emulator(Path(os.environ["STREAMATTN_FAKE_CUPY_LIB"]))
    return _state["emu"]


_state: dict = {}


class RawModule:
    def __init__(self, code, options=(), name_expressions=()):
        from streamattn.kv.backends import gpu_source
        self._names = {gpu_source.name_expression(n): n for n in gpu_source.all_specs()}
        assert all(e in self._names for e in name_expressions), name_expressions

    def get_function(self, expression):
        name = self._names[expression]
        return lambda grid, block, args, **_: _emulator().launch(name, grid, block, list(args))


class RawKernel:  # only the benchmark's spin kernel
    def __init__(self, code, name):
        self.name = name

    def __call__(self, grid, block, args, **_):
        pass


class _Event:
    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


class _Device:
    def __init__(self, device=0):
        self.id = device
        # a small L2: the benchmark's dry run rotates 2-6 cache copies per point, not 16 (each one a decode
        # through the emulator)
        self.attributes = {"MultiProcessorCount": 4, "L2CacheSize": 1 << 16}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class _Pool:
    def free_all_blocks(self):
        pass


def get_default_memory_pool():
    return _Pool()


cuda = types.SimpleNamespace(
    Device=_Device, Event=_Event, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, runtimeGetVersion=lambda: 12090,
                                  getDeviceProperties=lambda d: {"name": b"fake GPU (numpy + CUDA emulation)"}),
    is_available=lambda: True)
