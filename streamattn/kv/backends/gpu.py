"""GPU backend: CuPy raw kernels compiled from the .cu files in kernels/.

Same signature and results as the CPU backend. T == 1 runs the split-K flash-decoding kernel plus an
exact (out, lse) merge; T > 1 runs the prefill-chunk kernel. ``gemv`` multiplies a GGUF matrix kept in its
file's blocks on the device (kernels/gemv_packed.cu; plan in gpu_gemv.py). Each specialisation (storage dtype x
head_dim x kind, e.g. ``decode_f16_hd128``) is compiled once per process and device through
``cupy.RawModule(name_expressions=...)``. CuPy is imported lazily, so importing this module never
needs it. The launch plan lives in gpu_plan.py and the sources in gpu_source.py; the CPU emulation
harness of the tests runs both unchanged.
"""
from __future__ import annotations

import functools

from . import gpu_gemv, gpu_plan, gpu_source


def _cupy():
    """The cupy module, after checking that a CUDA device is there."""
    try:
        import cupy
    except ImportError as err:
        raise RuntimeError("the gpu backend needs CuPy: pip install 'streamattn[gpu-cuda12]' "
                           "(or gpu-cuda13), or use backend='cpu'") from err
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CUDARuntimeError without a driver
        raise RuntimeError(f"the gpu backend needs a CUDA device; CuPy found none ({err}); "
                           "use backend='cpu'") from err
    if devices == 0:
        raise RuntimeError("the gpu backend needs a CUDA device; CuPy found none; use backend='cpu'")
    return cupy


