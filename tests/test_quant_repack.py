"""streamattn.quant.repack: the compiled repacking of Q4_0, Q8_0, Q4_K and Q6_K gives the planes of the
numpy path (weights._PACKERS then weights.interleave) bit for bit, and QWeight.dequantize equals
gguf.quants.dequantize, on random blocks (random scales too: subnormal, huge, inf, NaN float16 patterns,
where NaN's sign bit is not compared)."""

import gguf
import gguf.quants
import numpy as np
import pytest

from streamattn.quant import weights
from streamattn.quant.repack import TYPES


def random_blocks(type_name, rows, cols, seed, finite=True):
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if finite:                          # float16 scale fields: exponent below 31 (no inf/NaN)
        at = {"Q6_K": (209,), "Q4_K": (1, 3)}.get(type_name, (1,))
        for a in at:
            b[..., a] &= 0x7B
    return b.reshape(rows, -1)


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("rows,cols", [(1, 256), (19, 512), (16, 256), (33, 768)])
def test_planes_equal_the_numpy_path(type_name, lanes, rows, cols):
    for finite in (True, False):
        raw = random_blocks(type_name, rows, cols, seed=rows * cols + lanes, finite=finite)
        got = weights.pack("w", type_name, raw, (rows, cols), lanes=lanes)
        block = 256 if type_name.endswith("_K") else 32
        ref = weights.interleave(weights._PACKERS[type_name](raw.reshape(rows, cols // block, -1), (rows, cols)), lanes)
        assert (got.kind, got.shape, got.group, got.source, got.lanes) == \
               (ref.kind, ref.shape, ref.group, ref.source, ref.lanes)
        for name in ("qs", "scale", "minv"):
            a, b = getattr(got, name), getattr(ref, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape, name
                if finite or name == "qs":
                    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name       # bit for bit
                else:       # inf * 0: a NaN whose sign bit may differ (such a file is refused at load)
                    assert np.array_equal(weights.floats(a), weights.floats(b), equal_nan=True), name
        if finite:
            want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(rows, cols)
            np.testing.assert_array_equal(got.dequantize(), want)


@pytest.mark.parametrize("extra", [[], [65520.0], [2.0 ** -25], [1 + 2.0 ** -11], [np.nan], [1e-40], [3 * 2.0 ** -24 + 2.0 ** -30]])
def test_compact_decides_as_numpy(extra):
    """The compiled float16 check and conversion (repack.compact) against weights.compact: zeros, the
    float16 extremes, subnormals, infinities; each extra value makes the plane stay float32."""
    from streamattn.quant import repack
    base = [0.0, -0.0, 1.0, -2.5, 65504.0, -65504.0, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -14, 1023 * 2.0 ** -24,
            6.103515625e-05, 0.000123, np.inf, -np.inf]
    half = np.array(base, np.float32).astype(np.float16).astype(np.float32)       # all exact
    plane = np.concatenate([half, np.array(extra, np.float32)]).reshape(1, -1)
    plane = np.repeat(plane, 3, 0)
    got, want = repack.compact(plane), weights.compact(plane)
    assert got.dtype == want.dtype == (np.uint16 if not extra else np.float32)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
