"""The embedding kernels (kernels/embed.cu) without a GPU: the CPU emulation of the exact source text gives
gguf.quants.dequantize's float32 rows bit for bit (times the model's embedding scale, rounded as the CPU
path rounds it) for every type of gpu_source.GEMV_TYPES, NaN rows for ids outside the matrix, a planted
bug that the comparison catches, and the plan's refusals. The NVRTC compile check (sm_80, sm_90, 0 spills)
is tests/test_gpu_nvrtc.py's, which compiles every kind of ``gpu_source.SOURCES``, embed included."""
from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from cuda_emu import emu
from streamattn.kv.backends import gpu_source
from streamattn.kv.backends.gpu_gemv import GGUFMatrix, embed_with
from test_gpu_gemv import aligned, random_matrix

pytestmark = pytest.mark.skipif(not emu.have_compiler(), reason="g++ (C++20) is needed for the emulation harness")
TYPES = tuple(gpu_source.GEMV_TYPES)
SPECS = [gpu_source.embed_name(t) for t in TYPES]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """The emulation library of the embed kernels alone (a few seconds)."""
    lib = emu.build(tmp_path_factory.mktemp("embed_emu"), sources={"embed": gpu_source.source("embed")}, specs=SPECS)
    return emu.Emulator(lib, timeout_s=30)


def expected(w: GGUFMatrix, ids, scale: float) -> np.ndarray:
    """The CPU path's rows: gguf-py's float32 dequantization, times float32(scale) where it is not 1."""
    rows = dequantize(np.asarray(w.blocks)[ids], GGMLQuantizationType[w.gguf_type]).astype(np.float32)
    return rows if scale == 1.0 else rows * np.float32(scale)


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("gguf_type", TYPES)
def test_rows_are_gguf_dequantize_bit_for_bit(runner, gguf_type):
    """Rows in any order, repeated, the first and the last (a row of 40 blocks of 32 values: 160 pieces, past
    one block of threads; of 3 K-quant blocks, 48 pieces), with the scale 1 and Gemma's sqrt(d_model)."""
    rng = np.random.default_rng(len(gguf_type))
    values = gpu_source.GEMV_TYPES[gguf_type][1]
    rows, cols = 11, (3 if values == 256 else 40) * values
    w = random_matrix(rng, gguf_type, rows, cols)
    ids = np.array([rows - 1, 0, 4, 4, 7], np.int32)
    for scale in (1.0, math.sqrt(640)):
        out = runner.embed(w, ids, scale=scale, out=aligned(np.full((ids.size, cols), np.nan, np.float32)))
        assert np.array_equal(bits(out), bits(expected(w, ids, scale))), gguf_type
    assert runner.launches[-1] == gpu_source.embed_name(gguf_type)


def test_ids_outside_the_matrix_give_nan_rows(runner):
    rng = np.random.default_rng(3)
    w = random_matrix(rng, "Q4_K", 5, 256)
    out = runner.embed(w, np.array([2, 5, -1, 0], np.int32))
    assert np.isnan(out[[1, 2]]).all()
    assert np.array_equal(bits(out[[0, 3]]), bits(expected(w, [2, 0], 1.0)))


def test_planted_bug_is_caught(tmp_path):
    """Values of a piece written one column apart in pairs: the bit comparison sees it in every type."""
    text = gpu_source.source("embed")
    planted = text.replace("orow[off[g] + e] = w[4 * g + e] * scale", "orow[off[g] + (e ^ 1)] = w[4 * g + e] * scale")
    assert planted != text
    lib = emu.build(tmp_path, sources={"embed": planted}, specs=SPECS)
    bad = emu.Emulator(lib, timeout_s=30)
    rng = np.random.default_rng(4)
    for gguf_type in ("Q8_0", "Q6_K"):
        w = random_matrix(rng, gguf_type, 3, gpu_source.GEMV_TYPES[gguf_type][1])
        ids = np.array([1, 2], np.int32)
        assert not np.array_equal(bits(bad.embed(w, ids)), bits(expected(w, ids, 1.0)))


def test_plan_refuses_bad_arguments():
    w = GGUFMatrix(gguf_type="Q8_0", shape=(2, 32), blocks=aligned(np.zeros((2, 34), np.uint8)))

    def never(*args):
        pytest.fail("launched")

    with pytest.raises(TypeError, match="ids must be"):
        embed_with(np, never, w, np.array([0, 1], np.int64))
    with pytest.raises(TypeError, match="ids must be"):
        embed_with(np, never, w, np.array([[0]], np.int32))
    with pytest.raises(ValueError, match="scale must be"):
        embed_with(np, never, w, np.array([0], np.int32), scale=float("nan"))
    with pytest.raises(ValueError, match="out must be"):
        embed_with(np, never, w, np.array([0], np.int32), out=np.empty((1, 31), np.float32))
    with pytest.raises(TypeError, match="GGUFMatrix"):
        embed_with(np, never, np.zeros((2, 32), np.float32), np.array([0], np.int32))
    assert embed_with(np, never, w, np.zeros(0, np.int32)).shape == (0, 32)
