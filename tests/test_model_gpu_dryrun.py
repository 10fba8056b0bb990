"""Dry run of the model's GPU path without a GPU: Transformer.to(cupy) on caches with device='gpu' and
backend='gpu', through tests/fake_cupy (numpy arrays, CUDA kernels run by the C++ emulation harness).

It proves the wiring (array module, device caches, kernel launches, host copies), not speed. The fake
covers only what the core's GPU code and the model's array code call.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_emu import emu
from gpu_fixtures import emu_library  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not emu.have_compiler(), reason="g++ (C++20) is needed for the emulation harness")

CHILD = r"""
import sys
import numpy as np
import cupy
sys.path.insert(0, "tests")
from _model_util import write_tiny_gguf
from streamattn.gguf.loader import load_gguf
from streamattn.models.transformer import Transformer

arch, _, scaling = sys.argv[2].partition(":")
path = write_tiny_gguf(sys.argv[1], arch=arch, n_layers=6, d_model=32, n_heads=2, n_kv_heads=1,
                       head_dim=64, d_ff=32, vocab=40, window=4, rope_freqs=arch == "llama",
                       rope_scaling=scaling or None)
cpu, gpu = Transformer(load_gguf(path)), Transformer(load_gguf(path)).to(cupy)
gpu._rope = None                  # no host RoPE tables on the GPU path: the kernels rotate at device positions
kv = dict(zip(("dtype", "dtype_v"), sys.argv[3].split(":"))) if len(sys.argv) > 3 else {}   # K:V storage
cc, gc = cpu.new_caches(batch=2, max_chunk=3, **kv), gpu.new_caches(batch=2, max_chunk=3, **kv)
assert all(c.device == "gpu" for c in gc)
rng = np.random.default_rng(0)
for step, counts in enumerate([(3, 2), (3, 3), (1, 1), (0, 1), (1, 1)]):
    toks = rng.integers(0, 40, (2, max(counts)))
    cnt = np.array(counts)
    a = cpu.forward(toks, cc, counts=cnt, backend="cpu", last_only=True)
    b = gpu.forward(toks, gc, counts=cnt, backend="gpu", last_only=True)
    b = b.get() if hasattr(b, "get") else b
    for s in range(2):
        if cnt[s]:
            np.testing.assert_allclose(b[s], a[s], rtol=1e-4, atol=1e-4)
ran = set(cupy._emulator().launches)               # the layer's row work ran as the fused kernels
c = gpu.config
assert {"layer_norm", "layer_addnorm" if gpu.layers[0].post_attn_norm is not None else "layer_add",
        "layer_glu_gelu" if c.activation == "gelu_tanh" else "layer_glu_silu",
        f"layer_heads_{c.rope_style}" + ("_qknorm" if gpu.layers[0].qk_norm is not None else "")} <= ran, ran
print("ok", int(gc[0].lengths[1]))
"""


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "llama", "qwen2", "qwen3", "phi3", "phi3:longrope",
                                  "qwen2:yarn"])
def test_model_runs_on_the_gpu_backend_through_the_fake(tmp_path, emu_library, arch):
    """Every architecture's array code on CuPy (the fake): gemma2's soft caps (the _softcap kernels) and
    alternating layers, gemma3's norms and sliding layers, llama with rope_freqs factors, qwen2's q/k/v
    biases, qwen3's q/k norms, phi3's fused tensors and window, phi3's longrope factors and qwen2's YaRN
    (attention factors on the tables); the CPU path is the reference."""
    env = dict(os.environ, STREAMATTN_FAKE_CUPY_LIB=str(emu_library),
               PYTHONPATH=f"{ROOT / 'tests' / 'fake_cupy'}:{ROOT}")
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "t.gguf"), arch], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "8"]


@pytest.mark.parametrize("kv", ["q8_0:q4_0", "q4_0:q8_0"])
def test_model_runs_k_and_v_apart_on_the_gpu_backend(tmp_path, emu_library, kv):
    """A model whose cache stores K and V apart (q8_0 keys, rotated, beside q4_0 values, and the reverse)
    through the fake CuPy: the mixed kernels give the CPU path's logits. (Not float16 beside them here: the
    two paths' ~1e-6 differences flip float16 roundings of a few stored values, which this random 6-layer
    model turns into ~3e-3 logit differences even with both sides float16; test_kv_quant checks the float16
    pairs' kernels against the oracle over the stored values.)"""
    env = dict(os.environ, STREAMATTN_FAKE_CUPY_LIB=str(emu_library),
               PYTHONPATH=f"{ROOT / 'tests' / 'fake_cupy'}:{ROOT}")
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "t.gguf"), "llama", kv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "8"]


