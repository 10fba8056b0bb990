"""Test support for cache-relative positions: a stream of UNrotated q/k/v, what the cache and the kernels
are given (keys rotated at absolute positions; queries rotated twice), and the float64 oracle that
rotates everything at cache positions itself (streamattn.kv.reference.attention_cache_positions)."""

from __future__ import annotations

import numpy as np

from oracle import rel_err
from streamattn import CacheSpec, KVCache
from streamattn.kv.reference import attention_cache_positions, cache_position, rope

BASE = 1e4


class PositionStream:
    """Feeds chunks of random raw q/k/v into a cache; yields the kernel inputs and the oracle's answer."""

    def __init__(self, spec: CacheSpec, q_heads: int, seed: int, *, device: str = "cpu"):
        self.spec, self.q_heads = spec, q_heads
        self.rng = np.random.default_rng(seed)
        self.cache = KVCache(spec, device=device) if device != "cpu" else KVCache(spec)
        self.k_raw = np.zeros((spec.kv_heads, 0, spec.head_dim))   # [kv_heads, L, d] unrotated history
        self.v = np.zeros((spec.kv_heads, 0, spec.head_dim))       # [kv_heads, L, d]

    def step(self, T: int):
        """Append T tokens (batch 1); return (q, q_sink) float32 [1, q_heads, T, d] and the oracle (out, lse)."""
        s, d = self.spec, self.spec.head_dim
        L0 = self.k_raw.shape[1]
        pos = np.arange(L0, L0 + T)                                            # [T] absolute positions
        k_raw = self.rng.standard_normal((s.kv_heads, T, d))
        v = self.rng.standard_normal((s.kv_heads, T, d)).astype(np.float32)
        q_raw = self.rng.standard_normal((self.q_heads, T, d))
        k_abs = rope(k_raw, pos, base=BASE).astype(np.float32)                 # what a model stores
        self.cache.append(k_abs[None], v[None])
        self.k_raw = np.concatenate([self.k_raw, k_raw], axis=1)
        self.v = np.concatenate([self.v, v], axis=1)
        q = rope(q_raw, pos, base=BASE).astype(np.float32)[None]              # [1, Hq, T, d]
        q_sink = rope(q_raw, cache_position(pos, window=s.window, sinks=s.sinks), base=BASE)
        ref = attention_cache_positions(q_raw, self.k_raw, self.v, pos, window=s.window, sinks=s.sinks,
                                        base=BASE)
        return q, q_sink.astype(np.float32)[None], ref


def check_gpu_plan(runner, *, head_dim: int, C: int, wraps: int = 3) -> int:
    """Stream through a sinks ring (window 5, 2 sinks, GQA 6/2) for ``wraps`` wraps with ``runner.attend``
    (the emulator, or a device runner: the GPU plan's kernels), decode with 2 splits when T == 1, prefill
    otherwise; assert each step equals the cache-position oracle. Returns the number of steps checked."""
    from streamattn.kv.reference import TOLERANCE
    spec = CacheSpec(batch=1, kv_heads=2, head_dim=head_dim, window=5, sinks=2, max_chunk=C)
    ps = PositionStream(spec, q_heads=6, seed=head_dim + C)
    total, step = 0, 0
    while total < wraps * spec.slots + 8:
        T = 1 + step % C
        q, q_sink, (ro, rl) = ps.step(T)
        c = ps.cache
        out, lse = runner.attend(q, c.k, c.v, c.lengths, np.array([T]), window=spec.window, sinks=spec.sinks,
                                 scale=head_dim ** -0.5, splits=2 if T == 1 else None, q_sink=q_sink)
        assert rel_err(out[0], ro) <= TOLERANCE["float32"], f"step {step} (T={T}, length {total + T})"
        assert np.abs(lse[0] - rl).max() <= 1e-4, f"lse at step {step}"
        total, step = total + T, step + 1
    return step
