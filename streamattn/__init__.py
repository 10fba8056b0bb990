"""streamattn: exact streaming attention over ring KV caches (Numba on CPU, CuPy on GPU)."""

from . import threads as _threads  # first: sets the thread runtimes' wait policy before numpy/numba load
from .spec import CacheSpec
from .cache import KVCache
from .dispatch import attend

__all__ = ["CacheSpec", "KVCache", "attend"]
__version__ = "0.1.0"
