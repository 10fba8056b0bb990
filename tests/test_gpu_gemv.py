"""The packed GEMV kernels (kernels/gemv_packed.cu) without a GPU: the CPU emulation of the exact source
text against a float64 oracle over gguf-py's dequantization of the same bytes, planted bugs that the oracle
must catch, the launch plan's refusals, and the CuPy launcher through the fake CuPy. The oracle tests run
again on a device (tests/test_gpu_device.py imports them).

The NVRTC compile check of these kernels (sm_80, sm_90, 0 spills) is tests/test_gpu_nvrtc.py's, which
compiles every kind of ``gpu_source.SOURCES``, gemv included.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from _model_util import gemma_path, need_gemma, need_smollm2, smollm2_path
from cuda_emu import emu
from streamattn.kv.backends import gpu_gemv, gpu_source
from streamattn.kv.backends.gpu_gemv import GGUFMatrix

pytestmark = pytest.mark.skipif(not emu.have_compiler(), reason="g++ (C++20) is needed for the emulation harness")
ROOT = Path(__file__).resolve().parent.parent
TYPES = tuple(gpu_source.GEMV_TYPES)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")     # gguf-py dequantizes these but has no quantizer for them


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The emulation library of the gemv kernels alone (a few seconds, against 15-25 s for every kernel)."""
    specs = [n for n in gpu_source.all_specs() if n.split("_")[0] == "gemv"]
    return emu.build(tmp_path_factory.mktemp("gemv_emu"), sources={"gemv": gpu_source.source("gemv")}, specs=specs)


@pytest.fixture(scope="module")
def runner(library):
    return emu.Emulator(library, timeout_s=30)


