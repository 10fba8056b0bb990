"""The decoder layer's kernels (kernels/layer_ops.cu) without a GPU: the CPU emulation of the exact source
text through the launch plan (streamattn.kv.backends.gpu_layer) against float64 oracles, one planted bug per
kernel that the oracle catches, and the plan's refusals. The oracle tests run again on a device
(tests/test_gpu_device.py imports them; ``runner.layer`` runs a plan there).

The NVRTC compile check of these kernels (sm_80, sm_90, 0 spills) is tests/test_gpu_nvrtc.py's, which
compiles every kind of ``gpu_source.SOURCES``, layer included. A whole model through them (GpuOps on the fake
CuPy) is tests/test_model_gpu_dryrun.py's.
"""
from __future__ import annotations

import numpy as np
import pytest
from cuda_emu import emu

from streamattn.kv.backends import gpu_layer, gpu_source
from streamattn.models.rope import inverse_frequencies

pytestmark = pytest.mark.skipif(not emu.have_compiler(), reason="g++ (C++20) is needed for the emulation harness")

U = 2.0 ** -24      # float32's unit roundoff

# One planted bug per kernel: (where, the source text it replaces, what it puts there). Each must be caught.
PLANTED = {
    "norm_drops_a_warp": ("layer_norm", "for (int w = 0; w < SA_ROW_THREADS / 32; ++w) total",
                          "for (int w = 0; w < SA_ROW_THREADS / 32 - 1; ++w) total"),
    "residual_overwrites": ("layer_addnorm", "else d[i] += y;", "else d[i] = y;"),
    "rope_angle_in_float32": ("layer_heads_neox", "const double ang = p * inv_freq[i];",
                              "const double ang = (float)p * (float)inv_freq[i];"),
    "rope_sine_sign": ("layer_heads_interleaved", "out[ia] = a * cs + c * -sn;", "out[ia] = a * cs + c * sn;"),
    "bias_left_off_v": ("layer_heads_neox", "for (int i = lane; i < hd; i += 32) out[i] = at(i);",
                        "for (int i = lane; i < hd; i += 32) out[i] = x[i];"),
    "bias_left_off_a_pair_half": ("layer_heads_interleaved", "float a = at(ia), c = at(ib);",
                                  "float a = at(ia), c = x[ib];"),
    "silu_sign": ("layer_glu_silu", "a = g / (1.0f + expf(-g));", "a = g / (1.0f + expf(g));"),
    "gelu_constant": ("layer_glu_gelu", "(g + 0.044715f * g * g * g)", "(g + 0.44715f * g * g * g)"),
}


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """The emulator of the layer kernels alone, and of each planted variant under ``<bug>:<name>``."""
    text = gpu_source.source("layer")
    sources, entries = {"layer": text}, {n: ("layer", e) for n, e in gpu_source.LAYER_SPECS.items()}
    for i, (bug, (name, old, new)) in enumerate(PLANTED.items()):
        assert text.count(old) == 1, (bug, old)
        sources[f"bug{i}"] = text.replace(old, new)
        entries[f"{bug}:{name}"] = (f"bug{i}", gpu_source.LAYER_SPECS[name])
    lib = emu.build(tmp_path_factory.mktemp("layer_emu"), sources=sources, entries=entries)
    return emu.Emulator(lib, timeout_s=30)


def launcher(runner, bug: str | None = None):
    """``launch`` for the plan: the sound kernels, or ``bug``'s variant where it has one."""
    planted = PLANTED[bug][0] if bug else None
    return lambda name, grid, block, args: runner.launch(f"{bug}:{name}" if name == planted else name, grid, block,
                                                         args)


