"""Packed GGUF weights and their matmul kernels against ``gguf.quants.dequantize`` + a float64 matmul.

Every supported type, odd row counts, the matrix shapes of SmolLM2-135M and Gemma-3-270M. K-quants
and IQ4 (which gguf-py cannot quantize) are random block bytes with sane float16 scales.
"""

import gguf
import numba
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from _model_util import RANDOM_BLOCKS, random_blocks
from streamattn.quant.matmul import (GROUP_ROWS, HAVE_KERNELS, glu_quantize_rows, norm_quantize_rows, qmatmul,
                                       quantize_activations)
from streamattn.quant import amx
from streamattn.quant import matmul as qm
from streamattn.quant.kernels import LANES, LANES_VNNI, make_qdot
from streamattn.quant.weights import (INT_KINDS, SUPPORTED_TYPES, QWeight, UnsupportedWeightType, compact, concat_rows,
                                     floats, interleave, move_planes, pack, row_slice, widen_k, widen_q5_0)

pytestmark = pytest.mark.skipif(not HAVE_KERNELS, reason="packed kernels need x86 AVX2 (CI machines have it)")

# (rows, cols) of SmolLM2's q/k/v, wqkv, gate+up, down and Gemma's q, k, o, gate+up, down
SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (1024, 640), (256, 640), (640, 1024),
          (4096, 640), (640, 2048)]

#: One type per kernel variant that the new types brought ("q5": nibbles and fifth bits, as Q5_K; "nl": IQ4 levels,
#: as IQ4_XS; "q4s": int8 sub-block scales, as Q3_K): each compiles its drivers for every lane width and route.
NEW_KERNELS = ["Q5_1", "IQ4_NL", "Q2_K"]


