"""Kernel sources and specialisations of the GPU backend, in plain Python (no CuPy needed).

Everything here is shared by the GPU backend, the NVRTC compile check and the CPU emulation harness,
so the three see the same source text, the same template instantiations and the same options.

Specialisations
---------------
======== ===================================== ==============================
kind     template (name expression)            readable name
======== ===================================== ==============================
decode   ``sa_decode_split<KIND, HD>``         ``decode_f16_hd128``
decode   ``sa_decode_split<KIND, HD, true>``   ``decode_f16_hd128_softcap``
decode   ``sa_decode_split<K, HD, false, V>``  ``decode_q8_f16_hd128`` (K q8_0, V float16)
prefill  ``sa_prefill<KIND, HD>``              ``prefill_bf16_hd64``
prefill  ``sa_prefill<KIND, HD, true>``        ``prefill_bf16_hd64_softcap``
merge    ``sa_merge<HD>``                      ``merge_hd256``
gemv     ``sa_gemv<TYPE, NB>``                 ``gemv_q4_k_nb4``
layer    ``sa_rows<MODE>`` and others          ``layer_norm``, ``layer_heads_neox_qknorm``
append   ``sa_append<KIND, VKIND, HD>``        ``append_q8_f16_hd128``, ``append_q4_hd64``
embed    ``sa_embed<TYPE>``                    ``embed_q4_k``
======== ===================================== ==============================

KIND is the K/V storage dtype: 0 float32, 1 float16, 2 bfloat16 (uint16 bits), 3 q8_0 and 4 q4_0 (uint8
rows of GGUF blocks, tags ``q8`` / ``q4``, e.g. ``decode_q8_hd64``); HD is head_dim. K and V of different
kinds take both tags, K's first (``prefill_f16_q4_hd64``), for the pairs in :data:`MIXED_PAIRS`.
The ``_softcap`` variants soft-cap every score (Gemma-2); the plain ones are the same text without it
(``if constexpr``), so models without a cap run exactly the kernels they ran before it existed.
The gemv kernels (kernels/gemv_packed.cu) multiply a matrix held in a GGUF type of :data:`GEMV_TYPES`
(TYPE: GGML's type id) by up to NB vectors of :data:`GEMV_BATCHES`. The layer kernels (kernels/layer_ops.cu)
are the decoder layer's RMSNorm, residual add, heads split with RoPE, and GLU: :data:`LAYER_SPECS`. The
append kernels (kernels/append.cu) write a step's K and V rows into the ring, cast or quantized as stored,
for every K/V pair the attention kernels read. The embed kernels (kernels/embed.cu) dequantize the rows of
a step's token ids from a matrix in a type of :data:`GEMV_TYPES`.
"""
from __future__ import annotations

import functools
import math
import re
from pathlib import Path

HEAD_DIMS = (64, 128, 256)
KV_KINDS = {"f32": 0, "f16": 1, "bf16": 2, "q8": 3, "q4": 4}  # storage dtype tag -> KIND template argument
QUANT_BLOCK_BYTES = {"q8": 34, "q4": 18}  # bytes per 32 values (streamattn.kv.spec.BLOCK_BYTES)
# (K, V) storage pairs of different kinds the kernels are instantiated for: a quantized side beside float16
# or the other quantized kind (each pair is 12 more specialisations to compile and check)
MIXED_PAIRS = (("f16", "q8"), ("f16", "q4"), ("q8", "f16"), ("q4", "f16"), ("q8", "q4"), ("q4", "q8"))
SOURCES = {"decode": "decode.cu", "prefill": "prefill.cu", "merge": "merge.cu", "gemv": "gemv_packed.cu",
           "layer": "layer_ops.cu", "append": "append.cu", "embed": "embed.cu"}
# GGUF type -> (GGML type id: the gemv template's TYPE, values per block, bytes per block) (ggml-common.h;
# gguf.constants.GGML_QUANT_SIZES holds the same sizes)
GEMV_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q8_0": (8, 32, 34),
              "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
GEMV_BATCHES = (1, 2, 4, 8, 16)  # NB: x vectors one gemv launch row multiplies (a batch takes the next one up)
GEMV_THREADS = 128  # SA_GEMV_THREADS in kernels/gemv_packed.cu: 4 warps, one output row each
EMBED_THREADS = 128  # SA_EMBED_THREADS in kernels/embed.cu: pieces of one row a block dequantizes
# The layer kernels (kernels/layer_ops.cu): readable name -> name expression
LAYER_SPECS = {"layer_norm": "sa_rows<0>", "layer_add": "sa_rows<1>", "layer_addnorm": "sa_rows<2>",
               "layer_heads_interleaved": "sa_heads_rope<false, false>",
               "layer_heads_interleaved_qknorm": "sa_heads_rope<false, true>",
               "layer_heads_neox": "sa_heads_rope<true, false>",
               "layer_heads_neox_qknorm": "sa_heads_rope<true, true>",
               "layer_glu_silu": "sa_glu<false>", "layer_glu_gelu": "sa_glu<true>"}
