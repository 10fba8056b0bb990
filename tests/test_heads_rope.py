"""heads_rope: the compiled CPU kernel against the array code it replaces, and both against float64.

The model calls one op, ``heads_rope``; on numpy it runs streamattn/models/heads_kernel.py, on any other
array module the numpy-style code ``_heads_rope_xp``. Here both run on the same inputs.

Tolerance between the two: none, bit for bit. The kernel does the same float32 operations in the same
order, and sums the per-head mean square in numpy's pairwise order. (Should a numpy release change the
order of its float32 ``sum``, only the qk_norm cases would differ, by an ulp of the norm; the fix is to
follow numpy in ``_pairwise_sum``, not to loosen this test.) Against the float64 oracle (complex rotations
written independently): 2e-6 relative to each head's largest value, float32 rounding of a few operations.
"""

import numpy as np
import pytest

from streamattn.models.heads_kernel import heads_rope_cpu
from streamattn.models.rope import ROPE_BLOCK, RopeTables, rope_tables
from streamattn.models.array_ops import _heads_rope_xp

# (n_heads, n_kv_heads, head_dim, style, qk_norm): the real layers, then odd sizes
SHAPES = {
    "smollm2": (9, 3, 64, "interleaved", False),    # SmolLM2-135M
    "gemma3": (4, 1, 256, "neox", True),            # Gemma-3-270M (head_dim > 128: pairwise halves)
    "tiny": (3, 3, 6, "neox", True),                # head_dim < 8: numpy sums one by one
    "odd": (5, 1, 80, "interleaved", True),         # 80: eight lanes and no tail; GQA group 5
}


def inputs(H, Hk, hd, B, T, *, base, seed):
    rng = np.random.default_rng(seed)
    scale = rng.uniform(1e-3, 1e2, (B, T, 1)).astype(np.float32)                    # rows of any size
    h = (rng.standard_normal((B, T, (H + 2 * Hk) * hd)) * scale).astype(np.float32)
    pos = rng.integers(0, 40_000, (B, 1)) + np.arange(T)                           # [B, T]
    inv_freq = 1.0 / base ** (np.arange(hd // 2, dtype=np.float64) * 2 / hd)
    w = rng.uniform(0.5, 2.0, (H + Hk, hd)).astype(np.float32)
    return h, pos, inv_freq, w


def oracle(h, pos, inv_freq, style, H, Hk, w, eps):
    """float64 q, k, v: norm per head, then each pair as a complex number turned by e^{i pos f}."""
    B, T, _ = h.shape
    hd = inv_freq.size * 2
    x = h.astype(np.float64).reshape(B, T, H + 2 * Hk, hd)
    qk = x[:, :, :H + Hk]
    if w is not None:
        qk = qk / np.sqrt((qk * qk).mean(-1, keepdims=True) + eps) * w
    turn = np.exp(1j * pos[:, :, None, None] * inv_freq)                          # [B, T, 1, hd/2]
    out = np.empty_like(qk)
    if style == "interleaved":
        z = (qk[..., 0::2] + 1j * qk[..., 1::2]) * turn
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        z = (qk[..., :hd // 2] + 1j * qk[..., hd // 2:]) * turn
        out[..., :hd // 2], out[..., hd // 2:] = z.real, z.imag
    heads = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731  [B, T, n, hd] -> [B, n, T, hd]
    return heads(out[:, :, :H]), heads(out[:, :, H:]), heads(x[:, :, H + Hk:])


@pytest.mark.parametrize("B,T", [(1, 1), (3, 19), (2, 7)])
@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("norm", [False, True])
def test_kernel_equals_the_array_code_and_the_oracle(name, B, T, norm):
    H, Hk, hd, style, _ = SHAPES[name]
    base = 1e6 if style == "neox" else 1e4
    h, pos, inv_freq, w = inputs(H, Hk, hd, B, T, base=base, seed=list(SHAPES).index(name) * 1000 + B * 100 + T)
    cos, sin = rope_tables(pos[:, :, None], inv_freq, style)                     # [B, T, 1, hd]
    kw = dict(style=style, n_heads=H, n_kv_heads=Hk, qk_norm=w if norm else None, eps=1e-6)
    got = heads_rope_cpu(h, cos, sin, **kw)
    want = _heads_rope_xp(np, h, cos, sin, **kw)
    for name_, g, x, o in zip("qkv", got, want, oracle(h, pos, inv_freq, style, H, Hk, kw["qk_norm"], 1e-6)):
        assert g.shape == x.shape == o.shape and g.dtype == np.float32 and g.flags.c_contiguous, name_
        assert np.array_equal(g, x), f"{name_}: kernel and array code differ by {np.abs(g - x).max()}"
        err = np.abs(g - o).max(-1) / np.abs(o).max(-1)                           # per head and row
        assert err.max() < 2e-6, f"{name_}: {err.max():.2e} from the float64 oracle"


def test_style_and_norm_change_the_answer():
    """The cases above are not vacuous: each option changes the output."""
    H, Hk, hd = 2, 1, 8
    h, pos, inv_freq, w = inputs(H, Hk, hd, 1, 3, base=1e4, seed=1)
    outs = {}
    for style in ("interleaved", "neox"):
        cos, sin = rope_tables(pos[:, :, None], inv_freq, style)
        for norm in (None, w):
            q, k, _ = heads_rope_cpu(h, cos, sin, style=style, n_heads=H, n_kv_heads=Hk, qk_norm=norm, eps=1e-6)
            outs[style, norm is None] = q
    vals = list(outs.values())
    assert all(not np.array_equal(a, b) for i, a in enumerate(vals) for b in vals[i + 1:])


# -- RopeTables: the block lookup gives rope_tables' values exactly ----------------------------------
@pytest.mark.parametrize("style", ["interleaved", "neox"])
def test_rope_table_lookup_equals_direct_tables(style):
    hd = 64
    inv = {base: 1.0 / base ** (np.arange(hd // 2, dtype=np.float64) * 2 / hd) for base in (1e4, 1e6)}
    tabs = RopeTables(inv, style)
    rng = np.random.default_rng(3)
    asks = [np.array([[p]]) for p in range(0, 200)]                                 # decode: blocks restart
    asks += [np.array([[5], [40]]) + np.arange(3), np.array([[31_000 + ROPE_BLOCK - 1]]),
             np.array([[0], [ROPE_BLOCK]]),                                        # wider than a block: direct
             np.arange(100)[None], rng.integers(0, 10**6, (3, 4)), np.array([[7]])]  # back below the block
    for pos in asks:
        got = tabs(pos)
        assert set(got) == set(inv)
        for base, f in inv.items():
            want = rope_tables(pos[:, :, None], f, style)
            for g, w in zip(got[base], want):
                assert g.shape == w.shape == pos.shape + (1, hd) and g.dtype == np.float32
                assert np.array_equal(g, w), (base, pos)