def gguf_bytes(type_name: str, rows: int, cols: int, seed: int = 0):
    """A tensor of GGUF type ``type_name`` as GGUFReader gives it: (data, float64 values [rows, cols])."""
    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[type_name]
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if type_name == "F32":
        data = x
    elif type_name in RANDOM_BLOCKS:
        data = random_blocks(type_name, rows, cols, rng)
    else:
        data = quantize(x, qt)
    return data, dequantize(data, qt).astype(np.float64)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_pack_equals_gguf_dequantize(type_name):
    data, want = gguf_bytes(type_name, 37, 512)
    w = pack("blk.0.attn_q.weight", type_name, data, (37, 512))
    assert w.shape == (37, 512) and w.source == type_name
    np.testing.assert_array_equal(w.dequantize(), want.astype(np.float32))
    np.testing.assert_array_equal(w.rows(np.array([[5, 0], [36, 5]])), want.astype(np.float32)[[[5, 0], [36, 5]]])
    padded = 37 if type_name in ("F32", "F16", "BF16") else -(-37 // LANES) * LANES    # whole groups of rows
    assert w.nbytes <= (4 if type_name == "F32" else 2 if type_name in ("F16", "BF16") else 1.25) * padded * 512


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
@pytest.mark.parametrize("rows,batch", [(1, 1), (37, 3), (131, 2)])
def test_qmatmul_matches_float64_oracle(type_name, rows, batch):
    cols = 512
    data, w64 = gguf_bytes(type_name, rows, cols, seed=rows)
    w = pack("t", type_name, data, (rows, cols))
    x = np.random.default_rng(7).standard_normal((batch, cols)).astype(np.float32)
    got = qmatmul(x, w)
    assert got.shape == (batch, rows) and got.dtype == np.float32
    if w.kind in INT_KINDS:
        # exact up to float32 rounding against the activations the kernel multiplies ...
        xq, xd, *_ = quantize_activations(x)
        xdq = (xq.reshape(batch, -1, 32).astype(np.float64) * xd[:, :, None]).reshape(batch, cols)
        want = xdq @ w64.T
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        # ... and within the 8-bit activation rounding of the float64 product itself: half a step of
        # each activation's grid times |w| (random K-quant blocks have a wide range, so no fixed fraction)
        err = np.abs(got - x.astype(np.float64) @ w64.T)                                  # [batch, rows]
        bound = 0.5 * np.repeat(xd, 32, axis=1).astype(np.float64) @ np.abs(w64).T        # [batch, rows]
        assert np.all(err <= bound * (1 + 1e-3) + 2e-5 * np.abs(want).max())
        assert err.max() <= 2e-2 * np.abs(want).max() or type_name in RANDOM_BLOCKS     # gguf-quantized types
    else:
        want = x.astype(np.float64) @ w64.T
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_model_shapes(rows, cols):
    type_name = "Q4_K" if cols % 256 == 0 and rows % 2 else "Q4_1" if cols == 576 else "Q5_0"
    rows = rows + 1 if rows % 2 == 0 else rows                                         # odd row counts
    data, w64 = gguf_bytes(type_name, rows, cols)
    x = np.random.default_rng(3).standard_normal((2, cols)).astype(np.float32)
    xq, xd, *_ = quantize_activations(x)
    want = (xq.reshape(2, -1, 32) * xd[:, :, None].astype(np.float64)).reshape(2, cols) @ w64.T
    got = qmatmul(x, pack("t", type_name, data, (rows, cols)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q6_K", "F16"])
def test_batch_and_thread_invariance(type_name):
    """Row b of a batched call is bit-identical to b alone, serial or over 1 or 2 Numba threads."""
    data, _ = gguf_bytes(type_name, 97, 512)
    w = pack("t", type_name, data, (97, 512))
    x = np.random.default_rng(5).standard_normal((6, 512)).astype(np.float32)
    alone = np.concatenate([qmatmul(x[b:b + 1], w, parallel=False) for b in range(6)])
    before = numba.get_num_threads()
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(n)
            np.testing.assert_array_equal(qmatmul(x, w, parallel=True), alone)
            np.testing.assert_array_equal(qmatmul(x[2:5], w, parallel=True), alone[2:5])
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(qmatmul(x.reshape(2, 3, 512), w, parallel=False).reshape(6, 97), alone)


def test_errors():
    with pytest.raises(UnsupportedWeightType, match=r"tensor 'blk.3.ffn_up.weight' has GGUF type IQ2_XXS.*"
                                                    r"supported: .*IQ4_XS.*weights='f32'"):
        pack("blk.3.ffn_up.weight", "IQ2_XXS", np.zeros((2, 66), np.uint8), (2, 256))
    with pytest.raises(UnsupportedWeightType, match="has 288 columns, not a multiple of 256"):
        pack("w", "IQ4_XS", np.zeros((2, 153), np.uint8), (2, 288))
    with pytest.raises(UnsupportedWeightType, match="has 48 columns, not a multiple of 32"):
        pack("w", "Q8_0", np.zeros((2, 51), np.uint8), (2, 48))
    w = pack("w", "F32", np.ones((3, 32), np.float32), (3, 32))
    with pytest.raises(ValueError, match="x has 16 columns, the weight .* expects 32"):
        qmatmul(np.ones((1, 16), np.float32), w)


def _rows_alone(x, w):
    """Each row of x through the 1-row kernel alone: float32 [M, N]."""
    return np.concatenate([qmatmul(x[b:b + 1], w, parallel=False, group_rows=1) for b in range(x.shape[0])])


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_grouped_rows_equal_each_row_alone(type_name):
    """A call of M rows (groups of ROWS through the multi-row kernel, then the rest in one pass; under
    ROWS = 4 a decode batch of 8-15 rows starts with one 8-row pass) is bit-identical to every row alone,
    for M = 1..15 and a prefill-sized 37, any offset, 1 and 2 threads."""
    cols = 512
    data, _ = gguf_bytes(type_name, 19, cols, seed=11)
    w = pack("t", type_name, data, (19, cols))
    x = np.random.default_rng(12).standard_normal((40, cols)).astype(np.float32) * 3
    alone = _rows_alone(x, w)
    for m in list(range(1, 16)) + [37]:
        np.testing.assert_array_equal(qmatmul(x[:m], w, parallel=False), alone[:m], err_msg=f"M={m}")
    np.testing.assert_array_equal(qmatmul(x[3:40], w, parallel=False), alone[3:40])     # groups start at row 3
    before = numba.get_num_threads()
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(n)
            for m in (5, 15, 37):
                np.testing.assert_array_equal(qmatmul(x[:m], w, parallel=True), alone[:m], err_msg=f"M={m}, {n} thr")
    finally:
        numba.set_num_threads(before)


def _with_minus_128(type_name, data):
    """Q8_0 data whose first row's values are all -128 (|w| = 128, the most vpmaddubsw must take)."""
    if type_name != "Q8_0":
        return data
    data = data.copy()
    data.reshape(data.shape[0], -1, 34)[0, :, 2:] = 0x80
    return data


@pytest.mark.skipif(not LANES_VNNI, reason="this CPU has no VNNI: only the vpmaddubsw route exists here")
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K", *NEW_KERNELS])
def test_vnni_route_gives_the_same_bits(type_name):
    """vpdpbusd and vpmaddubsw + vpmaddwd give the same integer block sums, so the same bits: for every
    integer kind (Q8 with its -128 weights, K-quants' 16-column scales), 1 row and groups of R."""
    data, _ = gguf_bytes(type_name, 13, 512, seed=5)
    w = pack("t", type_name, _with_minus_128(type_name, data), (13, 512))
    x = np.random.default_rng(6).standard_normal((37, 512)).astype(np.float32) * 5
    x[0, :32] = [127.0] * 16 + [-127.0] * 16                  # a block at full scale: |x| reaches 127
    for r in (1, 4, 8):
        np.testing.assert_array_equal(qmatmul(x, w, parallel=False, group_rows=r, vnni=True),
                                      qmatmul(x, w, parallel=False, group_rows=r, vnni=False), err_msg=f"R={r}")


#: The types whose packed kind runs on the tile unit (amx.tiled); the rest keep the vector kernels (Q4_K
#: too since it is held in its file's bytes, "q4k": no tile unpacking of it yet, docs/DESIGN.md §19).
TILED_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS"]


@pytest.mark.skipif(not amx.AVAILABLE, reason="this CPU or OS has no usable AMX-INT8: only the vector kernels run")
@pytest.mark.parametrize("type_name", TILED_TYPES)
def test_amx_route_gives_the_same_bits(type_name):
    """Tile multiplies give the vector kernels' integer block sums, then the same epilogue: the same bits
    for every kind the tiles take (nibbles with mins, fifth bits, IQ4 levels with their -128 correction),
    for 16 rows and more with remainders of every size, serial and over threads."""
    super_blocks = type_name.endswith("_K") or type_name == "IQ4_XS"
    for cols in (768,) if super_blocks else (768, 736):           # 24 blocks (16 + 8), 23 (an odd tail)
        data, _ = gguf_bytes(type_name, 37, cols, seed=7)
        w = pack("t", type_name, data, (37, cols))
        assert amx.tiled(w.kind, w.group)                         # (else both sides ran the vector kernels)
        x = np.random.default_rng(8).standard_normal((53, cols)).astype(np.float32) * 5
        x[3, :32] = [127.0] * 16 + [-127.0] * 16                  # a block at full scale: |x| reaches 127
        x[20, 64:96] = -127.0
        want = qmatmul(x, w, parallel=False, amx=False)
        for m in (16, 17, 31, 32, 41, 53):
            np.testing.assert_array_equal(qmatmul(x[:m], w, parallel=False, amx=True), want[:m],
                                          err_msg=f"K={cols} M={m}")
        for r in GROUP_ROWS:
            np.testing.assert_array_equal(qmatmul(x, w, parallel=False, group_rows=r, amx=True), want,
                                          err_msg=f"K={cols} R={r}")
        np.testing.assert_array_equal(qmatmul(x, w, parallel=True, amx=True), want)
    assert qm.KernelPlan().amx == amx.DEFAULT            # models take them by default


def test_only_the_tiled_kinds_take_the_tiles():
    """Every integer type either takes the tile kernels or is left on the vector ones by choice."""
    kinds = {}
    for t in SUPPORTED_TYPES:
        if t not in ("F32", "F16", "BF16"):
            data, _ = gguf_bytes(t, 16, 768)
            w = pack("t", t, data, (16, 768))
            kinds[t] = amx.tiled(w.kind, w.group)
    assert [t for t, on in kinds.items() if on] == TILED_TYPES


def test_amx_plan_errors():
    with pytest.raises(ValueError, match="amx must be True or False"):
        qm.KernelPlan(amx="yes")
    if not amx.AVAILABLE:
        with pytest.raises(ValueError, match="amx=True needs AMX-INT8"):
            qm.KernelPlan(amx=True)
    with pytest.raises(ValueError, match="amx=True needs"):
        qm.KernelPlan(vnni=False, amx=True)
    assert not qm.KernelPlan(vnni=False).amx and not qm.KernelPlan(lanes=8).amx


#: Each type's block size and where its quantized bits lie (after the scales and mins; Q5's fifth bits and
#: Q6_K's high bit pairs included).
_QUANT_BYTES = {"Q4_0": (18, slice(2, None)), "Q4_1": (20, slice(4, None)), "Q5_0": (22, slice(2, None)),
                "Q5_1": (24, slice(4, None)), "Q4_K": (144, slice(16, None)), "Q5_K": (176, slice(16, None)),
                "Q6_K": (210, slice(0, 192))}


@pytest.mark.parametrize("type_name,fill", [*((t, 0xFF) for t in _QUANT_BYTES), ("Q6_K", 0x00)])
def test_int16_runs_are_exact_at_the_largest_sums(type_name, fill):
    """Without VNNI, runs of ``vpmaddubsw`` pairs are added in int16 before one ``vpmaddwd``
    (kernels.I16_RUN): every weight at its largest level (nibbles 15, fifth bits set: 31, Q6_K's 6 bits:
    63; and Q6_K at 0, the value -32 that its -32 sum(x) correction carries alone) against
    activation blocks at full scale (|xq| = 127) must still give the exact integer sums: an int16 that
    wrapped would be 65536 steps off. 1 row and groups of R, float64 oracle over the stored values."""
    size, quant = _QUANT_BYTES[type_name]
    data, _ = gguf_bytes(type_name, 13, 512, seed=11)
    data = data.copy()
    data.reshape(13, -1, size)[:, :, quant] = fill
    w64 = dequantize(data, gguf.GGMLQuantizationType[type_name]).astype(np.float64)
    w = pack("t", type_name, data, (13, 512))
    x = np.ones((8, 512), np.float32)
    x[1] = -1.0
    x[2] = np.repeat(np.tile([1.0, -1.0], 8), 32)               # blocks alternately all +127 and all -127
    x[3:] = np.random.default_rng(3).standard_normal((5, 512)) * 9
    xq, xd, *_ = quantize_activations(x)
    assert np.abs(xq[:3]).min() == 127
    want = (xq.reshape(8, -1, 32).astype(np.float64) * xd[:, :, None]).reshape(8, 512) @ w64.T
    for r in (1, 4, 8):
        got = qmatmul(x, w, parallel=False, group_rows=r, vnni=False)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=f"R={r}")


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K", *NEW_KERNELS])
def test_every_lane_width_gives_the_same_bits(type_name):
    """Groups of 8 rows (the AVX2 kernels' width) and of 16 (AVX-512, where this CPU has it) give every
    output element the same operations, so the same bits: K with one block to many, rows one by one and in groups of R, a row
    count that leaves the last group part-filled, both integer routes where this CPU has them."""
    cols = [256, 768] if RANDOM_BLOCKS.get(type_name, (32,))[0] == 256 else [32, 96, 576, 1536]
    for K in cols:
        data, _ = gguf_bytes(type_name, 13, K, seed=K)
        data = _with_minus_128(type_name, data)
        x = np.random.default_rng(K).standard_normal((37, K)).astype(np.float32) * 4
        x[0, :32] = [127.0] * 16 + [-127.0] * 16
        want = qmatmul(x, pack("t", type_name, data, (13, K), lanes=LANES), parallel=False, group_rows=1)
        for lanes in (8, 16) if LANES == 16 else (8,):
            w = pack("t", type_name, data, (13, K), lanes=lanes)
            for vnni in (False, True) if LANES_VNNI else (False,):
                for m, r in ((3, 4), (37, 4), (37, 8)):
                    np.testing.assert_array_equal(qmatmul(x[:m], w, parallel=False, group_rows=r, vnni=vnni), want[:m],
                                                  err_msg=f"K={K} lanes={lanes} vnni={vnni} M={m} R={r}")


def test_rows_bounds_lanes_and_rebinding():
    """rows() refuses ids past either end and counts negative ones from the end; interleave takes only the
    kernels' widths; the model's one-call matmul gives the same bits under another kernel plan (what
    benchmarks/prefill_rows.py builds) and looks its drivers up again when a plane is replaced."""
    data, w64 = gguf_bytes("Q8_0", 21, 64, seed=9)
    w = pack("t", "Q8_0", data, (21, 64))
    np.testing.assert_array_equal(w.rows(np.array([-1, 0])), w64[[20, 0]].astype(np.float32))
    for bad in (21, -22):
        with pytest.raises(IndexError, match=r"row ids must be in -21\.\.20 for a weight of 21 rows"):
            w.rows(np.array([0, bad]))
    with pytest.raises(ValueError, match="lanes must be 8 or 16, the kernels' vector widths \\(got 4\\)"):
        pack("t", "Q8_0", data, (21, 64), lanes=4)
    x = np.random.default_rng(2).standard_normal((1, 1, 64)).astype(np.float32)
    want = qmatmul(x[0], w, parallel=False)
    mm = qm.Matmuls(qm.KernelPlan())
    np.testing.assert_array_equal(mm.plain(x, w)[0], want)
    other = qm.Matmuls(qm.KernelPlan(rows=2 if qm.ROWS != 2 else 4))
    np.testing.assert_array_equal(other.plain(x, w)[0], want)
    assert other.drivers(w) is not mm.drivers(w)               # each table its own plan's drivers
    w.scale = w.scale.copy()
    w.scale[...] = 0
    np.testing.assert_array_equal(mm.plain(x, w), np.zeros((1, 1, 21), np.float32))
    del w
    assert mm._bound == {}                                      # a weight that is gone leaves the table


def test_interleaved_layout():
    """pack's q8 and q4 planes: groups of ``lanes`` rows; in block b, vector s, lane n holds four bytes of
    row n (q8: its values 4s..4s+3, plus 128; q4: its file bytes 4s..4s+3); scales [groups, blocks *
    lanes]; a part-filled last group is padded; row_slice cuts whole groups only."""
    rows, K, lanes = 11, 64, 8
    data, w64 = gguf_bytes("Q8_0", rows, K, seed=3)
    w = pack("t", "Q8_0", data, (rows, K), lanes=lanes)
    vals = data.reshape(rows, 2, 34)[..., 2:].view(np.int8)                     # [rows, blocks, 32]
    assert w.qs.shape == (2, 2 * 32 * lanes) and w.qs.dtype == np.uint8 and w.scale.shape == (2, 2 * lanes)
    got = w.qs.reshape(2, 2, 8, lanes, 4)                                      # [group, block, s, lane, 4]
    np.testing.assert_array_equal(got[1, 1, 5, 2], vals[lanes + 2, 1, 20:24].astype(np.int16) + 128)
    np.testing.assert_array_equal(got[0, 0, 0, 7], vals[7, 0, 0:4].astype(np.int16) + 128)
    d = np.ascontiguousarray(data.reshape(rows, 2, 34)[..., 0:2]).view(np.float16)[..., 0]   # [rows, blocks]
    assert floats(w.scale).reshape(2, 2, lanes)[1, 0, 2] == d[lanes + 2, 0]
    assert (floats(w.scale).reshape(2, 2, lanes)[1, :, rows - lanes:] == 0).all()       # padding rows
    data4, _ = gguf_bytes("Q4_1", rows, K, seed=4)
    w4 = pack("t", "Q4_1", data4, (rows, K), lanes=lanes)
    nib = data4.reshape(rows, 2, 20)[..., 4:]                                   # the file's 16 nibble bytes
    np.testing.assert_array_equal(w4.qs.reshape(2, 2, 4, lanes, 4)[0, 1, 3, 6], nib[6, 1, 12:16])
    np.testing.assert_array_equal(row_slice(w, lanes, rows).dequantize(), w64[lanes:].astype(np.float32))
    with pytest.raises(ValueError, match=r"rows 0\.\.5 of a weight interleaved by 8 rows"):
        row_slice(w, 0, 5)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_float16_scale_planes_give_the_bits_of_float32_ones(type_name):
    """pack stores scale and min planes as float16 bits where that is exact (the file's own float16
    scales always are: the K-quants' super-block d and -dmin too); the kernels widen them to the float32
    the other storage would hold: same bits, rows one by one and in groups."""
    K = 1536 if type_name in ("Q4_K", "Q6_K") else 576
    data, _ = gguf_bytes(type_name, 13, K, seed=7)
    w = pack("t", type_name, data, (13, K))
    assert w.scale.dtype == np.uint16 and (w.minv is None or w.minv.dtype == np.uint16)
    half = (lambda p: None if p is None else floats(p).astype(np.float16).view(np.uint16))
    w16 = QWeight(w.kind, w.shape, w.qs, half(w.scale), half(w.minv), w.group, w.source, w.lanes)
    w32 = QWeight(w.kind, w.shape, w.qs, floats(w16.scale), None if w.minv is None else floats(w16.minv),
                  w.group, w.source, w.lanes)
    assert w16.scale.dtype == np.uint16 and w32.scale.dtype == np.float32
    x = np.random.default_rng(1).standard_normal((11, K)).astype(np.float32)
    for m in (1, 2, 11):
        np.testing.assert_array_equal(qmatmul(x[:m], w16, parallel=False), qmatmul(x[:m], w32, parallel=False),
                                      err_msg=f"M={m}")


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K"])
def test_int8_sub_block_scales_give_the_bits_of_float_planes(type_name):
    """A "q4s" weight (super-block floats times the int8 sub-block scales and mins in its blocks) and a
    "q4" weight at group 16 whose planes hold those products: the same bits, 1 row and groups of rows."""
    data, _ = gguf_bytes(type_name, 21, 512, seed=8)
    w = pack("t", type_name, data, (21, 512))
    qs, scale, minv = w.row_major()
    b = qs.reshape(21, -1, 20)
    ints = b[..., 16:].view(np.int8).astype(np.float32)                         # [rows, K/32, 4]
    sc = np.repeat(scale, 16, 1) * ints[..., :2].reshape(21, -1)
    mn = np.repeat(minv, 16, 1) * ints[..., 2:].reshape(21, -1)
    w16 = interleave(QWeight("q4", w.shape, np.ascontiguousarray(b[..., :16]).reshape(21, -1), sc, mn, 16), LANES)
    assert w.kind == "q4s" and w16.scale.size == 16 * w.scale.size
    np.testing.assert_array_equal(w16.dequantize(), w.dequantize())
    x = np.random.default_rng(3).standard_normal((9, 512)).astype(np.float32)
    for m in (1, 9):
        np.testing.assert_array_equal(qmatmul(x[:m], w16, parallel=False), qmatmul(x[:m], w, parallel=False))


def test_compact_keeps_float32_where_float16_is_not_exact():
    exact, inexact = np.array([[0.5, -3.0]], np.float32), np.array([[0.1, 1.0]], np.float32)
    assert compact(exact).dtype == np.uint16 and (floats(compact(exact)) == exact).all()
    assert compact(inexact) is inexact
    # rows of both storages side by side (a fused q/k/v whose parts differ) are widened, not mixed bitwise
    a = interleave(QWeight("q8", (16, 64), np.ones((16, 64), np.int8), np.repeat(exact, 16, 0)), 16)
    b = interleave(QWeight("q8", (16, 64), np.ones((16, 64), np.int8), np.repeat(inexact, 16, 0)), 16)
    assert a.scale.dtype == np.uint16 and b.scale.dtype == np.float32
    np.testing.assert_array_equal(concat_rows([a, b]).dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))


def test_move_planes_into_one_buffer_keeps_values():
    ws, want = [], {}
    for i, t in enumerate(("Q4_1", "Q8_0", "Q6_K", "F16")):
        data, _ = gguf_bytes(t, 7 + i, 256, seed=i)
        ws.append((t, pack("t", t, data, (7 + i, 256))))
        want[t] = ws[-1][1].dequantize()
    got = {}
    move_planes(ws, lambda name, w: got.__setitem__(name, w))
    assert ws == [] and list(got) == list(want)
    bases = set()
    for t, w in got.items():
        np.testing.assert_array_equal(w.dequantize(), want[t])
        for p in (w.qs, w.scale, w.minv):
            if p is not None:
                assert p.flags.c_contiguous and p.ctypes.data % 64 == 0
                while p.base is not None:
                    p = p.base
                bases.add(id(p))
    assert len(bases) == 1                                           # one allocation holds every plane


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K", "BF16"])
def test_every_group_size_gives_the_same_bits(type_name):
    """Every supported group_rows R gives each row the bits of the 1-row kernel (M = 37: groups of R,
    then 37 % R rows in one pass; M = 3, 6, 7: every remainder kernel under R = 8)."""
    data, _ = gguf_bytes(type_name, 13, 256, seed=2)
    w = pack("t", type_name, data, (13, 256))
    x = np.random.default_rng(4).standard_normal((37, 256)).astype(np.float32)
    alone = _rows_alone(x, w)
    for r in GROUP_ROWS:
        for m in (3, 6, 7, 8, 13, 37):            # 8-15 rows: under R = 4 one 8-row pass first
            np.testing.assert_array_equal(qmatmul(x[:m], w, parallel=False, group_rows=r), alone[:m],
                                          err_msg=f"R={r}, M={m}")
    with pytest.raises(ValueError, match=r"group_rows must be one of \(1, 2, 4, 8\) \(got 3\)"):
        qmatmul(x, w, group_rows=3)


def _dequantized(xq, xd):
    """Activations as the kernels see them: float64 [M, K] = xq * xd per 32 columns."""
    return (xq.reshape(xq.shape[0], -1, 32) * xd[:, :, None].astype(np.float64)).reshape(xq.shape)


def _check_quantized(fn, args, want, rel):
    """fn(*args, xq, xd, xs, xc) quantizes rows whose float64 values are ``want`` [M, K]: each element
    within half a step of its 8-bit grid, plus ``rel`` of itself for float32 arithmetic and 1e-37 for
    values under float32's normal range (1.2e-38); xs = xd * sum(q) per 32, xc = -128 sum(q) per 16;
    rows 1..2 alone give the same bits as inside the batch."""
    M, K = want.shape
    acts = quantize_activations(np.zeros((M, K), np.float32))             # arrays of the right kinds
    fn(*args, *acts)
    xq, xd, xs, xc = acts
    step = np.repeat(xd, 32, axis=1).astype(np.float64)
    assert np.all(np.abs(_dequantized(xq, xd) - want) <= 0.5 * step * (1 + 1e-6) + rel * np.abs(want) + 1e-37)
    np.testing.assert_array_equal(xs, xd * xq.reshape(M, -1, 32).sum(-1).astype(np.float32))
    np.testing.assert_array_equal(xc, -128 * xq.reshape(M, -1, 16).sum(-1, dtype=np.int32))
    part = [np.empty((2,) + a.shape[1:], a.dtype) for a in acts]
    fn(*(a[1:3] if isinstance(a, np.ndarray) and a.ndim == 2 else a for a in args), *part)
    for got, full in zip(part, acts):
        np.testing.assert_array_equal(got, full[1:3])


@pytest.mark.parametrize("gelu", [False, True])
def test_fused_gated_activation_quantization(gelu):
    """glu_quantize_rows against the float64 activation, extremes included: g from -100 to 100 and from
    -12 to 12, where gelu's blocks of tiny values need g / (1 + e^-2z), not 1 + tanh z (which cancels to 0), and
    e^x past float32's range must give 0, not g * 6e-39."""
    F = 320
    gu = (np.random.default_rng(8).standard_normal((4, 2 * F)) * 4).astype(np.float32)
    gu[0, :F] = np.linspace(-100, 100, F)
    gu[3, :F] = np.linspace(-12, 12, F)                 # blocks of 2.4: some hold only tiny gelu values
    g, u = gu[:, :F].astype(np.float64), gu[:, F:].astype(np.float64)
    a = np.sqrt(8 / np.pi) * (g + 0.044715 * g ** 3) if gelu else g
    with np.errstate(over="ignore"):
        want = g / (1 + np.exp(-a)) * u
    _check_quantized(glu_quantize_rows, (gu, gelu), want, rel=1e-5)


def _q4_0_eye(n):
    """(data, shape) of an n x n Q4_0 identity (every row one 1.0: its block's scale 1/7 x 7 codes)."""
    return quantize(np.eye(n, dtype=np.float32), gguf.GGMLQuantizationType.Q4_0), (n, n)


def test_activation_blocks_are_rounded_as_defined():
    """The vectorised block quantizer gives, bit for bit, the float32 definition it replaced: d = amax /
    127, q = rint(y * (1 / d)) with ties to even, 0 where the block is 0; also for a row of a column slice
    (not C-contiguous as a whole). A block holding a NaN or an infinity: d = xs = NaN, q = 0, the other
    blocks as before, and the row's matmul outputs NaN."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((6, 192)) * rng.random((6, 1)) * 40).astype(np.float32)
    x[1, :32] = 0.0                                                  # a zero block: d = 0, q = 0
    x[2, :32] = [127.0] + [k + 0.5 for k in range(-15, 16)]           # d = 1: exact ties, to even
    x[3, 32:64] *= np.float32(1e-30)                                  # tiny but normal
    x[4, 64:96] = -np.float32(3e38)
    for src in (x, np.concatenate([x, x], axis=1)[:, 7:7 + 192]):
        xq, xd, xs, xc = quantize_activations(src)
        blocks = src.reshape(6, -1, 32)
        d = np.abs(blocks).max(-1) / np.float32(127.0)
        with np.errstate(divide="ignore"):
            inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
        q = np.rint(blocks * inv[..., None]).astype(np.int32)
        np.testing.assert_array_equal(xd, d)
        np.testing.assert_array_equal(xq, q.reshape(6, 192).astype(np.int8))
        with np.errstate(over="ignore"):                             # the 3e38 block's xs is -inf, both ways
            np.testing.assert_array_equal(xs, d * q.sum(-1).astype(np.float32))
        np.testing.assert_array_equal(xc, -128 * q.reshape(6, -1, 16).sum(-1))
        if src is x:
            assert list(xq[2, 1:32]) == [round(k + 0.5) for k in range(-15, 16)]      # Python's round: to even
    y = x.copy()
    y[0, 3], y[1, 40], y[2, 64:96], y[5, 100] = np.nan, np.inf, np.nan, -np.inf     # blocks 0, 1, 2, 3
    xq, xd, xs, xc = quantize_activations(y)
    bad = [(0, 0), (1, 1), (2, 2), (5, 3)]                               # (row, block): d = xs = NaN, q = 0
    for r, blk in bad:
        assert np.isnan(xd[r, blk]) and np.isnan(xs[r, blk]) and (xc[r, 2 * blk:2 * blk + 2] == 0).all()
        assert (xq[r, 32 * blk:32 * blk + 32] == 0).all()
    good = np.ones(xd.shape, bool)
    good[tuple(zip(*bad))] = False
    want = quantize_activations(x)
    np.testing.assert_array_equal(xd[good], want[1][good])
    np.testing.assert_array_equal(xs[good], want[2][good])
    assert np.isnan(qmatmul(y, pack("t", "Q4_0", *_q4_0_eye(192)), parallel=False)[[0, 1, 2, 5]]).all()


def test_fused_norm_quantization():
    x = (np.random.default_rng(9).standard_normal((4, 576)) * [[1], [1e-3], [30], [1]]).astype(np.float32)
    w = np.random.default_rng(10).standard_normal(576).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w
    _check_quantized(norm_quantize_rows, (x, w, 1e-5), want, rel=1e-4)


@pytest.mark.parametrize("gelu", [False, True])
def test_parallel_quantizers_give_the_serial_bits(gelu):
    """The quantizers split rows over threads in pieces (a prefill chunk's of 16 rows, a decode batch's
    smaller, so that 8 rows reach both threads): every row the same bits as the serial quantizer's, with
    1 and 2 threads, for decode batches of 1-9 rows and a row count that leaves a part-filled piece."""
    from streamattn.quant.activations import glu_quantize_rows_parallel, norm_quantize_rows_parallel
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((45, 576)) * 3).astype(np.float32)
    gu = (rng.standard_normal((45, 2 * 320)) * 3).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    cases = [(norm_quantize_rows, norm_quantize_rows_parallel, (x, w, 1e-5), 576),
             (glu_quantize_rows, glu_quantize_rows_parallel, (gu, gelu), 320)]
    before = numba.get_num_threads()
    try:
        for serial, parallel, args, K in cases:
            want = quantize_activations(np.zeros((45, K), np.float32))
            serial(*args, *want)
            for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
                numba.set_num_threads(n)
                for M in (*range(1, 10), 45):
                    got = quantize_activations(np.zeros((M, K), np.float32))
                    parallel(args[0][:M], *args[1:], *got)
                    for g, wnt in zip(got, want):
                        np.testing.assert_array_equal(g, wnt[:M], err_msg=f"{M} rows, {n} threads")
    finally:
        numba.set_num_threads(before)


_CACHE_PROBE = """
import numpy as np
from gguf.quants import quantize
import gguf
from streamattn.quant.weights import pack
from streamattn.quant.matmul import qmatmul
for name in ("Q4_1", "Q8_0", "F16"):
    data = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    data = data.astype(np.float16) if name == "F16" else quantize(data, gguf.GGMLQuantizationType[name])
    qmatmul(np.ones((1, 64), np.float32), pack("w", name, data, (8, 64)), parallel=False)
"""


def test_drivers_are_loaded_from_numba_cache_in_a_new_process():
    """The matmul drivers are closures over kernel intrinsics: their cache key must be the same in every
    process (it was not: each start compiled them anew, 0.3-1.3 s a weight kind, and the cache grew)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_DEBUG_CACHE="1")
    runs = [subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    second = [line for line in runs[1].stdout.splitlines() if "drivers" in line]
    assert any("data loaded" in line for line in second), second
    assert not any("saved" in line for line in second), second


def test_q5_0_is_held_in_five_bits_and_widened_beside_q8_0():
    """Q5_0 packs as "q5" (nibbles and a bit plane, min -16 d: the file's 0.69 B/w becomes 0.75, not 1.06);
    a row group whose other part is Q8_0 (Gemma-3's q and k beside its v) becomes one "q8" matrix holding the
    same values, each part's rows giving the bits its own matrix gives."""
    rows = 2 * LANES
    q, want_q = gguf_bytes("Q5_0", rows, 640, seed=3)
    v, want_v = gguf_bytes("Q8_0", LANES, 640, seed=4)
    pq, pv = pack("blk.0.attn_q.weight", "Q5_0", q, (rows, 640)), pack("blk.0.attn_v.weight", "Q8_0", v, (LANES, 640))
    assert pq.kind == "q5" and pq.nbytes <= 0.75 * rows * 640
    assert concat_rows([pq, pq]).kind == "q5"
    fused = concat_rows([pq, pv])
    assert fused.kind == "q8" and fused.source == "Q5_0+Q8_0"
    np.testing.assert_array_equal(fused.dequantize(), np.concatenate([want_q, want_v]).astype(np.float32))
    wide = widen_q5_0(pq)
    assert wide.kind == "q8" and wide.lanes == pq.lanes
    np.testing.assert_array_equal(wide.dequantize(), pq.dequantize())
    x = np.random.default_rng(5).standard_normal((3, 640)).astype(np.float32)
    np.testing.assert_array_equal(qmatmul(x, fused)[:, :rows], qmatmul(x, wide))
    np.testing.assert_allclose(qmatmul(x, pq), qmatmul(x, wide), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="widen_q5_0 takes a Q5_0 weight packed as 'q5'"):
        widen_q5_0(pv)


#: The K-quants held in their file's bytes, with the kind that holds them and the kind they had before
#: (widen_k: the sub-block scales multiplied out into float planes).
FILE_BYTES_KINDS = {"Q6_K": ("q6k", "q8"), "Q4_K": ("q4k", "q4")}


@pytest.mark.parametrize("type_name", list(FILE_BYTES_KINDS))
@pytest.mark.parametrize("rows", [1, 19, 37])
def test_k_quants_hold_the_files_bytes(type_name, rows):
    """Packed, a K-quant holds exactly its file's bytes per row (the last group's padding rows aside): the
    block bytes interleaved by rows, the float16 super-block scales in the scale plane; the layout before
    held up to half as much again. Both dequantize to gguf's values."""
    K = 768
    data, want = gguf_bytes(type_name, rows, K, seed=rows)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    for lanes in (8, 16):
        w = pack("t", type_name, data, (rows, K), lanes=lanes)
        padded = -(-rows // lanes) * lanes
        assert w.kind == FILE_BYTES_KINDS[type_name][0] and w.nbytes == padded * K // block * size
        wide = widen_k(w)
        assert wide.kind == FILE_BYTES_KINDS[type_name][1] and wide.lanes == lanes and wide.nbytes > 1.1 * w.nbytes
        np.testing.assert_array_equal(w.dequantize(), want.astype(np.float32))
        np.testing.assert_array_equal(wide.dequantize(), want.astype(np.float32))
    with pytest.raises(ValueError, match="widen_k takes a weight packed as"):
        widen_k(pack("t", "Q8_0", *gguf_bytes("Q8_0", 4, 64)[:1], (4, 64)))


def test_q6k_layout_is_the_files_bytes_in_the_order_read():
    """Lane n of word v of a "q6k" block holds row n's four file bytes at Q6K_WORDS[v] (+ 64, 32 or 8 in
    the second half of the super-block), and the scale plane holds each super-block's float16 d."""
    from streamattn.quant.levels import Q6K_WORDS
    rows, K, lanes = 11, 512, 8
    data, _ = gguf_bytes("Q6_K", rows, K, seed=3)
    b = data.reshape(rows, 2, 210)
    w = pack("t", "Q6_K", data, (rows, K), lanes=lanes)
    got = w.qs.reshape(2, 4, 26, lanes, 4)                                     # [group, block, word, lane, 4]
    for g, blk, v, n in ((0, 0, 0, 0), (1, 3, 25, 2), (0, 1, 4, 7), (1, 2, 17, 1), (0, 3, 12, 5)):
        at = Q6K_WORDS[v] + (blk % 2) * (64 if Q6K_WORDS[v] < 128 else 32 if Q6K_WORDS[v] < 192 else 8)
        np.testing.assert_array_equal(got[g, blk, v, n], b[g * lanes + n, blk // 2, at:at + 4])
    assert sorted(Q6K_WORDS) == list(range(0, 64, 4)) + list(range(128, 160, 4)) + [192, 196]
    d = np.ascontiguousarray(b[..., 208:210]).view(np.float16)[..., 0]         # [rows, super-blocks]
    assert w.scale.dtype == np.uint16 and floats(w.scale).reshape(2, 2, lanes)[1, 1, 2] == d[lanes + 2, 1]
    assert (w.qs.reshape(2, -1, lanes, 4)[1, :, rows - lanes:] == 0).all()       # padding rows


def test_q4k_layout_is_the_files_bytes():
    """Lane n of word v of a "q4k" super-block holds row n's four file bytes 4 + 4v .. 7 + 4v (the 6-bit
    scales and mins, then the nibbles, as in the file); the planes hold d and -dmin as float16."""
    rows, K, lanes = 11, 512, 8
    data, _ = gguf_bytes("Q4_K", rows, K, seed=6)
    b = data.reshape(rows, 2, 144)
    w = pack("t", "Q4_K", data, (rows, K), lanes=lanes)
    got = w.qs.reshape(2, 2, 35, lanes, 4)                                     # [group, super-block, word, lane, 4]
    for g, k, v, n in ((0, 0, 0, 0), (1, 1, 34, 2), (0, 1, 2, 7), (1, 0, 3, 1)):
        np.testing.assert_array_equal(got[g, k, v, n], b[g * lanes + n, k, 4 + 4 * v:8 + 4 * v])
    d = np.ascontiguousarray(b[..., 0:4]).view(np.float16)                      # [rows, super-blocks, 2]
    assert floats(w.scale).reshape(2, 2, lanes)[1, 1, 2] == d[lanes + 2, 1, 0]
    assert floats(w.minv).reshape(2, 2, lanes)[0, 1, 5] == -d[5, 1, 1]


@pytest.mark.parametrize("type_name", list(FILE_BYTES_KINDS))
def test_file_bytes_kinds_give_the_bits_of_the_layout_before(type_name):
    """The kernels on a K-quant in its file's bytes (sub-block scales applied in the kernel) and on the
    layout before (widen_k: the same float32 products in planes) give the same bits: every lane width and
    integer route this CPU has, 1 row and every group of rows, a prompt-sized M, serial and threaded."""
    data, _ = gguf_bytes(type_name, 21, 768, seed=4)
    x = np.random.default_rng(5).standard_normal((37, 768)).astype(np.float32) * 3
    x[0, :32] = [127.0] * 16 + [-127.0] * 16
    for lanes in (8, 16) if LANES == 16 else (8,):
        w = pack("t", type_name, data, (21, 768), lanes=lanes)
        wide = widen_k(w)
        for vnni in (False, True) if LANES_VNNI else (False,):
            for r in GROUP_ROWS:
                for m in (1, 5, 37):
                    np.testing.assert_array_equal(qmatmul(x[:m], w, parallel=False, group_rows=r, vnni=vnni),
                                                  qmatmul(x[:m], wide, parallel=False, group_rows=r, vnni=vnni),
                                                  err_msg=f"lanes={lanes} vnni={vnni} R={r} M={m}")
        np.testing.assert_array_equal(qmatmul(x, w, parallel=True), qmatmul(x, wide, parallel=False))


def test_touch_is_refused_for_kinds_without_it():
    """Only the "q4k" and "q6k" kernels take ``touch`` (a line a block prefetched ahead); another kind
    asked for it says so instead of compiling a kernel that ignores it."""
    with pytest.raises(ValueError, match=r"touch is for the 'q4k' and 'q6k' kinds \(got kind 'q8', touch=4096\)"):
        make_qdot("q8", 32, 1, touch=4096)
    assert make_qdot("q4k", 32, 1, touch=4096) is not make_qdot("q4k", 32, 1)
