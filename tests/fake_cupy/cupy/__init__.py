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
import weakref
from pathlib import Path

import numpy as _np

__version__ = "0.0-fake"
float16, float32, uint8, uint16, uint32, int32, int64 = (_np.float16, _np.float32, _np.uint8, _np.uint16,
                                                         _np.uint32, _np.int32, _np.int64)
float64, int8, nan = _np.float64, _np.int8, _np.nan   # (a KVCache on the device: tests/test_gpu_device.py)


#: What a real device would pay for, counted: "sync" (a value read back to the host: get, bool, int, float,
#: item, tolist), "upload" (asarray of host data) and "alloc" (a new array from empty, zeros, full and their
#: _like forms: memory from the pool and, but for empty, a fill launch); "graph_launch" once a captured graph
#: runs. Tests reset and read it (tests/gpu_cache_cases.py).
counts = {"sync": 0, "upload": 0, "alloc": 0}


def _outside_capture(what: str) -> None:
    """Raise if a stream capture is open: inside one only kernel launches may happen (a real capture would
    fail on a sync, and an upload or an array op would not be the kernels the test means to prove)."""
    if _state.get("capture") is not None:
        raise RuntimeError(f"{what} inside a stream capture: a captured segment must be kernel launches only")


def _sync() -> None:
    _outside_capture("a host sync")
    counts["sync"] += 1


class ndarray(_np.ndarray):
    """numpy array that claims to live on a device. Arithmetic and item assignment raise inside a capture."""

    @property
    def __cuda_array_interface__(self):
        return self.__array_interface__

    def get(self):
        _sync()
        return _np.array(self)

    def _read(self, convert):
        _sync()
        return convert(_np.asarray(self))

    def __bool__(self):
        return self._read(bool)

    def __int__(self):
        return self._read(int)

    def __float__(self):
        return self._read(float)

    def item(self, *args):
        _sync()
        return _np.asarray(self).item(*args)

    def tolist(self):
        _sync()
        return _np.asarray(self).tolist()

    def all(self, *args, **kwargs):     # 0-d on the "device", as CuPy's: reading it is a sync
        return _dev(_np.asarray(_np.ndarray.all(_np.asarray(self), *args, **kwargs)))

    def any(self, *args, **kwargs):
        return _dev(_np.asarray(_np.ndarray.any(_np.asarray(self), *args, **kwargs)))

    @property
    def data(self):
        return _Pointer(self)

    @property
    def device(self):
        """The device current when the array (or the one it views) was made: cupy.cuda.Device(n) sets it."""
        return _Device(getattr(self, "_device_id", 0))

    def __array_finalize__(self, obj):
        self._device_id = getattr(obj, "_device_id", _state.get("device", 0))


class _Pointer:
    def __init__(self, arr):
        self.arr = arr

    def copy_from_device_async(self, src, nbytes, stream=None):
        self.arr.view(_np.uint8).reshape(-1)[:nbytes] = src.arr.view(_np.uint8).reshape(-1)[:nbytes]


def _guarded(name):
    def op(self, *args, **kwargs):
        _outside_capture(f"array operation {name}")
        return getattr(_np.ndarray, name)(self, *args, **kwargs)
    return op


for _name in ("__setitem__", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__",
              "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__matmul__", "__neg__",
              "copy"):
    setattr(ndarray, _name, _guarded(_name))


def _dev(x):
    return _np.asarray(x).view(ndarray)


def _upload(a):
    if not isinstance(a, ndarray):
        _outside_capture("an upload")
        counts["upload"] += 1


def asarray(a, dtype=None):
    _upload(a)
    if not (isinstance(a, ndarray) and (dtype is None or _np.dtype(dtype) == a.dtype)):
        _outside_capture("a conversion")
    return _dev(_np.asarray(a, dtype=dtype))


def ascontiguousarray(a, dtype=None):
    _upload(a)
    if not (isinstance(a, ndarray) and a.flags.c_contiguous and (dtype is None or _np.dtype(dtype) == a.dtype)):
        _outside_capture("a copy")
    return _dev(_np.ascontiguousarray(a, dtype=dtype))


def empty(shape, dtype=float32):
    counts["alloc"] += 1
    return _dev(_np.empty(shape, dtype))


_ALLOCATE = ("zeros", "zeros_like", "full", "full_like")