def available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device (what backend "auto" asks)."""
    try:
        _cupy()
    except RuntimeError:
        return False
    return True


@functools.cache
def kernel(name: str, device: int):
    """Compiled kernel of specialisation ``name`` (e.g. ``"decode_f16_hd128"``) on device ``device``.

    Built once per process and device: NVRTC compiles the loader's text with only this name
    expression instantiated, and CuPy keeps the module.
    """
    cupy = _cupy()
    expression = gpu_source.name_expression(name)
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=gpu_source.source(name.split("_")[0]), options=gpu_source.NVRTC_OPTIONS,
                                name_expressions=[expression])
        return module.get_function(expression)


@functools.cache
def sm_count(device: int) -> int:
    """Multiprocessors of device ``device``."""
    return int(_cupy().cuda.Device(device).attributes["MultiProcessorCount"])


def launch(name: str, grid, block, args) -> None:
    """Run specialisation ``name`` of ``gpu_source.all_specs()`` on the current device, on the current
    stream: the launcher every plan takes (attention, gemv, ``gpu_layer``, ``gpu_append``,
    ``streamattn.models.gpu_ops``)."""
    device = _cupy().cuda.Device().id
    kernel(name, device)(tuple(int(x) for x in grid), tuple(int(x) for x in block), tuple(args))


def attend(q, k, v, lengths, counts, *, window: int, sinks: int, scale: float, splits: int | None = None,
           q_sink=None, kind: str | None = None, kind_v: str | None = None,
           softcap: float | None = None, device_lengths=None, device_counts=None):
    """Attention of a chunk of queries against a ring KV cache on the GPU ("write, then attend").

    Parameters
    ----------
    q : cupy.ndarray [batch, q_heads, T, head_dim], float32 or float16
        Query row t < counts[b] sits at position lengths[b] - counts[b] + t; other rows are padding.
    k, v : cupy.ndarray [batch, kv_heads, slots, head_dim], C-contiguous
        float32, float16, bfloat16 as uint16 bits, or uint8 rows of q8_0 / q4_0 blocks (told apart by the
        row's bytes); K and V of one kind or a pair of ``gpu_source.MIXED_PAIRS``. head_dim in {64, 128, 256};
        q_heads = group x kv_heads (GQA/MQA). The newest chunk is already written.
    lengths : array [batch] of int
        Tokens each sequence has seen, the chunk included. A numpy array is preferred: its values
        are validated and size the split count without a device sync.
    counts : array [batch] of int
        Real query rows per sequence (<= T).
    window : int
        0 for full causal attention, else n_c keys visible, the current one included.
    sinks : int
        n_s always-visible first positions (only with window > 0).
    scale : float
        Multiplies q . k (1/sqrt(head_dim) by convention).
    splits : int, optional
        Number of key splits of a decode launch; by default chosen from the keys and SM count.
    q_sink : cupy.ndarray like q, optional
        The queries scored against the sink keys (positions < sinks) instead of q; a model that assigns
        positions within the cache passes q rotated at the query's cache position. Default q.
    kind, kind_v : str, optional
        The storage dtype names of K and V (the dispatcher passes them; the arrays' dtypes and row widths
        decide). K and V of different kinds: one of the pairs ``gpu_source.MIXED_PAIRS`` (float16, q8_0,
        q4_0 beside each other), else TypeError naming both.
    softcap : float, optional
        Attention logit soft-capping: each scaled score s becomes softcap * tanh(s / softcap) before the
        softmax (the ``_softcap`` kernel variants); None (default): none.
    device_lengths, device_counts : cupy.ndarray int32 [batch], optional
        The same values already on the device (a GPU cache's ``counters``): the kernels read them and
        nothing is uploaded; ``lengths`` and ``counts`` (host) still validate and size the launch.

    Returns
    -------
    out : cupy.ndarray [batch, q_heads, T, head_dim], q's dtype (zeros on padding rows)
    lse : cupy.ndarray [batch, q_heads, T], float32
        log sum_j exp(scale q . k_j) over visible keys; -inf on padding rows.

    Examples
    --------
    >>> out, lse = attend(q, k, v, np.array([4096]), np.array([1]), window=0, sinks=0,
    ...                   scale=128 ** -0.5)  # doctest: +SKIP
    """
    cupy = _cupy()
    for name, arr in (("q", q), ("k", k), ("v", v)) + ((("q_sink", q_sink),) if q_sink is not None else ()):
        if not isinstance(arr, cupy.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray on the device (got {type(arr).__name__})")
    return gpu_plan.attend_with(cupy, launch, q, k, v, lengths, counts, window=window, sinks=sinks,
                                scale=scale, sm_count=sm_count(cupy.cuda.Device().id), splits=splits,
                                q_sink=q_sink, softcap=softcap, device_lengths=device_lengths,
                                device_counts=device_counts)


attend.reads_device_counters = True   # streamattn.kv.dispatch passes a GPU cache's device counters


def upload(weight: gpu_gemv.GGUFMatrix) -> gpu_gemv.GGUFMatrix:
    """The matrix with its block bytes copied to the current device, unchanged (the file's size, no wider)."""
    cupy = _cupy()
    return weight.with_blocks(cupy.ascontiguousarray(cupy.asarray(weight.blocks)))


def gemv(weight: gpu_gemv.GGUFMatrix, x, *, out=None):
    """``y = x @ W.T`` on the GPU for a matrix kept in its GGUF type's blocks, dequantized in registers.

    Parameters
    ----------
    weight : gpu_gemv.GGUFMatrix
        ``[rows, cols]`` in a type of ``gpu_source.GEMV_TYPES``, its blocks a cupy.ndarray (:func:`upload`).
    x : cupy.ndarray float32 [cols] or [batch, cols], C-contiguous
        Up to 16 vectors share one read of the weight; a larger batch reads it once per 16.
    out : cupy.ndarray float32 [batch, rows] (or [rows] for 1-D x), optional
        Written in place and returned.

    Returns
    -------
    cupy.ndarray float32 [batch, rows], or [rows] for 1-D x
        Each entry a float32 sum over the row's dequantized weights (the kernels accumulate in float32).

    Examples
    --------
    >>> w = upload(gpu_gemv.GGUFMatrix.from_tensor(tensor))      # doctest: +SKIP
    >>> y = gemv(w, cupy.ones(w.shape[1], cupy.float32))         # doctest: +SKIP
    """
    cupy = _cupy()
    arrays = (("weight.blocks", getattr(weight, "blocks", None)), ("x", x)) + ((("out", out),) if out is not None else ())
    for name, arr in arrays:
        if not isinstance(arr, cupy.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray on the device (got {type(arr).__name__}); "
                            "upload the weight once with gpu.upload")
    return gpu_gemv.gemv_with(cupy, launch, weight, x, out=out)


def embed(weight: gpu_gemv.GGUFMatrix, ids, *, scale: float = 1.0, out=None):
    """Rows ``ids`` of a matrix kept in its GGUF type's blocks on the GPU, dequantized there, times ``scale``:
    ``gpu_gemv.embed_with`` on the device (ids: cupy int32 [n]; returns cupy float32 [n, cols])."""
    cupy = _cupy()
    for name, arr in (("weight.blocks", getattr(weight, "blocks", None)), ("ids", ids)):
        if not isinstance(arr, cupy.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray on the device (got {type(arr).__name__})")
    return gpu_gemv.embed_with(cupy, launch, weight, ids, scale=scale, out=out)
