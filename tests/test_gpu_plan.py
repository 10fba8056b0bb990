"""The GPU backend's pure-Python parts: source lookup (checkout and wheel), names, splits, validation."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamattn.kv.backends import gpu, gpu_plan, gpu_source

ROOT = Path(__file__).resolve().parent.parent


def test_sources_come_from_the_checkout_and_inline_the_header():
    assert gpu_source.kernel_dir() == ROOT / "kernels"
    for kind in gpu_source.SOURCES:
        text = gpu_source.source(kind)
        assert '#include "' not in text, "local includes must be inlined for NVRTC"
        assert "STREAMATTN_COMMON_CUH" in text and "sa_slot" in text


def test_wheel_build_ships_the_kernels(tmp_path):
    """setup.py's build_py copies kernels/ into streamattn/kernels/, where the loader looks first."""
    build_lib = tmp_path / "lib"
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(build_lib)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for source in [*ROOT.glob("kernels/*.cu"), *ROOT.glob("kernels/*.cuh")]:
        assert (build_lib / "streamattn" / "kernels" / source.name).read_bytes() == source.read_bytes()
    probe = "from streamattn.kv.backends import gpu_source as g; print(g.kernel_dir()); print(len(g.source('decode')))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(build_lib), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == str(build_lib / "streamattn" / "kernels")


def test_missing_sources_say_where_they_were_looked_for(tmp_path, monkeypatch):
    fake = tmp_path / "pkg" / "streamattn" / "kv" / "backends" / "gpu_source.py"
    fake.parent.mkdir(parents=True)
    monkeypatch.setattr(gpu_source, "__file__", str(fake))
    with pytest.raises(FileNotFoundError, match="kernel sources not found"):
        gpu_source.kernel_dir()


def test_names_and_expressions():
    assert gpu_source.spec_name("decode", 128, "f16") == "decode_f16_hd128"
    assert gpu_source.name_expression("decode_f16_hd128") == "sa_decode_split<1, 128>"
    assert gpu_source.name_expression("prefill_bf16_hd64") == "sa_prefill<2, 64>"
    assert gpu_source.spec_name("prefill", 64, "bf16", softcap=True) == "prefill_bf16_hd64_softcap"
    assert gpu_source.name_expression("prefill_bf16_hd64_softcap") == "sa_prefill<2, 64, true>"
    assert gpu_source.name_expression("decode_f32_hd256_softcap") == "sa_decode_split<0, 256, true>"
    assert gpu_source.name_expression("merge_hd256") == "sa_merge<256>"
    assert gpu_source.spec_name("decode", 64, "q8", v_tag="q4") == "decode_q8_q4_hd64"
    assert gpu_source.spec_name("decode", 64, "q8", v_tag="q8") == "decode_q8_hd64"
    assert gpu_source.name_expression("decode_q8_q4_hd64") == "sa_decode_split<3, 64, false, 4>"
    assert gpu_source.name_expression("prefill_f16_q8_hd256_softcap") == "sa_prefill<1, 256, true, 3>"
    with pytest.raises(ValueError, match="K and V of different storage only as one of f16/q8"):
        gpu_source.spec_name("decode", 64, "bf16", v_tag="f16")
    assert gpu_source.storage_tag(np.dtype(np.uint16)) == "bf16"
    with pytest.raises(ValueError, match="head_dim must be one of"):
        gpu_source.spec_name("decode", 96, "f16")
    with pytest.raises(TypeError, match="k/v dtype must be"):
        gpu_source.storage_tag(np.dtype(np.float64))


def test_split_choice():
    sms = 132
    # B=16, 8 kv heads, group 4 -> 128 blocks per split; a 32k cache gets >= 2 x SM blocks
    splits = gpu_source.choose_splits(32768, 16 * 8, sms)
    assert splits * 128 >= 2 * sms
    # B=1: a long cache is cut into many splits, but never below MIN_KEYS_PER_SPLIT keys each
    assert gpu_source.choose_splits(131072, 8, sms) * 8 >= 2 * sms
    assert gpu_source.choose_splits(1000, 8, sms) == 1000 // gpu_source.MIN_KEYS_PER_SPLIT
    assert gpu_source.choose_splits(100, 1, sms) == 1  # short caches: no split, no merge launch
    assert gpu_source.choose_splits(0, 1, sms) == 1