def _array_function(name):
    f = getattr(_np, name)

    def run(*args, **kwargs):
        _outside_capture(f"cupy.{name}")
        if name in _ALLOCATE:
            counts["alloc"] += 1
        return _dev(f(*args, **kwargs))
    return run


# the core's GPU code, then what a model's array code adds (sqrt, tanh: test_model_gpu_dryrun, gpu_graph)
for _name in _ALLOCATE + ("repeat", "einsum", "exp", "log", "abs", "where", "maximum", "isfinite", "isnan",
                          "concatenate", "arange", "sqrt", "tanh"):
    setattr(sys.modules[__name__], _name, _array_function(_name))

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
        return lambda grid, block, args, **_: _launch(name, grid, block, list(args))


def _launch(name, grid, block, args):
    """Run a kernel on the emulator, or, inside a stream capture, add it to the capture's recording."""
    capture = _state.get("capture")
    if capture is not None:
        capture.append((name, grid, block, args))
    else:
        _emulator().launch(name, grid, block, args)


class _Graph:
    """A captured recording of kernel launches; ``launch`` runs them again, in order, on the same memory.

    As a real graph, it holds the arguments' addresses, not the arrays: each array argument is kept as a weak
    reference to the array owning its memory and its place there, so a launch whose memory was freed since
    the capture (a temporary nobody kept) raises instead of writing into it."""

    def __init__(self, launches):
        self.launches = [(name, grid, block, [_Address(a) if isinstance(a, _np.ndarray) else a for a in args])
                         for name, grid, block, args in launches]

    def launch(self, stream=None):
        _outside_capture("a graph launch")
        counts["graph_launch"] = counts.get("graph_launch", 0) + 1
        for name, grid, block, args in self.launches:
            _emulator().launch(name, grid, block, [a.array(name, i) if isinstance(a, _Address) else a
                                                   for i, a in enumerate(args)])


class _Address:
    """Where an array argument of a captured launch lives: its memory's owner (weakly) and its place there."""

    def __init__(self, a):
        root = a
        while isinstance(root.base, _np.ndarray):
            root = root.base
        self.strong = None if root.flags.c_contiguous else a      # a strided owner: kept (not rebuilt)
        self.owner = weakref.ref(root)
        self.offset = a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        self.shape, self.dtype = a.shape, a.dtype

    def array(self, name, i):
        if self.strong is not None:
            return self.strong
        root = self.owner()
        if root is None:
            raise RuntimeError(f"graph launch: argument {i} of {name} is memory freed since the capture")
        flat = root.reshape(-1).view(_np.uint8)
        return flat[self.offset:self.offset + self.dtype.itemsize * int(_np.prod(self.shape))].view(
            self.dtype).reshape(self.shape)


class _Stream:
    """A stream that can capture: between ``begin_capture`` and ``end_capture`` launches are recorded, not
    run, and a sync, an upload or an array op raises."""

    def __init__(self, non_blocking=False, null=False, ptds=False):
        self.capturing = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def begin_capture(self, mode=None):
        if _state.get("capture") is not None:
            raise RuntimeError("a stream capture is already open")
        _state["capture"] = []
        self.capturing = True

    def end_capture(self):
        if not self.capturing:
            raise RuntimeError("end_capture without begin_capture on this stream")
        launches, _state["capture"], self.capturing = _state["capture"], None, False
        return _Graph(launches)

    def is_capturing(self):
        return self.capturing

    def synchronize(self):
        _outside_capture("a stream synchronize")

    def record(self, event=None):
        _outside_capture("an event record across streams")
        event = event if event is not None else _Event()
        event.record(self)
        return event

    def wait_event(self, event):
        _outside_capture("a wait on an event")
        if not isinstance(event, _Event) or not hasattr(event, "t"):
            raise RuntimeError("wait_event on an event never recorded")


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
        self.before = _state.get("device", 0)
        _state["device"] = self.id                # arrays made inside are on this device
        return self

    def __exit__(self, *exc):
        _state["device"] = self.before
        return False

    def synchronize(self):
        pass


class _Pool:
    def free_all_blocks(self):
        pass


def get_default_memory_pool():
    return _Pool()


_null_stream = _Stream(null=True)

cuda = types.SimpleNamespace(
    Device=_Device, Event=_Event, Stream=_Stream, get_current_stream=lambda: _null_stream,
    get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, runtimeGetVersion=lambda: 12090,
                                  getDeviceProperties=lambda d: {"name": b"fake GPU (numpy + CUDA emulation)"}),
    is_available=lambda: True)
