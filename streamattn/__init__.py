"""streamattn: exact streaming attention over ring KV caches (Numba on CPU, CuPy on GPU)."""

from .runtime import threads as _threads  # first: sets the thread runtimes' wait policy before numpy/numba load
from .runtime.memory import import_numba_arraymath as _import_numba_arraymath

_import_numba_arraymath()          # before the first kernel: see streamattn/runtime/memory.py
from .runtime.kernel_cache import lock_cache_saves as _lock_cache_saves

_lock_cache_saves()                # before the first cached kernel is saved: see streamattn/runtime/kernel_cache.py
from .kv.spec import CacheSpec
from .kv.cache import KVCache
from .kv.dispatch import attend

__all__ = ["CacheSpec", "KVCache", "attend"]
__version__ = "0.1.0"
