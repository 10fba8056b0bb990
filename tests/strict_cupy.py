"""A strict stand-in for CuPy, so the device="gpu" code paths run on a machine without a GPU.

Arrays "on the device" wrap a numpy array. Like CuPy they refuse implicit conversion (``np.asarray(a)``
raises; ``a.get()`` copies to the host), and, stricter than CuPy, they refuse host arrays as operands,
indices or assigned values, so code that forgets ``xp.asarray`` / ``.get()`` fails here too. Only what
streamattn's cache, state and reference backend use is implemented. It proves the calls are consistent,
not that CUDA runs them: the real check is tests/test_state_fuzz.py::test_state_machine_gpu on a GPU.
"""

import numpy as np

__name__ = "cupy"  # noqa: A001  (KVCache's error messages print xp.__name__)
uint16, uint32, int32, float32 = np.uint16, np.uint32, np.int32, np.float32


def _host_refused(what):
    return TypeError(f"{what}: a host (numpy) array where a device array is needed; use cupy.asarray")


def _unwrap(x, what):
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray):
        raise _host_refused(what)
    if isinstance(x, tuple):
        return tuple(_unwrap(i, what) for i in x)
    return x


class ndarray:
    def __init__(self, a):
        self._a = a

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
                        "construct a NumPy array explicitly.")

    def get(self):
        return self._a.copy()

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)

    def __getitem__(self, i):
        return ndarray(self._a[_unwrap(i, "index")])

    def __setitem__(self, i, value):
        self._a[_unwrap(i, "index")] = _unwrap(value, "assigned value")

    def astype(self, dtype, copy=True):
        return ndarray(self._a.astype(dtype, copy=copy))

    def view(self, dtype):
        return ndarray(self._a.view(dtype))

    def copy(self):
        return ndarray(self._a.copy())

    def all(self):
        return ndarray(np.asarray(self._a.all()))

    def __bool__(self):
        return bool(self._a)

    def _op(self, other, fn):
        return ndarray(fn(self._a, _unwrap(other, "operand")))

    __rshift__ = lambda self, o: self._op(o, np.right_shift)      # noqa: E731
    __lshift__ = lambda self, o: self._op(o, np.left_shift)       # noqa: E731
    __and__ = lambda self, o: self._op(o, np.bitwise_and)         # noqa: E731
    __or__ = lambda self, o: self._op(o, np.bitwise_or)           # noqa: E731
    __gt__ = lambda self, o: self._op(o, np.greater)              # noqa: E731
    __add__ = lambda self, o: self._op(o, np.add)                 # noqa: E731
    __radd__ = __add__


def zeros(shape, dtype=float):
    return ndarray(np.zeros(shape, dtype))


def asarray(x, dtype=None):
    if isinstance(x, ndarray):
        return x if dtype is None else x.astype(dtype)
    return ndarray(np.array(x, dtype=dtype))   # the host -> device copy


def ascontiguousarray(x, dtype=None):
    return ndarray(np.ascontiguousarray(_unwrap(x, "argument"), dtype=dtype))


def where(condition, x, y):
    return ndarray(np.where(_unwrap(condition, "condition"), _unwrap(x, "x"), _unwrap(y, "y")))


def full(shape, fill_value, dtype=None):
    return ndarray(np.full(shape, fill_value, dtype))


def isfinite(x):
    return ndarray(np.isfinite(_unwrap(x, "argument")))
