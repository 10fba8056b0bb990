"""Numba's on-disk cache shared by several processes, and closures compiled in several copies
(streamattn/kernel_cache.py)."""

import multiprocessing
import re

import numpy as np
import pytest

import streamattn  # noqa: F401  (applies lock_cache_saves)
from streamattn.kernel_cache import lock_cache_saves

KEYS = 40


def _save_many(path, tag, start):
    from numba.core import caching
    assert lock_cache_saves() and caching.IndexDataCacheFile.save.locked_by_streamattn
    cache = caching.IndexDataCacheFile(path, "f", ("stamp", 1))
    start.wait()
    for i in range(KEYS):
        cache.save((tag, i), f"{tag}:{i}")


def _run_savers(path):
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(2)
    ps = [ctx.Process(target=_save_many, args=(str(path), tag, start)) for tag in "ab"]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
        assert p.exitcode == 0
    from numba.core import caching
    cache = caching.IndexDataCacheFile(str(path), "f", ("stamp", 1))
    return {(tag, i): cache.load((tag, i)) for tag in "ab" for i in range(KEYS)}


def test_saves_from_two_processes_keep_every_entry(tmp_path):
    """Two processes saving 40 entries each into one function's cache at once: every key loads back
    its own data (unlocked, they pick the same data-file numbers and overwrite each other)."""
    got = _run_savers(tmp_path)
    assert got == {(tag, i): f"{tag}:{i}" for tag in "ab" for i in range(KEYS)}
    assert (tmp_path / "f.nbi.lock").exists()


def _env_names(dispatcher):
    """The environment names of a dispatcher's compiled overloads, the per-process counter left out."""
    return {re.sub(r"B\d+v\d+", "", cres.fndesc.env_name) for cres in dispatcher.overloads.values()}


@pytest.mark.skipif(not __import__("streamattn.quant.matmul", fromlist=["HAVE_KERNELS"]).HAVE_KERNELS,
                    reason="the packed kernels need AVX2")
def test_copies_of_a_closure_have_their_own_environment_names():
    """The packed-matmul drivers of two weight kinds, serial and parallel, are copies of one closure
    with the same argument types: their compiled environments must be named apart, or a process that
    loads two of them compiled elsewhere at the same counter value reuses one's constants for both."""
    import gguf
    from gguf.quants import quantize

    from streamattn.models import compiled
    from streamattn.backends import cpu
    from streamattn.quant.matmul import KernelPlan, qdrivers, qmatmul
    from streamattn.quant.weights import pack
    rng = np.random.default_rng(0)
    W = rng.standard_normal((32, 64)).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    plan = KernelPlan()
    names = []                      # per driver: its overloads' names (other tests may add signatures)
    for t in ("Q8_0", "Q4_0"):
        w = pack("w", t, quantize(W, getattr(gguf.GGMLQuantizationType, t)), W.shape)
        for parallel in (False, True):
            qmatmul(x, w, parallel=parallel, group_rows=plan.rows, vnni=plan.vnni, amx=plan.amx)
            names.append(_env_names(qdrivers(w.kind, w.group, plan.rows, w.lanes, plan.vnni, plan.amx)[parallel]))
    assert all(names) and sum(map(len, names)) == len(set().union(*names))
    quals = [f.py_func.__qualname__ for f in (compiled.stored_16, compiled.stored_16_parallel, compiled.stored_quantized,
                                              compiled.stored_quantized_parallel, cpu.attend_pages,
                                              cpu._attend_pages_serial)]
    assert len(set(quals)) == len(quals)