# ------------------------------------------------------------------ oracles (float64)
def rms_oracle(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def heads_oracle(h, pos, inv_freq, style, H, Hk, qk_norm, eps, scale, bias=None):
    B, T, width = h.shape
    hd = width // (H + 2 * Hk)
    x = (h.astype(np.float64) + (0.0 if bias is None else bias)).reshape(B, T, H + 2 * Hk, hd)
    qk = x[:, :, :H + Hk]
    if qk_norm is not None:
        qk = rms_oracle(qk, qk_norm, eps)
    ang = pos[:, :, None, None].astype(np.float64) * inv_freq                       # [B, T, 1, hd/2]
    c, s = np.cos(ang) * scale, np.sin(ang) * scale
    if style == "interleaved":
        a, b = qk[..., 0::2], qk[..., 1::2]
        rot = np.stack([a * c - b * s, b * c + a * s], -1).reshape(qk.shape)
    else:
        a, b = qk[..., :hd // 2], qk[..., hd // 2:]
        rot = np.concatenate([a * c - b * s, b * c + a * s], -1)
    return (rot[:, :, :H].transpose(0, 2, 1, 3), rot[:, :, H:].transpose(0, 2, 1, 3),
            x[:, :, H + Hk:].transpose(0, 2, 1, 3))


def glu_oracle(gu, activation):
    gu = gu.astype(np.float64)
    d = gu.shape[-1] // 2
    g, u = gu[..., :d], gu[..., d:]
    if activation == "silu":
        return g / (1 + np.exp(-g)) * u
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u


def ratio(got, ref, n: int) -> float:
    """Worst error over what float32 rounding allows: ``(n + 16) u`` of each row's largest magnitude (a sum of
    n float32 terms is within n u of the exact one; a few more roundings follow)."""
    ref = np.asarray(ref, np.float64)
    if not np.isfinite(got).all():
        return np.inf
    return float((np.abs(got - ref) / ((n + 16) * U * (np.abs(ref).max(axis=-1, keepdims=True) + 1e-30))).max())


def close(got, ref, n: int) -> bool:
    """:func:`ratio` at most 1."""
    return ratio(got, ref, n) <= 1.0


def rows(rng, shape, spread=True):
    x = rng.standard_normal(shape)
    if spread:
        x *= np.exp(rng.uniform(-2, 2, shape[:-1] + (1,)))
    return x.astype(np.float32)


# ------------------------------------------------------------------ RMSNorm and the residual
@pytest.mark.parametrize("shape", [(1, 1), (3, 33), (2, 3, 300)])
def test_rms_norm_matches_the_oracle(runner, shape):
    rng = np.random.default_rng(shape[-1])
    x, w = rows(rng, shape), rng.uniform(0.5, 2, shape[-1]).astype(np.float32)
    out = runner.layer(gpu_layer.rms_norm_with, x, w, 1e-6, out=np.full(shape, np.nan, np.float32))
    assert close(out, rms_oracle(x, w, 1e-6), shape[-1])
    assert runner.launches[-1] == "layer_norm"


@pytest.mark.parametrize("post", [False, True])
@pytest.mark.parametrize("shape", [(1, 5), (19, 257)])
def test_residual_add_with_and_without_the_post_norm(runner, shape, post):
    rng = np.random.default_rng(shape[0])
    x, y = rows(rng, shape), rows(rng, shape)
    w = rng.uniform(0.5, 2, shape[-1]).astype(np.float32) if post else None
    want = x.astype(np.float64) + (rms_oracle(y, w, 1e-5) if post else y)
    got = runner.layer(gpu_layer.residual_with, x.copy(), y, w, 1e-5)
    assert close(got, want, shape[-1])
    assert runner.launches[-1] == ("layer_addnorm" if post else "layer_add")


# ------------------------------------------------------------------ heads and RoPE
HEADS = [  # (B, T, H, Hk, hd, style, qk_norm, positions from): odd counts, a v-only block, hd below a warp's pairs
    (1, 1, 1, 1, 2, "neox", False, 0),
    (2, 3, 3, 1, 16, "interleaved", True, 7),
    (1, 2, 4, 2, 64, "neox", True, 100_000),        # angles of 1e5 radians: the phase needs float64
    (2, 1, 2, 1, 130, "interleaved", False, 5_000),  # 65 pairs: three rounds of a warp's lanes
]


@pytest.mark.parametrize("B,T,H,Hk,hd,style,norm,first", HEADS)
def test_heads_rope_matches_the_oracle(runner, B, T, H, Hk, hd, style, norm, first):
    rng = np.random.default_rng(hd + T)
    h = rows(rng, (B, T, (H + 2 * Hk) * hd))
    pos = (first + rng.integers(0, 50, (B, 1)) + np.arange(T)).astype(np.int32)
    inv = inverse_frequencies(1e4, hd, factors=rng.uniform(1, 8, hd // 2) if hd > 2 else None)
    qk_norm = rng.uniform(0.5, 2, (H + Hk, hd)).astype(np.float32) if norm else None
    scale = 1.0 if first % 2 == 0 else 1.0 + 0.1 * np.log(4.0)       # YaRN's attention factor on odd ones
    q, k, v = runner.layer(gpu_layer.heads_rope_with, h, pos, inv, style=style, n_heads=H, n_kv_heads=Hk,
                           qk_norm=qk_norm, eps=1e-6, scale=scale)
    rq, rk, rv = heads_oracle(h, pos, inv, style, H, Hk, qk_norm, 1e-6, scale)
    assert q.shape == (B, H, T, hd) and k.shape == v.shape == (B, Hk, T, hd)
    for got, ref in ((q, rq), (k, rk)):
        assert close(got, ref, hd)
    assert np.array_equal(v, rv.astype(np.float32))                  # v heads are copied
    assert runner.launches[-1] == f"layer_heads_{style}" + ("_qknorm" if norm else "")


@pytest.mark.parametrize("B,T,H,Hk,hd,style,norm,first", [HEADS[1], (2, 1, 2, 1, 64, "neox", False, 70_000)])
def test_heads_rope_adds_the_bias(runner, B, T, H, Hk, hd, style, norm, first):
    """Qwen2's q/k/v bias added in the kernel, before the per-head norm and the rotation, and to the v heads:
    the oracle over ``h + bias`` (a bias of the rows' size, so leaving it off anywhere is seen)."""
    rng = np.random.default_rng(hd + 1)
    h = rows(rng, (B, T, (H + 2 * Hk) * hd))
    bias = rows(rng, ((H + 2 * Hk) * hd,), spread=False)
    pos = (first + rng.integers(0, 50, (B, 1)) + np.arange(T)).astype(np.int32)
    inv = inverse_frequencies(1e6, hd)
    qk_norm = rng.uniform(0.5, 2, (H + Hk, hd)).astype(np.float32) if norm else None
    q, k, v = runner.layer(gpu_layer.heads_rope_with, h, pos, inv, style=style, n_heads=H, n_kv_heads=Hk,
                           qk_norm=qk_norm, eps=1e-6, bias=bias)
    rq, rk, rv = heads_oracle(h, pos, inv, style, H, Hk, qk_norm, 1e-6, 1.0, bias)
    for got, ref in ((q, rq), (k, rk)):
        assert close(got, ref, hd)
    assert np.array_equal(v, (h + bias).reshape(B, T, H + 2 * Hk, hd)[:, :, H + Hk:].transpose(0, 2, 1, 3))


def test_heads_rope_equals_the_cpu_path_at_its_tables(runner):
    """The kernel and array_ops.heads_rope over rope_tables at the same positions: the same float32 steps, so
    within a few roundings of each other (the sums of squares are reduced in another order)."""
    from streamattn.models.array_ops import heads_rope
    from streamattn.models.rope import rope_tables
    rng = np.random.default_rng(3)
    B, T, H, Hk, hd = 2, 3, 2, 1, 64
    h = rows(rng, (B, T, (H + 2 * Hk) * hd))
    pos = (rng.integers(0, 9000, (B, 1)) + np.arange(T)).astype(np.int32)
    inv, qk_norm = inverse_frequencies(1e6, hd), rng.uniform(0.5, 2, (H + Hk, hd)).astype(np.float32)
    for style in ("interleaved", "neox"):
        cos, sin = rope_tables(pos[:, :, None], inv, style, 1.25)
        want = heads_rope(np, h, cos, sin, style=style, n_heads=H, n_kv_heads=Hk, qk_norm=qk_norm, eps=1e-6)
        got = runner.layer(gpu_layer.heads_rope_with, h, pos, inv, style=style, n_heads=H, n_kv_heads=Hk,
                           qk_norm=qk_norm, eps=1e-6, scale=1.25)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=0, atol=8 * U * np.abs(b).max())


# ------------------------------------------------------------------ GLU
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(1, 2), (2, 3, 2 * 131)])
def test_glu_matches_the_oracle(runner, activation, shape):
    rng = np.random.default_rng(shape[-1])
    gu = (rng.standard_normal(shape) * 3).astype(np.float32)
    got = runner.layer(gpu_layer.glu_with, gu, activation)
    assert got.shape == shape[:-1] + (shape[-1] // 2,)
    assert close(got, glu_oracle(gu, activation), 8)


# ------------------------------------------------------------------ planted bugs
def _planted_case(runner, bug):
    """(got, reference, n) of the kernel ``bug`` lives in, on inputs that reach the bug, with its launcher."""
    rng = np.random.default_rng(11)
    launch = launcher(runner, bug)
    name = PLANTED[bug][0]
    if name in ("layer_norm", "layer_addnorm"):
        x, y, w = rows(rng, (3, 300)), rows(rng, (3, 300)), rng.uniform(0.5, 2, 300).astype(np.float32)
        if name == "layer_norm":
            return gpu_layer.rms_norm_with(np, launch, x, w, 1e-6), rms_oracle(x, w, 1e-6), 300
        got = x.copy()
        gpu_layer.residual_with(np, launch, got, y, w, 1e-6)
        return got, x + rms_oracle(y, w, 1e-6), 300
    if name.startswith("layer_heads"):
        style = name.split("_")[-1]
        h, hd = rows(rng, (1, 2, 3 * 64)), 64
        bias = rows(rng, (3 * 64,), spread=False)
        pos = np.array([[100_000, 100_001]], np.int32)
        inv = inverse_frequencies(1e4, hd)
        q, k, v = gpu_layer.heads_rope_with(np, launch, h, pos, inv, style=style, n_heads=1, n_kv_heads=1,
                                            bias=bias)
        rq, rk, rv = heads_oracle(h, pos, inv, style, 1, 1, None, 0.0, 1.0, bias)
        return np.concatenate([q, k, v]), np.concatenate([rq, rk, rv]), hd
    gu = (rng.standard_normal((2, 2 * 40)) * 3).astype(np.float32)
    act = "silu" if name.endswith("silu") else "gelu_tanh"
    return gpu_layer.glu_with(np, launch, gu, act), glu_oracle(gu, act), 8


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_oracle_catches_each_planted_bug(runner, bug):
    got, ref, n = _planted_case(runner, bug)
    assert runner.launches[-1] == f"{bug}:{PLANTED[bug][0]}"
    assert ratio(got, ref, n) > 10.0


# ------------------------------------------------------------------ refusals
def test_the_plan_refuses_bad_arguments_before_launching(runner):
    launch = launcher(runner)
    before = len(runner.launches)
    x = np.ones((2, 8), np.float32)
    with pytest.raises(TypeError, match="x must be a C-contiguous float32"):
        gpu_layer.rms_norm_with(np, launch, x.astype(np.float64), np.ones(8, np.float32), 1e-6)
    with pytest.raises(ValueError, match=r"w must have shape \(8,\)"):
        gpu_layer.rms_norm_with(np, launch, x, np.ones(7, np.float32), 1e-6)
    with pytest.raises(ValueError, match="style must be one of"):
        gpu_layer.heads_rope_with(np, launch, np.ones((1, 1, 12), np.float32), np.zeros((1, 1), np.int32),
                                  np.ones(2), style="gptj", n_heads=1, n_kv_heads=1)
    with pytest.raises(ValueError, match="hd even"):
        gpu_layer.heads_rope_with(np, launch, np.ones((1, 1, 9), np.float32), np.zeros((1, 1), np.int32),
                                  np.ones(1), style="neox", n_heads=1, n_kv_heads=1)
    with pytest.raises(TypeError, match="pos must be a C-contiguous int32"):
        gpu_layer.heads_rope_with(np, launch, np.ones((1, 1, 12), np.float32), np.zeros((1, 1), np.int64),
                                  np.ones(2), style="neox", n_heads=1, n_kv_heads=1)
    with pytest.raises(ValueError, match=r"bias must have shape \(12,\)"):
        gpu_layer.heads_rope_with(np, launch, np.ones((1, 1, 12), np.float32), np.zeros((1, 1), np.int32),
                                  np.ones(2), style="neox", n_heads=1, n_kv_heads=1, bias=np.ones(4, np.float32))
    with pytest.raises(ValueError, match="activation must be one of"):
        gpu_layer.glu_with(np, launch, x, "relu")
    with pytest.raises(ValueError, match="odd last axis"):
        gpu_layer.glu_with(np, launch, np.ones((2, 7), np.float32), "silu")
    assert len(runner.launches) == before


# ------------------------------------------------------------------ GpuOps in a model
@pytest.mark.parametrize("arch", ["gemma3", "qwen2:yarn", "llama"])
def test_gpu_ops_run_a_model_as_the_array_ops_do(runner, tmp_path, monkeypatch, arch):
    """A two-layer model whose layers run through GpuOps (these kernels, emulated, on numpy arrays with the
    CPU attention) gives the array ops' logits over greedy steps, RoPE from the device-side frequencies
    alone (the host tables are taken away); under positions="cache" on a sinks cache the model keeps the
    array ops, whose queries are also rotated at cache positions. The fake-CuPy runs of every architecture
    are tests/test_model_gpu_dryrun.py's."""
    from _model_util import write_tiny_gguf

    from streamattn.gguf.loader import load_gguf
    from streamattn.kv.backends import gpu
    from streamattn.models.transformer import Transformer

    name, _, scaling = arch.partition(":")
    path = write_tiny_gguf(tmp_path / "t.gguf", arch=name, n_layers=2, d_model=32, n_heads=2, n_kv_heads=1,
                           head_dim=64, d_ff=32, vocab=40, window=4, rope_freqs=name == "llama",
                           rope_scaling=scaling or None)
    ref, tf = Transformer(load_gguf(path)), Transformer(load_gguf(path))
    for m in (ref, tf):
        m.compile_layers = False
    host_rope = tf._rope
    tf.rope_device = {b: (inv, float(host_rope.scale[b])) for b, inv in host_rope.inv_freq.items()}
    monkeypatch.setattr(gpu, "launch", launcher(runner))
    tf._rope = None
    rc, gc = ref.new_caches(batch=2, max_chunk=3), tf.new_caches(batch=2, max_chunk=3)
    before = len(runner.launches)
    toks = np.array([[3, 17, 5], [9, 1, 30]])
    for _ in range(4):
        a = ref.forward(toks, rc, backend="cpu", last_only=True)
        b = tf.forward(toks, gc, backend="cpu", last_only=True)
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
        toks = a.argmax(-1)[:, None]
        assert (b.argmax(-1) == toks[:, 0]).all()
    ran = set(runner.launches[before:])
    assert {"layer_norm", f"layer_heads_{tf.config.rope_style}" + ("_qknorm" if tf.config.qk_norm else ""),
            "layer_addnorm" if tf.config.post_norms else "layer_add"} <= ran, ran

    tf._rope = host_rope
    rc = ref.new_caches(batch=1, max_chunk=3, mode="sinks", window=2, sinks=1)
    gc = tf.new_caches(batch=1, max_chunk=3, mode="sinks", window=2, sinks=1)
    for toks in (np.array([[1, 2, 3]]), np.array([[4]]), np.array([[5]])):
        a = ref.forward(toks, rc, backend="cpu", last_only=True, positions="cache")
        b = tf.forward(toks, gc, backend="cpu", last_only=True, positions="cache")
        np.testing.assert_array_equal(b, a)                     # the same array ops, the same bits