LAYER_ROW_THREADS = 128  # SA_ROW_THREADS in kernels/layer_ops.cu
LAYER_HEAD_WARPS = 4  # SA_HEAD_WARPS: heads one sa_heads_rope block handles, a warp each
# Options for every NVRTC compile (backend and compile check alike); the arch is added per device.
NVRTC_OPTIONS = ("-std=c++17",)
# What cupy.RawModule appends on its own (CuPy 13/14 compiler.py): the compile check adds these too, so
# it compiles what a device compiles.
CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")

BLOCK_THREADS = 128  # SA_THREADS in kernels/streamattn_common.cuh
MERGE_THREADS = 64  # SA_MERGE_THREADS in kernels/merge.cu
MAX_GROUP = 4  # SA_MAX_GROUP: query heads one decode block serves
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (merge, launch tail) outweighs its parallelism
# Decode grid target, in blocks per SM. About 4 decode blocks fit on an SM at once (120-128 registers x
# 128 threads), so 16 per SM is ~4 waves: the last, partial wave costs little, and the merge stays small
# (it reads splits x head_dim floats per query head, against L x head_dim x 2 storage values).
BLOCKS_PER_SM = 16

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_dir() -> Path:
    """Folder holding the .cu sources.

    An installed wheel carries them as package data in ``streamattn/kernels/`` (copied there by
    setup.py at build time); a source checkout keeps them in the top-level ``kernels/``.

    Returns
    -------
    pathlib.Path
        The first of those two folders that holds ``decode.cu``.
    """
    package = Path(__file__).resolve().parents[2]  # .../streamattn
    for folder in (package / "kernels", package.parent / "kernels"):
        if (folder / "decode.cu").is_file():
            return folder
    raise FileNotFoundError(
        f"CUDA kernel sources not found in {package / 'kernels'} (installed wheel) nor in "
        f"{package.parent / 'kernels'} (checkout); reinstall streamattn or run from a full checkout")


def expand_includes(text: str, folder: Path, _seen: frozenset = frozenset()) -> str:
    """Inline ``#include "local.cuh"`` lines (not ``<system>`` ones) from ``folder``, recursively.

    The result is one self-contained text: NVRTC needs no include path, and CuPy's compile cache,
    which keys on the source text, sees a header change.
    """
    def inline(match: re.Match) -> str:
        name = match.group(1)
        if name in _seen:  # include guards would make the second copy empty anyway
            return ""
        return expand_includes((folder / name).read_text(), folder, _seen | {name})
    return _INCLUDE.sub(inline, text)


@functools.cache
def source(kind: str) -> str:
    """Full source text (includes inlined) that the backend compiles for ``kind``.

    Parameters
    ----------
    kind : {"decode", "prefill", "merge", "gemv", "layer", "append", "embed"}

    Returns
    -------
    str
    """
    if kind not in SOURCES:
        raise ValueError(f"kernel kind must be one of {sorted(SOURCES)} (got {kind!r})")
    folder = kernel_dir()
    return expand_includes((folder / SOURCES[kind]).read_text(), folder)


def storage_tag(dtype, width: int | None = None, head_dim: int | None = None) -> str:
    """``"f32"``, ``"f16"`` or ``"bf16"`` for a K/V storage dtype (bf16 as uint16 bits or ml_dtypes); for
    uint8 rows of quantized blocks, ``"q8"`` or ``"q4"`` by the row's ``width`` in bytes for ``head_dim``."""
    name = getattr(dtype, "name", str(dtype))
    if name == "uint8" and head_dim is not None:
        for tag, block in QUANT_BLOCK_BYTES.items():
            if head_dim % 32 == 0 and width == head_dim // 32 * block:
                return tag
        raise ValueError(f"uint8 k/v rows of {width} bytes are neither q8_0 nor q4_0 blocks for head_dim "
                         f"{head_dim} (expected {head_dim // 32 * 34} or {head_dim // 32 * 18})")
    tag = {"float32": "f32", "float16": "f16", "uint16": "bf16", "bfloat16": "bf16"}.get(name)
    if tag is None:
        raise TypeError(f"k/v dtype must be float32, float16, bfloat16 stored as uint16, or uint8 q8_0/q4_0 "
                        f"blocks (got {name})")
    return tag


