"""streamattn: exact streaming attention over ring KV caches (Numba on CPU, CuPy on GPU)."""

from .spec import CacheSpec
from .cache import KVCache
from .dispatch import attend

__all__ = ["CacheSpec", "KVCache", "attend"]
__version__ = "0.1.0"