PACKED_CHILD = r"""
import sys
import numpy as np
import cupy
sys.path.insert(0, "tests")
from _model_util import write_tiny_gguf
from streamattn.kv.backends.gpu_gemv import GGUFMatrix
from streamattn.gguf.loader import load_gguf
from streamattn.models.transformer import Transformer

types = dict(attn_q="Q4_K", attn_k="Q6_K", attn_v="Q8_0", attn_output="Q5_K", ffn_gate="Q4_0", ffn_up="Q4_1",
             ffn_down="Q6_K", token_embd="Q5_0")
path = write_tiny_gguf(sys.argv[1], arch="llama", n_layers=1, d_model=256, n_heads=2, n_kv_heads=1, head_dim=128,
                       d_ff=256, vocab=48, quant=types, matrix_scale=0.05)
gm = load_gguf(path, weights="gguf")
packed = {n: w for n, w in gm.weights.items() if isinstance(w, GGUFMatrix)}
assert {w.gguf_type for w in packed.values()} == set(types.values()), packed
cpu, gpu = Transformer(load_gguf(path, weights="f32")), Transformer(gm).to(cupy)
gpu._rope = None                  # no host RoPE tables on the GPU path
assert all(isinstance(w.blocks, cupy.ndarray) for w in (gpu.layers[0].wo, gpu.embed))
parts = [gpu.embed] + [p for lw in gpu.layers for v in vars(lw).values()
                        for p in (v if isinstance(v, tuple) else (v,))]       # row groups of mixed types: tuples
held = sum(w.blocks.nbytes for w in parts if isinstance(w, GGUFMatrix))
assert held == sum(w.blocks.nbytes for w in packed.values())          # the file's bytes, nothing wider
cc, gc = cpu.new_caches(batch=1, max_chunk=5), gpu.new_caches(batch=1, max_chunk=5)
ids = [3, 17, 5, 40, 9]
worst, same = 0.0, 0
a_ids, b_ids = list(ids), list(ids)
feed_a, feed_b = np.array([ids]), np.array([ids])
for step in range(int(sys.argv[2])):
    a = cpu.forward(feed_a, cc, backend="cpu", last_only=True)[0]
    b = gpu.forward(feed_b, gc, backend="gpu", last_only=True)[0]
    b = b.get() if hasattr(b, "get") else b
    worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
    na, nb = int(a.argmax()), int(b.argmax())
    same += na == nb
    a_ids.append(na); b_ids.append(nb)
    feed_a, feed_b = np.array([[na]]), np.array([[nb]])
ran = set(cupy._emulator().launches)        # the tokens' rows dequantized on the device, from device ids
assert "embed_q5_0" in ran, ran
print("ok", same, worst, a_ids == b_ids)
"""


STEPS = 5


def test_packed_model_on_the_gpu_backend_equals_the_cpu_f32_path(tmp_path, emu_library):
    """A model loaded with weights="gguf" keeps its matrices as the file's blocks on the (fake) device, one
    type per tensor kind (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), multiplied by the packed GEMV kernels
    (float32 sums) and embedded by the embed kernel: its logits are the CPU path's over float32 dequantized
    weights within 1e-3 of their largest, and greedy steps pick the same ids. (One layer, five steps: the emulation starts an OS thread
    per CUDA thread, seconds a step here.)"""
    env = dict(os.environ, STREAMATTN_FAKE_CUPY_LIB=str(emu_library),
               PYTHONPATH=f"{ROOT / 'tests' / 'fake_cupy'}:{ROOT}")
    done = subprocess.run([sys.executable, "-c", PACKED_CHILD, str(tmp_path / "p.gguf"), str(STEPS)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    word, same, worst, equal = done.stdout.split()[-4:]
    assert word == "ok" and int(same) == STEPS and equal == "True" and float(worst) <= 1e-3, done.stdout[-500:]
