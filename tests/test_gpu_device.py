"""The oracle tests of test_gpu_emu.py, test_gpu_gemv.py and test_gpu_layer.py again, through real CuPy on a
CUDA device (marker ``gpu``).

Skipped as a whole where CuPy sees no device: the CPU emulation runs the same kernel text there.
"""
from __future__ import annotations

import numpy as np
import pytest

import gpu_oracle as go
from streamattn.kv.backends import gpu, gpu_gemv, gpu_plan

if not gpu.available():
    pytest.skip("no CUDA device through CuPy (the emulation tests cover the same kernels)",
                allow_module_level=True)

import cupy  # noqa: E402

# Collected again here, with the device runner below in place of the emulator.
from test_gpu_emu import (  # noqa: E402,F401
    test_cuda_kernels_emulated, test_cuda_kernels_emulated_k_and_v_apart, test_decode, test_every_padding_row,
    test_float16_queries_and_many_empty_splits, test_gqa_groups, test_prefill_chunk, test_soft_capped_scores,
    test_streaming_chunks_through_the_ring,
)
from gpu_cache_cases import (  # noqa: E402,F401
    test_append_outside_a_step_checks_at_once, test_non_finite_step_is_rolled_back, test_stream_equals_the_cpu_cache,
)
from test_gpu_gemv import (  # noqa: E402,F401
    test_gemv_matches_the_float64_oracle, test_one_vector_gives_one_row_and_every_width_agrees,
)
from test_gpu_layer import (  # noqa: E402,F401
    test_glu_matches_the_oracle, test_heads_rope_matches_the_oracle, test_residual_add_with_and_without_the_post_norm,
    test_rms_norm_matches_the_oracle,
)

pytestmark = pytest.mark.gpu


class DeviceRunner:
    """Same interface as the emulator: numpy in, numpy out, names of the kernels launched."""

    def __init__(self):
        self.launches: list[str] = []

    def _launch(self, name, grid, block, args):
        self.launches.append(name)
        gpu.launch(name, grid, block, args)

    def attend(self, q, k, v, lengths, counts, *, window, sinks, scale, splits=None, q_sink=None, softcap=None):
        if k.dtype.name == "bfloat16":
            k, v = k.view(np.uint16), v.view(np.uint16)
        out, lse = gpu_plan.attend_with(cupy, self._launch, cupy.asarray(q), cupy.asarray(k), cupy.asarray(v),
                                        np.asarray(lengths), np.asarray(counts), window=window, sinks=sinks,
                                        scale=scale, sm_count=gpu.sm_count(cupy.cuda.Device().id), splits=splits,
                                        q_sink=None if q_sink is None else cupy.asarray(q_sink), softcap=softcap)
        return out.get(), lse.get()

    def gemv(self, weight, x, *, out=None):
        y = gpu_gemv.gemv_with(cupy, self._launch, gpu.upload(weight), cupy.asarray(x),
                               out=None if out is None else cupy.asarray(out))
        return y.get()

    def layer(self, plan, *args, **kwargs):
        """A plan of gpu_layer on device copies of the numpy arguments; its arrays back on the host."""
        def dev(a):
            return cupy.asarray(a) if isinstance(a, np.ndarray) else a
        got = plan(cupy, self._launch, *map(dev, args), **{k: dev(a) for k, a in kwargs.items()})
        return tuple(a.get() for a in got) if isinstance(got, tuple) else got.get()


@pytest.fixture
def runner():
    return DeviceRunner()


@pytest.mark.parametrize("dtype", ("float16", "bfloat16", "q8_0", "q4_0"))
@pytest.mark.parametrize("window,sinks", [(0, 0), (4096, 4)])
def test_long_cache_default_splits(runner, dtype, window, sinks):
    """A 20k-token cache, GQA 32/8, head_dim 128: the split heuristic and the merge at real size."""
    rng = np.random.default_rng(1)
    c = go.case(rng, batch=2, q_heads=32, kv_heads=8, head_dim=128, lengths=[20000, 7001], counts=[1, 1], T=1,
                window=window, sinks=sinks, dtype=dtype)
    out, lse = runner.attend(c["q"], c["k"], c["v"], c["lengths"], c["counts"], window=window, sinks=sinks,
                             scale=c["scale"])
    assert runner.launches[-1].startswith("merge_"), "a 20k cache must be split"
    assert go.rel_err(out, c["ref_out"]) <= go.TOL[dtype] and go.lse_err(lse, c["ref_lse"]) <= go.TOL[dtype]


def test_public_attend_returns_device_arrays():
    rng = np.random.default_rng(2)
    c = go.case(rng, batch=1, q_heads=4, kv_heads=1, head_dim=64, lengths=[9], counts=[3], T=3, window=0,
                sinks=0, dtype="float16", q_dtype="float16")
    out, lse = gpu.attend(cupy.asarray(c["q"]), cupy.asarray(c["k"]), cupy.asarray(c["v"]), c["lengths"],
                          c["counts"], window=0, sinks=0, scale=c["scale"])
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16 and lse.dtype == cupy.float32
    assert go.rel_err(out.get(), c["ref_out"]) <= go.TOL["float16"]


@pytest.mark.parametrize("head_dim,C", [(64, 1), (128, 4)])
def test_cache_positions(runner, head_dim, C):
    """Sink keys scored with q_sink (positions within the cache) against the float64 oracle, every step."""
    from positions_case import check_gpu_plan
    check_gpu_plan(runner, head_dim=head_dim, C=C)


def test_float16_sinks_cache():
    """A q4_0 sinks cache on the device keeps its sinks in float16: the sink part and the quantized ring
    run through the GPU kernels and are merged (streamattn.kv.sink_parts); against the oracle over the stored
    values at every step, ragged chunks 1..3, GQA 4/1, >= 3 ring wraps."""
    from oracle import History, check
    from streamattn import CacheSpec, KVCache, attend
    spec = CacheSpec(batch=2, kv_heads=1, head_dim=64, dtype="q4_0", window=5, sinks=2, max_chunk=3)
    rng = np.random.default_rng(5)
    cache, hist = KVCache(spec, device="gpu"), History(spec.batch, spec)
    assert cache.sink_k is not None
    for step in range(3 * spec.slots):
        T = 1 + step % 3
        k, v = (rng.standard_normal((2, 1, T, 64)).astype(np.float32) for _ in range(2))
        counts = rng.integers(0, T + 1, size=2)
        cache.append(cupy.asarray(k), cupy.asarray(v), counts=counts)
        hist.append(k, v, counts)
        q = rng.standard_normal((2, 4, T, 64)).astype(np.float32)
        out, lse = attend(cupy.asarray(q), cache, backend="gpu")
        assert isinstance(out, cupy.ndarray)
        check(out, lse, q, hist, counts, spec, what=f"gpu step {step}")
    assert cache.lengths.min() > 3 * spec.slots // 2