def test_max_visible_keys_follows_the_mode():
    lengths = np.array([5000, 70])
    assert gpu_plan.max_visible_keys(lengths, window=0, sinks=0, slots=8192) == 5000
    assert gpu_plan.max_visible_keys(lengths, window=512, sinks=4, slots=520) == 516


def arrays(batch=2, q_heads=4, kv_heads=2, T=1, slots=16, d=64, dtype=np.float16):
    q = np.zeros((batch, q_heads, T, d), np.float32)
    k = np.zeros((batch, kv_heads, slots, d), dtype)
    return q, k, k.copy()


@pytest.mark.parametrize("change,message", [
    (dict(q_heads=3), "multiple of kv_heads"),
    (dict(d=96), "head_dim must be one of"),
    (dict(dtype=np.float64), "k/v dtype must be"),
])
def test_validation_of_shapes(change, message):
    q, k, v = arrays(**change)
    with pytest.raises((ValueError, TypeError), match=message):
        gpu_plan.validate(q, k, v, np.array([3, 3]), np.array([1, 1]), window=0, sinks=0)


def test_validation_of_k_and_v_apart():
    """K and V of different kinds: a pair of MIXED_PAIRS passes; others, or rows of another batch, are refused."""
    q, k, _ = arrays(d=64)
    v8 = np.zeros(k.shape[:3] + (64 // 32 * 34,), np.uint8)
    gpu_plan.validate(q, k, v8, np.array([3, 3]), np.array([1, 1]), window=0, sinks=0)
    with pytest.raises(TypeError, match=r"float32 \(f32\) and uint8 \(q8\)"):
        gpu_plan.validate(q, k.astype(np.float32), v8, np.array([3, 3]), np.array([1, 1]), window=0, sinks=0)
    with pytest.raises(ValueError, match="k and v must both be"):
        gpu_plan.validate(q, k, v8[:, :, :8], np.array([3, 3]), np.array([1, 1]), window=0, sinks=0)


def test_validation_of_alignment():
    q, k, v = arrays()
    raw = np.zeros(k.size + 8, np.float16)
    shifted = raw[1:1 + k.size].reshape(k.shape)  # C-contiguous, but 2 bytes off the vector grid
    with pytest.raises(ValueError, match="16-byte boundary"):
        gpu_plan.validate(q, shifted, v, np.array([3, 3]), np.array([1, 1]), window=0, sinks=0)


@pytest.mark.parametrize("lengths,counts,window,sinks,message", [
    ([3, 20], [1, 1], 0, 0, "causal lengths must be <= slots"),
    ([3, 3], [1, 2], 0, 0, "counts must satisfy"),
    ([3, 3], [1, 1], 0, 2, "sinks=2 needs a window"),
    ([30, 30], [1, 1], 14, 2, "must hold sinks \\+ window \\+ chunk - 1 = 16"),
    ([3, 3], [1, 1], -1, 0, "must be >= 0"),
])
def test_validation_of_values(lengths, counts, window, sinks, message):
    q, k, v = arrays(slots=15)
    with pytest.raises(ValueError, match=message):
        gpu_plan.validate(q, k, v, np.array(lengths), np.array(counts), window=window, sinks=sinks)


def _fake_cupy(count):
    """A module named cupy whose runtime reports ``count`` devices, or raises like CuPy without a driver."""
    import types

    def get_count():
        if isinstance(count, Exception):
            raise count
        return count
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_count)))


@pytest.mark.parametrize("cupy,available,message", [
    (None, False, "the gpu backend needs CuPy"),                                   # not installed
    (_fake_cupy(RuntimeError("no CUDA driver")), False, "needs a CUDA device; CuPy found none \\(no CUDA driver"),
    (_fake_cupy(0), False, "needs a CUDA device; CuPy found none; use backend='cpu'"),
    (_fake_cupy(2), True, None),
])
def test_gpu_probe_says_whether_a_device_is_there(monkeypatch, cupy, available, message):
    monkeypatch.setitem(sys.modules, "cupy", cupy)       # None: `import cupy` raises ImportError
    assert gpu.available() is available                  # never raises
    if message:
        q, k, v = arrays()
        with pytest.raises(RuntimeError, match=message):
            gpu.attend(q, k, v, np.array([3, 3]), np.array([1, 1]), window=0, sinks=0, scale=0.125)
