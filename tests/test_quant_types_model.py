"""Tiny models whose matrices are of the GGUF types Q5_1, Q5_K, Q3_K, Q2_K, IQ4_NL and IQ4_XS, and Q6_K
and Q4_K in their files' bytes ("q6k", "q4k"), packed,
against the same file loaded with ``weights="f32"`` (the float32 reference over the same dequantized
weights): logits of a prompt chunk and of decode steps, and the compiled layer against the array layer.

The kernels' own checks (each type against ``gguf.quants.dequantize``, odd shapes, batch invariance) are
in tests/test_quant_kernels.py.
"""

import numpy as np
import pytest

from _model_util import write_tiny_gguf
from streamattn.gguf.loader import load_gguf
from streamattn.models.transformer import Transformer
from streamattn.quant import matmul as qmatmul

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not qmatmul.HAVE_KERNELS, reason="the packed kernels need AVX2")]

NEW_TYPES = ["Q5_1", "Q5_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"]
#: K-quants held in their file's bytes (the layout of issue 52).
FILE_BYTES_TYPES = ["Q6_K", "Q4_K"]
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
#: d_model 256: one K-quant super-block per row of the q/k/v, gate/up and embedding matrices.
#: Matrices ~ N(0, 1/d_model): random blocks of the wider spread made logits chaotic (Q8_0 itself then
#: reached a cosine of only 0.98 against its float32 reference).
SIZE = dict(arch="llama", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512, vocab=96,
            matrix_scale=1 / 16)
PROMPT, STEPS = [5, 9, 3, 17, 4, 8, 60, 2, 33, 71, 12, 90], [40, 7, 88, 1, 23, 64]


def logits(tf):
    """float32 [len(PROMPT) + len(STEPS), vocab]: the prompt as one chunk, then decode steps of given
    tokens (not greedy ones: a near-tie would send the two paths different tokens)."""
    caches = tf.new_caches(batch=1, max_chunk=len(PROMPT))
    out = [tf.forward(np.array([PROMPT]), caches)[0]]
    out += [tf.forward(np.array([[t]]), caches)[0] for t in STEPS]
    return np.concatenate(out)


@pytest.mark.parametrize("type_name", NEW_TYPES + FILE_BYTES_TYPES)
def test_packed_logits_match_the_float32_reference(tmp_path, type_name):
    path = write_tiny_gguf(tmp_path / f"{type_name}.gguf", quant={m: type_name for m in MATRICES}, **SIZE)
    packed = load_gguf(path)
    assert {w.source for n, w in packed.weights.items() if n.endswith(tuple(f"{m}.weight" for m in MATRICES))} \
        == {type_name}
    tf = Transformer(packed)
    tf.compile_layers = False                   # the compiled layer: the test below
    got, want = logits(tf), logits(Transformer(load_gguf(path, weights="f32")))
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"\n{type_name}: min cosine {cos.min():.6f}, max rel err {err:.2e}")
    assert cos.min() >= 0.999 and err <= 0.02         # 8-bit activations (Q8_0 here: 0.99992, 0.004)
    assert want.std(axis=-1).min() > 0.1                # logits spread: the test can fail


def test_compiled_layer_runs_the_new_kinds_with_the_array_layers_bits(tmp_path):
    """One model holding each new kernel variant (q/k/v Q5_K: nibbles and fifth bits; output IQ4_XS: IQ4 levels;
    gate/up Q2_K and down Q3_K: nibbles with int8 16-column scales) through the compiled layers: the bits of the
    array layers, prompt chunk and decode steps."""
    quant = {"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q5_K", "attn_output": "IQ4_XS", "ffn_gate": "Q2_K",
             "ffn_up": "Q2_K", "ffn_down": "Q3_K"}
    tf = Transformer(load_gguf(write_tiny_gguf(tmp_path / "mixed.gguf", quant=quant, **SIZE)))
    tf.compile_layers = False
    want = logits(tf)
    tf.compile_layers = True
    got = logits(tf)
    assert tf._compiled is not None and all(w is not None for w in tf._compiled.weights)
    kinds = {(getattr(lw, f).kind, getattr(lw, f).group) for lw in tf.layers for f in ("wqkv", "wo", "wgu", "wdown")}
    assert kinds == {("q5", 32), ("nl", 32), ("q4s", 16)}
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("type_name,kind", [("Q6_K", ("q6k", 16)), ("Q4_K", ("q4k", 32))])
def test_compiled_layer_runs_the_file_bytes_kinds_with_the_array_layers_bits(tmp_path, type_name, kind):
    """Every matrix of a layer in a K-quant held in its file's bytes: the compiled layers take it (no layer left
    to the array code) and give the array layers' bits, prompt chunk and decode steps."""
    quant = {m: type_name for m in MATRICES if m != "token_embd"}
    tf = Transformer(load_gguf(write_tiny_gguf(tmp_path / f"{type_name}.gguf", quant=quant, **SIZE)))
    tf.compile_layers = False
    want = logits(tf)
    tf.compile_layers = True
    got = logits(tf)
    assert tf._compiled is not None and all(w is not None for w in tf._compiled.weights)
    assert {(getattr(lw, f).kind, getattr(lw, f).group) for lw in tf.layers
            for f in ("wqkv", "wo", "wgu", "wdown")} == {kind}
    np.testing.assert_array_equal(got, want)


