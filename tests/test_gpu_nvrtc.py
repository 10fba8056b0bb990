"""Compile check of kernels/*.cu through NVRTC for sm_80 and sm_90, without a GPU.

Skips when CuPy or the NVRTC wheel is missing, unless STREAMATTN_REQUIRE_NVRTC=1 (set it in CI, where
the ``gpu-check`` extra is installed, so a broken install fails instead of skipping).
"""
from __future__ import annotations

import os

import pytest

from streamattn.kv.backends import gpu_source

try:
    import nvrtc_check
    nvrtc_check.nvrtc()
    MISSING = None
except Exception as err:  # ImportError without CuPy, OSError/CUDA errors without libnvrtc
    MISSING = f"NVRTC not usable ({type(err).__name__}: {err}); pip install '.[gpu-check]'"

if MISSING and os.environ.get("STREAMATTN_REQUIRE_NVRTC") == "1":
    raise RuntimeError(MISSING)
needs_nvrtc = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
# heavy: nine tests but minutes of one core: NVRTC takes 70-90 s on the prefill kernels' 66 specialisations
# per arch (most of it before ptxas: 77 s to PTX alone), handed out first (tests/conftest.py) lest it run
# last with the other worker idle
pytestmark = pytest.mark.heavy


@needs_nvrtc
@pytest.mark.parametrize("arch", nvrtc_check.ARCHS if not MISSING else ("sm_90",))
@pytest.mark.parametrize("kind", sorted(gpu_source.SOURCES))
def test_compiles_clean_without_spills(kind, arch):
    c = nvrtc_check.compile_kind(kind, arch)
    assert "error" not in c.log.lower() and "warning" not in c.log.lower(), c.log
    assert c.cubin_bytes > 0
    for name, mangled in c.lowered.items():
        assert mangled in c.entries, f"{name}: lowered name {mangled} has no ptxas entry in the log"
        entry = c.entries[mangled]
        assert entry.spill_stores == 0 and entry.spill_loads == 0, f"{name} on {arch} spills: {entry}"
        assert 0 < entry.registers <= 255 and entry.smem <= 48 * 1024, f"{name} on {arch}: {entry}"


def test_every_backend_specialisation_is_checked():
    """The compile check covers what the plans can request: (5 dtypes (q8_0, q4_0 included) + 6 pairs of K and
    V apart) x 3 head_dims x 2 kinds x (plain, soft-capped) + 3 merges, 7 GGUF types x 5 batch widths of
    the packed gemv, the layer kernels (RMSNorm, the residual add with and without its post norm, heads
    + RoPE (2 styles x with and without a per-head norm), GLU (silu, gelu-tanh)), and the K/V append for
    every pair of K and V the attention kernels read, (5 + 6) x 3, and the embedding rows of the 7 GGUF types."""
    specs = gpu_source.all_specs()
    assert len(specs) == len(set(specs)) == 135 + 35 + 9 + 33 + 7
    assert {f"embed_{t.lower()}" for t in gpu_source.GEMV_TYPES} <= set(specs)
    assert {"append_q4_hd128", "append_q8_f16_hd64", "append_bf16_hd256"} <= set(specs)
    assert {"decode_q8_q4_hd64", "prefill_f16_q4_hd256_softcap", "decode_q4_f16_hd128"} <= set(specs)
    assert {f"gemv_{t.lower()}_nb{nb}" for t in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
            for nb in (1, 2, 4, 8, 16)} <= set(specs)
    assert {"layer_norm", "layer_add", "layer_addnorm", "layer_glu_silu", "layer_glu_gelu"} | {
        f"layer_heads_{style}{norm}" for style in ("interleaved", "neox") for norm in ("", "_qknorm")} <= set(specs)
    for dtype in ("float32", "float16", "uint16"):
        for hd in gpu_source.HEAD_DIMS:
            tag = gpu_source.storage_tag(dtype)
            assert {f"decode_{tag}_hd{hd}", f"prefill_{tag}_hd{hd}", f"merge_hd{hd}", f"decode_{tag}_hd{hd}_softcap",
                    f"prefill_{tag}_hd{hd}_softcap"} <= set(specs)


@needs_nvrtc
def test_planted_syntax_error_fails_the_check():
    broken = gpu_source.source("merge").replace("float den = 0.0f, num = 0.0f;", "float den = 0.0f num = 0.0f;")
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        nvrtc_check.compile_kind("merge", "sm_90", source=broken)
