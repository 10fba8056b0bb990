"""The benchmark's configurations: one ``Point`` per measurement, and the named suites of points.

``L`` is the number of keys the newest query sees, whatever the mode: causal caches hold L tokens;
window caches have n_c = L (sinks: 4 + (L - 4)) and have wrapped their ring (3L + 17 tokens seen).
Running them is streamattn/bench/sweep.py's job.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .. import CacheSpec
from ..kv.backends import gpu
from . import peers

SINKS = 4
MHA, GQA = (8, 8), (32, 8)
K1, K4, K16, K64 = 1024, 4096, 16384, 65536


@dataclass(frozen=True)
class Point:
    """One benchmark configuration for one implementation.

    phase: "decode" (one query per sequence), "prefill" (a chunk of T queries that see the cache and,
    causally, each other), "recompute" (all L queries of a causal history at once: what producing one
    new token costs without a KV cache, K/V projections aside).
    """

    impl: str = "cpu"            # cpu | gpu | numpy | torch
    phase: str = "decode"
    L: int = K4
    batch: int = 1
    q_heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    mode: str = "causal"         # causal | window | sinks
    T: int = 1                   # queries per sequence per call (recompute: L)

    def spec(self) -> CacheSpec:
        window = None if self.mode == "causal" else self.L - (SINKS if self.mode == "sinks" else 0)
        return CacheSpec(batch=self.batch, kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                         window=window, sinks=SINKS if self.mode == "sinks" else 0, max_chunk=self.T,
                         check_finite=False)

    @property
    def length(self) -> int:
        """Tokens each sequence has seen (a wrapped ring for window modes)."""
        return self.L if self.mode == "causal" else 3 * self.L + 17

    @property
    def bytes_read(self) -> int:
        """K and V bytes the call's queries must read: each visible key row once."""
        keys = self.L if self.mode == "causal" else self.L + self.T - 1
        s = self.spec()                            # a row's bytes: head_dim values, or quantized blocks
        row = s.k_width * s.storage_dtype.itemsize + s.v_width * s.storage_dtype_v.itemsize
        return self.batch * self.kv_heads * keys * row

    @property
    def new_tokens(self) -> int:
        """Tokens whose output one call produces (recompute: one, the point of the comparison)."""
        return self.batch * (self.T if self.phase == "prefill" else 1)

    def config(self):
        return replace(self, impl="")


# -- the sweeps ---------------------------------------------------------------------------------------

def suite(name: str, impls) -> list[Point]:
    """Points of a named suite ("quick", "decode", "modes", "batch", "prefill", "recompute", "full")."""
    pts: list[Point] = []
    if name in ("decode", "full"):     # issue 2's grid: B=1, causal
        for hq, hkv in (MHA, GQA):
            for d in (64, 128):
                for dt in ("float32", "float16"):
                    pts += [Point(L=L, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dt) for L in (K1, K4, K16, K64)]
    if name in ("modes", "full"):      # window / sinks rings and bfloat16 storage
        for mode in ("causal", "window", "sinks"):
            for dt in ("float16", "bfloat16"):
                pts += [Point(L=L, q_heads=32, kv_heads=8, dtype=dt, mode=mode) for L in (K1, K4, K16)]
    if name in ("batch", "full"):
        for hq, hkv in (MHA, GQA):
            pts += [Point(L=K4, batch=B, q_heads=hq, kv_heads=hkv, dtype="float16") for B in (1, 2, 4, 8)]
    if name in ("prefill", "full"):
        for mode in ("causal", "window"):
            for T in (16, 64):
                pts += [Point(phase="prefill", L=L, T=T, q_heads=32, kv_heads=8, dtype="float16", mode=mode)
                        for L in (K1, K4, K16)]
    if name in ("recompute", "full", "quick"):
        pts += [Point(L=K4), Point(phase="recompute", L=K4, T=K4)]
    if name == "quick":
        for hq, hkv in (MHA, GQA):
            for dt in ("float32", "float16"):
                pts += [Point(L=L, q_heads=hq, kv_heads=hkv, dtype=dt) for L in (K1, K16)]
        pts += [Point(L=K4, q_heads=32, kv_heads=8, dtype="float16", mode=m) for m in ("window", "sinks")]
        pts += [Point(phase="prefill", L=K4, T=64, q_heads=32, kv_heads=8, dtype="float16")]
    if not pts:
        raise ValueError(f"unknown suite {name!r}; choose from quick, decode, modes, batch, prefill, recompute, full")
    seen, out = set(), []
    for p in pts:
        for impl in impls:
            q = replace(p, impl=impl)
            if name == "quick" and impl in ("numpy", "torch") and p.dtype != "float32":
                continue                 # peers widen 16-bit caches whole: slow, and known to be (README figures)
            if q not in seen:
                seen.add(q)
                out.append(q)
    return out


def select(points, where: str | None) -> list[Point]:
    """Points whose fields match ``where`` ("L=16384,dtype=float32|float16"): the --where option."""
    if not where:
        return points
    want = {}
    for term in where.split(","):
        field, _, values = term.partition("=")
        if field not in Point.__dataclass_fields__:
            raise ValueError(f"--where: unknown field {field!r}; fields are {', '.join(Point.__dataclass_fields__)}")
        want[field] = set(values.split("|"))
    return [p for p in points if all(str(getattr(p, f)) in v for f, v in want.items())]


def available_impls() -> list[str]:
    """Implementations this machine can run: cpu and numpy always, gpu with a CUDA device, torch if installed."""
    impls = ["cpu", "numpy"]
    if gpu.available():
        impls.insert(1, "gpu")
    if peers.torch_available():
        impls.append("torch")
    return impls