def test_a_matrix_type_without_a_kernel_is_refused_before_any_packing(tmp_path, monkeypatch):
    """TQ2_0 (ternary) has no packed kernel: the error names the tensor and its type and lists what is
    supported, and comes before any matrix is packed; the float32 path loads it."""
    from streamattn.gguf import loader
    from streamattn.gguf.metadata import ModelFileError
    path = write_tiny_gguf(tmp_path / "tq.gguf", quant={"ffn_down": "TQ2_0"}, **SIZE)
    monkeypatch.setattr(loader, "pack", lambda *a, **k: pytest.fail("a matrix was packed before the refusal"))
    with pytest.raises(ModelFileError, match=r"tensor 'blk\.0\.ffn_down\.weight' has GGUF type TQ2_0, which has "
                                             r"no packed kernel \(supported: F32, .*Q5_1, Q5_K, Q3_K, Q2_K, IQ4_NL, "
                                             r"IQ4_XS\); load with weights='f32'"):
        load_gguf(path)
    monkeypatch.undo()
    assert load_gguf(path, weights="f32").weights["blk.0.ffn_down.weight"].dtype == np.float32


def test_matrices_of_two_kinds_run_compiled_with_the_array_layers_bits(tmp_path):
    """Llama-3.2's Q4_K_M mix: q and k Q4_K beside a Q6_K v (three row groups of two kinds in one wqkv), here
    also gate Q4_K beside up Q6_K (two). The array layers quantize the activations once for all the groups
    (``Matmuls.pieces``: each group's columns the bits of a call on it alone); the compiled layers take every
    layer and give the array layers' bits, on one thread and on two (each group's rows split over threads)."""
    import numba
    from streamattn.runtime.threads import many_threads
    quant = {m: "Q4_K" for m in MATRICES if m != "token_embd"} | {"attn_v": "Q6_K", "ffn_up": "Q6_K"}
    tf = Transformer(load_gguf(write_tiny_gguf(tmp_path / "q4_k_m.gguf", quant=quant, **SIZE)))
    lw = tf.layers[0]
    assert all(isinstance(lw.wqkv, tuple) and len(lw.wqkv) == 3 and isinstance(lw.wgu, tuple) for lw in tf.layers)
    assert [w.kind for w in lw.wqkv] == ["q4k", "q4k", "q6k"]
    x = np.random.default_rng(0).standard_normal((3, SIZE["d_model"]), dtype=np.float32)
    got = tf.matmuls.pieces(qmatmul.NORM, x, lw.attn_norm, 1e-5, lw.wqkv)
    np.testing.assert_array_equal(got, np.concatenate([tf.matmuls.norm(x, lw.attn_norm, 1e-5, w) for w in lw.wqkv], 1))
    tf.compile_layers = False
    want = logits(tf)
    tf.compile_layers = True
    np.testing.assert_array_equal(logits(tf), want)
    assert tf._compiled is not None and all(w is not None for w in tf._compiled.weights)
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        assert many_threads()
        np.testing.assert_array_equal(logits(tf), want)
        tf.compile_layers = False
        np.testing.assert_array_equal(logits(tf), want)
    finally:
        numba.set_num_threads(before)