def spec_name(kind: str, head_dim: int, tag: str | None = None, *, softcap: bool = False,
              v_tag: str | None = None) -> str:
    """Readable specialisation name, e.g. ``decode_f16_hd128``, ``prefill_f32_hd64_softcap`` (``softcap``:
    the variant that soft-caps the scores), ``decode_q8_f16_hd64`` (``v_tag``: V's storage where it is not
    K's ``tag``; a pair of :data:`MIXED_PAIRS`) or ``merge_hd64``."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} (got {head_dim})")
    if kind == "merge":
        return f"merge_hd{head_dim}"
    if tag not in KV_KINDS:
        raise ValueError(f"storage tag must be one of {sorted(KV_KINDS)} (got {tag!r})")
    tags = tag
    if v_tag is not None and v_tag != tag:
        if (tag, v_tag) not in MIXED_PAIRS:
            raise ValueError(f"the gpu kernels read K and V of different storage only as one of "
                             f"{', '.join(f'{k}/{v}' for k, v in MIXED_PAIRS)} (K/V; got {tag}/{v_tag})")
        tags = f"{tag}_{v_tag}"
    return f"{kind}_{tags}_hd{head_dim}" + ("_softcap" if softcap else "")


def gemv_name(gguf_type: str, nb: int) -> str:
    """Readable name of the gemv kernel for a GGUF type of :data:`GEMV_TYPES` and NB of :data:`GEMV_BATCHES`,
    e.g. ``gemv_q4_k_nb4``."""
    if gguf_type not in GEMV_TYPES:
        raise ValueError(f"the gemv kernels read GGUF types {', '.join(GEMV_TYPES)} (got {gguf_type!r})")
    if nb not in GEMV_BATCHES:
        raise ValueError(f"gemv batch width must be one of {GEMV_BATCHES} (got {nb!r})")
    return f"gemv_{gguf_type.lower()}_nb{nb}"


def embed_name(gguf_type: str) -> str:
    """Readable name of the embed kernel for a GGUF type of :data:`GEMV_TYPES`, e.g. ``embed_q4_k``."""
    if gguf_type not in GEMV_TYPES:
        raise ValueError(f"the embed kernels read GGUF types {', '.join(GEMV_TYPES)} (got {gguf_type!r})")
    return f"embed_{gguf_type.lower()}"


def name_expression(name: str) -> str:
    """C++ name expression (for NVRTC ``name_expressions``) of a readable specialisation name."""
    if name in LAYER_SPECS:
        return LAYER_SPECS[name]
    parts = name.split("_")
    if parts[0] == "embed":                               # embed_q4_k -> sa_embed<12>
        return f"sa_embed<{GEMV_TYPES['_'.join(parts[1:]).upper()][0]}>"
    if parts[0] == "gemv":                                # gemv_q4_k_nb4 -> sa_gemv<12, 4>
        return f"sa_gemv<{GEMV_TYPES['_'.join(parts[1:-1]).upper()][0]}, {int(parts[-1].removeprefix('nb'))}>"
    capped = parts[-1] == "softcap"
    head_dim = int(parts[-2 if capped else -1].removeprefix("hd"))
    if parts[0] == "merge":
        return f"sa_merge<{head_dim}>"
    if parts[0] == "append":                              # append_q8_f16_hd64 -> sa_append<3, 1, 64>
        tags = parts[1:-1]
        return f"sa_append<{KV_KINDS[tags[0]]}, {KV_KINDS[tags[-1]]}, {head_dim}>"
    template = {"decode": "sa_decode_split", "prefill": "sa_prefill"}[parts[0]]
    tags = parts[1:-2 if capped else -1]                  # K's tag, then V's where it differs
    if len(tags) == 2:
        return f"{template}<{KV_KINDS[tags[0]]}, {head_dim}, {'true' if capped else 'false'}, {KV_KINDS[tags[1]]}>"
    return f"{template}<{KV_KINDS[tags[0]]}, {head_dim}" + (", true>" if capped else ">")


def all_specs() -> list[str]:
    """Every specialisation the backend can request (what the compile check compiles)."""
    names = [spec_name(kind, hd, tag, softcap=cap) for kind in ("decode", "prefill") for cap in (False, True)
             for tag in KV_KINDS for hd in HEAD_DIMS]
    mixed = [spec_name(kind, hd, k, softcap=cap, v_tag=v) for kind in ("decode", "prefill") for cap in (False, True)
             for k, v in MIXED_PAIRS for hd in HEAD_DIMS]
    gemv = [gemv_name(t, nb) for t in GEMV_TYPES for nb in GEMV_BATCHES]
    append = [spec_name("append", hd, k, v_tag=v) for hd in HEAD_DIMS
              for k, v in [(t, t) for t in KV_KINDS] + list(MIXED_PAIRS)]
    embed = [embed_name(t) for t in GEMV_TYPES]
    return names + [spec_name("merge", hd) for hd in HEAD_DIMS] + mixed + gemv + list(LAYER_SPECS) + append + embed


def choose_splits(max_keys: int, blocks_per_split: int, sm_count: int) -> int:
    """Number of key splits for a decode launch.

    Long caches are split so the grid holds about BLOCKS_PER_SM x SM-count blocks (at least 2 x SM count; a
    single (sequence, kv head) is otherwise one block reading the whole cache), but no split gets
    fewer than MIN_KEYS_PER_SPLIT keys.

    Parameters
    ----------
    max_keys : int
        Visible keys of the longest sequence in the batch.
    blocks_per_split : int
        Blocks one split takes: batch x kv_heads x head chunks.
    sm_count : int
        Streaming multiprocessors of the device.

    Returns
    -------
    int
        At least 1.
    """
    if max_keys <= 0 or blocks_per_split <= 0:
        return 1
    wanted = math.ceil(BLOCKS_PER_SM * sm_count / blocks_per_split)
    return max(1, min(wanted, max_keys // MIN_KEYS_PER_SPLIT))