def aligned(a: np.ndarray, align: int = 64) -> np.ndarray:
    """A C-contiguous copy of ``a`` whose data starts on an ``align``-byte boundary."""
    raw = np.empty(a.nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def random_matrix(rng, gguf_type: str, rows: int, cols: int) -> GGUFMatrix:
    """A [rows, cols] matrix of ``gguf_type``: gguf-py's quantization of N(0, 1) weights with row scales from
    0.1 to 10, or (K-quants) random block bytes with finite float16 super-block scales (every byte pattern
    is a valid block; what it means is what ``gguf.quants.dequantize`` says)."""
    qt = GGMLQuantizationType[gguf_type]
    if gguf_type not in K_QUANTS:
        w = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-2.3, 2.3, (rows, 1)))
        return GGUFMatrix(gguf_type=gguf_type, shape=(rows, cols), blocks=aligned(quantize(w.astype(np.float32), qt)))
    _, values, nbytes = gpu_source.GEMV_TYPES[gguf_type]
    raw = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    scales = (rng.uniform(1e-3, 2e-2, (rows, cols // values, 2)).astype(np.float16)).view(np.uint8)
    if gguf_type == "Q6_K":
        raw[..., 208:210] = scales[..., 0:2]      # d, at the block's end
    else:
        raw[..., 0:4] = scales                     # d, dmin
    return GGUFMatrix(gguf_type=gguf_type, shape=(rows, cols), blocks=aligned(raw.reshape(rows, -1)))


def oracle(w: GGUFMatrix, x: np.ndarray):
    """(y, bound) in float64: y = x W^T over gguf-py's dequantized weights, bound = |x| |W|^T."""
    wf = dequantize(np.asarray(w.blocks), GGMLQuantizationType[w.gguf_type]).astype(np.float64)  # [rows, cols]
    x64 = np.atleast_2d(x).astype(np.float64)                                                    # [batch, cols]
    return x64 @ wf.T, np.abs(x64) @ np.abs(wf).T


def error_ratio(y, w: GGUFMatrix, x) -> float:
    """max |y - y_oracle| / (cols 2^-23 |x| |W|^T): at most 1 for float32 accumulation.

    A float32 sum of n products is within n u sum |w x| of the exact one (u = 2^-24; Higham, "Accuracy and
    Stability of Numerical Algorithms", §3.1, gamma_n); each weight is a float32 rounding of d sc q - m,
    rounded by the kernel and by gguf-py in their own orders, at most another u |w| apart: 2 n u covers both
    for n >= 2.
    """
    ref, bound = oracle(w, x)
    y = np.atleast_2d(np.asarray(y, np.float64))
    if not np.isfinite(y).all():
        return np.inf
    return float((np.abs(y - ref) / (w.shape[1] * 2.0 ** -23 * np.maximum(bound, 1e-30))).max())


def run(runner, w: GGUFMatrix, x):
    """The runner's gemv (the emulator's; tests/test_gpu_device.py's on a device), out prefilled with NaN (an
    entry the kernel skips stays NaN)."""
    shape = (w.shape[0],) if x.ndim == 1 else (x.shape[0], w.shape[0])
    return runner.gemv(w, aligned(x), out=aligned(np.full(shape, np.nan, np.float32)))


# (rows, blocks per row, batch): one block and one row; rows past the last full block of 4 warps; a batch
# below an NB (3 -> NB 4); a batch past the widest NB (19 -> two launch rows of NB 16)
SHAPES = [(1, 1, 1), (19, 3, 1), (5, 2, 3), (6, 1, 19)]


@pytest.mark.parametrize("rows,blocks,batch", SHAPES)
@pytest.mark.parametrize("gguf_type", TYPES)
def test_gemv_matches_the_float64_oracle(runner, gguf_type, rows, blocks, batch):
    rng = np.random.default_rng(len(gguf_type) * 1000 + rows * 10 + batch)
    cols = blocks * gpu_source.GEMV_TYPES[gguf_type][1]
    w = random_matrix(rng, gguf_type, rows, cols)
    x = rng.standard_normal((batch, cols)).astype(np.float32)
    y = run(runner, w, x)
    assert y.shape == (batch, rows) and y.dtype == np.float32
    assert error_ratio(y, w, x) <= 1.0
    nb = gpu_gemv.batch_width(batch)
    assert runner.launches[-1] == gpu_source.gemv_name(gguf_type, nb) and nb >= min(batch, 16)


def test_one_vector_gives_one_row_and_every_width_agrees(runner):
    """1-D x gives y [rows]; the same vectors through NB 1, 2, 4, 8 and 16 give the same float32 sums (a
    lane's sum does not depend on the other vectors of its launch)."""
    rng = np.random.default_rng(9)
    w = random_matrix(rng, "Q4_K", 7, 512)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    one = np.stack([run(runner, w, x[b]) for b in range(3)])
    assert one.shape == (3, 7) and error_ratio(one, w, x[:3]) <= 1.0
    for batch in (2, 3, 5, 16):
        assert np.array_equal(run(runner, w, x[:batch])[:3], one[:batch])


def _file_rows(path: str, types) -> list[GGUFMatrix]:
    """The first 8 rows of the first matrix of each type in ``types`` in the file, their bytes as stored."""
    from streamattn.gguf.reader import GGUFFile
    found = {}
    for t in GGUFFile(path).tensors:
        name = t.tensor_type.name
        if len(t.shape) == 2 and name in types and name not in found:
            w = GGUFMatrix.from_tensor(t)
            found[name] = GGUFMatrix(gguf_type=name, shape=(8, w.shape[1]), blocks=aligned(np.asarray(w.blocks[:8])))
    assert sorted(found) == sorted(types), f"{path} holds {sorted(found)}, expected {sorted(types)}"
    return list(found.values())


@need_smollm2
def test_smollm2_file_rows(runner):
    """SmolLM2's Q4_1 and Q8_0 matrices, read from the file's bytes, against the oracle over the same bytes."""
    rng = np.random.default_rng(1)
    for w in _file_rows(smollm2_path(), ("Q4_1", "Q8_0")):
        x = rng.standard_normal((2, w.shape[1])).astype(np.float32)
        assert error_ratio(run(runner, w, x), w, x) <= 1.0, w.gguf_type


@need_gemma
def test_gemma3_file_rows(runner):
    """Gemma-3's Q4_K, Q6_K, Q5_0 and Q8_0 matrices, from the file's bytes."""
    rng = np.random.default_rng(2)
    for w in _file_rows(gemma_path(), ("Q4_K", "Q6_K", "Q5_0", "Q8_0")):
        x = rng.standard_normal((2, w.shape[1])).astype(np.float32)
        assert error_ratio(run(runner, w, x), w, x) <= 1.0, w.gguf_type


BUGS = {  # name -> (GGUF type, exact text in gemv_packed.cu, planted text)
    "Q4_0 offset 7": ("Q4_0", "SA_GGML_Q4_0 ? SA_TWO23 + 8.0f", "SA_GGML_Q4_0 ? SA_TWO23 + 7.0f"),
    "Q4_1 min dropped": ("Q4_1", "w[4 * half + e] += m;", "w[4 * half + e] += 0.0f;"),
    "Q5_0 fifth bits of the wrong half": ("Q5_0", "(qh >> (16 * half + 4 * p + e))", "(qh >> (4 * p + e))"),
    "Q8_0 second group at the first's columns": ("Q8_0", "off[i] = 8 * p + 4 * i;", "off[i] = 8 * p;"),
    "Q4_K 5-bit scales": ("Q4_K", "a = sa_kbyte(s0, s1, s2, j) & 63u;", "a = sa_kbyte(s0, s1, s2, j) & 31u;"),
    "Q5_K fifth bit of the even sub-block": ("Q5_K", ">> (2 * c + s)) & 0x01010101u", ">> (2 * c)) & 0x01010101u"),
    "Q6_K scale byte": ("Q6_K", "(8 * (l / 16 + 2 * (t & 1)))", "(8 * (l / 16 + (t & 1)))"),
    "last piece of a row skipped": ("Q6_K", "j < blocks * PIECES;", "j < blocks * PIECES - 1;"),
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """One emulation library holding every planted variant, each its own kind ``bug{i}``, at NB 4 (one g++ run:
    a build's time is mostly the headers)."""
    text = gpu_source.source("gemv")
    sources, entries = {}, {}
    for i, (gguf_type, old, new) in enumerate(BUGS.values()):
        assert text.count(old) == 1, f"planted-bug anchor not found once: {old!r}"
        sources[f"bug{i}"] = text.replace(old, new)
        entries[f"bug{i}"] = (f"bug{i}", gpu_source.name_expression(gpu_source.gemv_name(gguf_type, 4)))
    return emu.Emulator(emu.build(tmp_path_factory.mktemp("gemv_planted"), sources=sources, entries=entries),
                        timeout_s=30)


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bug_is_caught(runner, planted, bug):
    """Each kernel with one planted bug fails the oracle by far; the unplanted text passes the same case."""
    gguf_type = BUGS[bug][0]
    rng = np.random.default_rng(4)
    cols = 2 * gpu_source.GEMV_TYPES[gguf_type][1]
    w = random_matrix(rng, gguf_type, 5, cols)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    assert error_ratio(run(runner, w, x), w, x) <= 1.0
    variant = f"bug{list(BUGS).index(bug)}"

    def launch(name, grid, block, args):      # the plan's launch, sent to this bug's variant
        assert name == gpu_source.gemv_name(gguf_type, 4)
        planted.launch(variant, grid, block, args)
    out = aligned(np.full((3, 5), np.nan, np.float32))
    assert error_ratio(gpu_gemv.gemv_with(np, launch, w, aligned(x), out=out), w, x) > 100


def _no_launch(*args):
    raise AssertionError("a refused call must not launch")


def test_refusals_name_the_argument():
    rng = np.random.default_rng(5)
    w = random_matrix(rng, "Q8_0", 4, 64)
    x = aligned(np.zeros(64, np.float32))
    with pytest.raises(ValueError, match=r"gguf_type must be one of Q4_0, .*\(got 'Q2_K'\)"):
        GGUFMatrix(gguf_type="Q2_K", shape=(4, 256), blocks=np.zeros((4, 84), np.uint8))
    with pytest.raises(ValueError, match=r"cols of a Q4_K matrix must be a multiple of its 256-value block \(got 640\)"):
        GGUFMatrix(gguf_type="Q4_K", shape=(4, 640), blocks=np.zeros((4, 360), np.uint8))
    with pytest.raises(ValueError, match=r"blocks of a Q8_0 matrix \(4, 64\) must be uint8 \(4, 68\) \(got uint8 \(4, 66\)\)"):
        GGUFMatrix(gguf_type="Q8_0", shape=(4, 64), blocks=np.zeros((4, 66), np.uint8))
    with pytest.raises(ValueError, match=r"shape must be \(rows, cols\)"):
        GGUFMatrix(gguf_type="Q8_0", shape=(0, 64), blocks=np.zeros((0, 68), np.uint8))
    with pytest.raises(ValueError, match=r"C-contiguous"):
        GGUFMatrix(gguf_type="Q8_0", shape=(4, 64), blocks=np.zeros((4, 136), np.uint8)[:, ::2])
    with pytest.raises(ValueError, match=r"x must be \[cols\] or \[batch, cols\] with cols = 64 \(got shape \(2, 32\)\)"):
        gpu_gemv.gemv_with(np, _no_launch, w, np.zeros((2, 32), np.float32))
    with pytest.raises(TypeError, match=r"x must be C-contiguous float32 \(got float64"):
        gpu_gemv.gemv_with(np, _no_launch, w, np.zeros(64))
    with pytest.raises(ValueError, match=r"batch 0"):
        gpu_gemv.gemv_with(np, _no_launch, w, aligned(np.zeros((0, 64), np.float32)))
    with pytest.raises(ValueError, match=r"x must start on a 16-byte boundary"):
        gpu_gemv.gemv_with(np, _no_launch, w, aligned(np.zeros(65, np.float32))[1:])
    with pytest.raises(ValueError, match=r"out must be C-contiguous float32 \(4,\) \(got float32 \(1, 4\)\)"):
        gpu_gemv.gemv_with(np, _no_launch, w, x, out=np.zeros((1, 4), np.float32))
    with pytest.raises(TypeError, match=r"weight must be a GGUFMatrix \(got ndarray\)"):
        gpu_gemv.gemv_with(np, _no_launch, np.zeros((4, 64), np.float32), x)


def test_launcher_through_the_fake_cupy(tmp_path, library):
    """streamattn.kv.backends.gpu.upload + gemv, CuPy calls and all, on the fake CuPy over the emulation: the
    result matches the oracle, out= is written in place, and host arrays are refused by name."""
    rng = np.random.default_rng(6)
    w = random_matrix(rng, "Q6_K", 9, 512)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    np.save(tmp_path / "blocks.npy", np.asarray(w.blocks))
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import json
        import cupy, numpy as np
        from streamattn.kv.backends import gpu
        from streamattn.kv.backends.gpu_gemv import GGUFMatrix
        host = GGUFMatrix(gguf_type="Q6_K", shape=(9, 512), blocks=np.load({str(tmp_path / 'blocks.npy')!r}))
        w = gpu.upload(host)
        x = cupy.asarray(np.load({str(tmp_path / 'x.npy')!r}))
        out = cupy.empty((2, 9), cupy.float32)
        y = gpu.gemv(w, x, out=out)
        try:
            gpu.gemv(host, x)
            refused = ""
        except TypeError as err:
            refused = str(err)
        print(json.dumps(dict(y=y.get().tolist(), same=y is out, refused=refused)))
        """)
    env = dict(os.environ, STREAMATTN_FAKE_CUPY_LIB=str(library), PYTHONPATH=f"{ROOT / 'tests' / 'fake_cupy'}:{ROOT}")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["same"] and error_ratio(np.array(result["y"], np.float32), w, x) <= 1.0
    assert result["refused"].startswith("weight.blocks must be a cupy.ndarray on the device (got ndarray)")


def test_the_loader_keeps_gemv_types_as_the_files_bytes(tmp_path):
    """load_gguf(weights="gguf") (what --backend gpu loads): a matrix of a gemv type is a GGUFMatrix over
    exactly the file's bytes, another stays float32; a block with a NaN scale is refused by name."""
    from _model_util import write_tiny_gguf
    from streamattn.runtime.files import ModelFileError
    from streamattn.gguf.loader import load_gguf
    from streamattn.gguf.reader import GGUFFile
    kw = dict(arch="llama", n_layers=1, d_model=64, n_heads=1, n_kv_heads=1, head_dim=64, d_ff=64, vocab=40,
              quant={"attn_q": "Q8_0", "ffn_down": "Q4_1"})
    path = write_tiny_gguf(tmp_path / "a.gguf", **kw)
    m = load_gguf(path, weights="gguf")
    file = {t.name: np.asarray(t.data) for t in GGUFFile(str(path)).tensors}
    q, down = m.weights["blk.0.attn_q.weight"], m.weights["blk.0.ffn_down.weight"]
    assert (q.gguf_type, q.shape, down.gguf_type) == ("Q8_0", (64, 64), "Q4_1")
    assert np.array_equal(q.blocks, file["blk.0.attn_q.weight"]) and q.blocks.flags.c_contiguous
    k = m.weights["blk.0.attn_k.weight"]
    assert isinstance(k, np.ndarray) and k.dtype == np.float32 and k.shape == (64, 64)
    bad = write_tiny_gguf(tmp_path / "b.gguf", nan_tensor="blk.0.attn_q.weight", **kw)
    with pytest.raises(ModelFileError, match=r"tensor 'blk.0.attn_q.weight' holds NaN or inf"):
        load_gguf(bad, weights="gguf")
