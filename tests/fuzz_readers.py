"""Hypothesis fuzz of the two readers an attacker controls: snapshot ``.npz`` and GGUF model files.

Run as a script (tests/test_reader_fuzz.py does, and scripts/fuzz.sh with more examples): it caps its own
address space with ``resource.setrlimit(RLIMIT_AS)`` at what it uses after the imports plus
``--memory-mib``, and each case under ``--case-seconds`` (SIGALRM), then mutates small valid files (bit
flips, truncations, oversized 32/64-bit counts and shapes written over the integer fields, nested or
absurd sealed JSON) and asserts the contract of each reader:

* snapshot: ``snapshot.load`` and ``snapshot.restore`` raise ``StateFileError`` (the target bit-for-bit
  unchanged) or return a state bit-identical to the one saved;
* GGUF: ``load_gguf`` raises ``ModelFileError`` or returns a model whose config validated and whose every
  expected tensor has its shape and finite values (GGUF carries no checksum: a flipped weight bit loads).

Any other exception, a memory error escaping, or a case over the time bound fails the run; hypothesis
prints the shrunk failing mutation.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import signal
import sys
import tempfile
import time

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from streamattn import CacheSpec, KVCache
from streamattn.kv import snapshot          # noqa: E402
from streamattn.gguf.loader import ModelFileError, load_gguf      # noqa: E402

BIG = [0, 1, 2, 255, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**62, 2**63 - 1, 2**64 - 1]
TMP = tempfile.mkdtemp(prefix="streamattn-fuzz-")


class CaseTimeout(BaseException):
    """Raised by SIGALRM: a BaseException, so no reader's catch-all can swallow it."""


def _alarm(signum, frame):
    raise CaseTimeout()


def bounded(fn, seconds: float):
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    t0 = time.perf_counter()
    try:
        return fn()
    except CaseTimeout:
        raise AssertionError(f"a case ran past the {seconds} s bound") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        STATS["max_s"] = max(STATS["max_s"], time.perf_counter() - t0)


STATS = {"max_s": 0.0, "cases": 0, "errors": 0, "loaded": 0}


# -- byte mutations (both formats) ----------------------------------------------------------------
def byte_mutation(n: int, words=()):
    """A strategy of functions bytes -> bytes for a file of n bytes; ``words``: (offset, size) of the
    file's integer fields (counts, shapes, offsets), to be overwritten with oversized values."""
    flip = st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 7)), min_size=1, max_size=4).map(
        lambda flips: ("flip", flips))
    cut = st.integers(0, n - 1).map(lambda at: ("truncate", at))
    anywhere = st.tuples(st.integers(0, n - 8), st.sampled_from([4, 8])).map(lambda t: t)
    field = st.sampled_from(list(words)) if words else anywhere
    word = st.tuples(st.one_of(field, anywhere), st.sampled_from(BIG)).map(lambda t: ("word", t))
    return st.one_of(flip, cut, word, word)


def apply(data: bytes, mutation) -> bytes:
    kind, arg = mutation
    if kind == "truncate":
        return data[:arg]
    raw = bytearray(data)
    if kind == "flip":
        for at, bit in arg:
            raw[at] ^= 1 << bit
        return bytes(raw)
    (at, size), value = arg
    raw[at:at + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
    return bytes(raw)


# -- snapshot -----------------------------------------------------------------------------------------
def make_snapshot():
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=4, window=3, sinks=1, max_chunk=2, dtype="float16"))
    rng = np.random.default_rng(1)
    for t in range(6):
        x = rng.standard_normal((2, 1, 2, 4)).astype(np.float32)
        cache.append(x, -x, counts=[2, 1])
    path = os.path.join(TMP, "orig.npz")
    snapshot.save(path, cache)
    with open(path, "rb") as f:
        return cache, f.read()


ORIGINAL, SNAP = make_snapshot()


def same_state(a: KVCache, b: KVCache) -> bool:
    return a.spec == b.spec and a.k.tobytes() == b.k.tobytes() and a.v.tobytes() == b.v.tobytes() \
        and a.k.shape == b.k.shape and all(np.array_equal(getattr(a, n), getattr(b, n))
                                           for n in ("lengths", "last_counts", "held_from"))


def resealed(change) -> bytes:
    """The original file after ``change(meta)`` edits its meta, with a consistent checksum."""
    with np.load(io.BytesIO(SNAP)) as z:
        members = {n: z[n] for n in z.files}
    meta = json.loads(members.pop("meta").tobytes())
    change(meta)
    meta.pop("sha256", None)
    meta["sha256"] = snapshot._digest(meta, members)
    members["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **members)
    return buf.getvalue()


def nested(depth: int) -> bytes:
    with np.load(io.BytesIO(SNAP)) as z:
        members = {n: z[n] for n in z.files}
    members["meta"] = np.frombuffer(b'{"format": "streamattn-kv", "version": 1, "layers": '
                                    + b"[" * depth + b"]" * depth + b"}", np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **members)
    return buf.getvalue()


SPEC_FIELDS = ["batch", "kv_heads", "head_dim", "window", "sinks", "max_chunk", "max_len", "dtype", "check_finite"]
ODD = st.one_of(st.sampled_from(BIG), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=4),
                st.none(), st.booleans(), st.lists(st.integers(), max_size=3), st.just({"a": 1}))


def _set_spec(meta, name, value):
    meta["layers"][0]["spec"][name] = value


def _set_layer(meta, name, value):
    meta["layers"][0][name] = value


sealed = st.one_of(
    st.tuples(st.sampled_from(SPEC_FIELDS), ODD).map(lambda t: lambda m: _set_spec(m, *t)),
    st.tuples(st.sampled_from(["slots", "used"]), ODD).map(lambda t: lambda m: _set_layer(m, *t)),
    st.tuples(st.sampled_from(["layout", "layers", "version"]), ODD).map(lambda t: lambda m: m.__setitem__(*t)),
)
snapshot_case = st.one_of(
    byte_mutation(len(SNAP)).map(lambda mu: ("bytes", mu)),
    sealed.map(lambda change: ("sealed", change)),
    st.integers(1, 200_000).map(lambda d: ("nested", d)),
)


def check_snapshot(case) -> None:
    kind, arg = case
    data = apply(SNAP, arg) if kind == "bytes" else resealed(arg) if kind == "sealed" else nested(arg)
    path = os.path.join(TMP, "case.npz")
    with open(path, "wb") as f:
        f.write(data)
    STATS["cases"] += 1
    try:
        loaded = bounded(lambda: snapshot.load(path), SECONDS)
    except snapshot.StateFileError:
        STATS["errors"] += 1
    else:
        STATS["loaded"] += 1
        assert isinstance(loaded, KVCache) and same_state(loaded, ORIGINAL), "a damaged file loaded another state"
    target = KVCache(ORIGINAL.spec)
    target.append(np.ones((2, 1, 1, 4), np.float32), np.ones((2, 1, 1, 4), np.float32))
    keep = KVCache(ORIGINAL.spec)
    keep.append(np.ones((2, 1, 1, 4), np.float32), np.ones((2, 1, 1, 4), np.float32))
    try:
        bounded(lambda: snapshot.restore(target, path), SECONDS)
    except snapshot.StateFileError:
        assert same_state(target, keep), "a refused restore changed the target"
    else:
        assert same_state(target, ORIGINAL), "a damaged file restored another state"


# -- GGUF -------------------------------------------------------------------------------------------
def make_gguf():
    import gguf
    from _model_util import write_tiny_gguf
    path = write_tiny_gguf(os.path.join(TMP, "orig.gguf"), arch="llama", n_layers=1, d_model=8, n_heads=2,
                           n_kv_heads=1, head_dim=4, d_ff=8, vocab=8)
    with open(path, "rb") as f:
        data = f.read()
    reader = gguf.GGUFReader(path)
    base = reader.data.__array_interface__["data"][0]
    words = {(8, 8), (16, 8)}                                    # tensor count, key-value count
    for fld in list(reader.fields.values()) + [t.field for t in reader.tensors]:
        for part in fld.parts:
            if part.dtype.kind in "iu" and part.nbytes in (4, 8) and part.size == 1:   # counts, lengths, dims
                words.add((part.__array_interface__["data"][0] - base, part.nbytes))
    del reader
    return data, sorted(words)


GGUF, GGUF_WORDS = make_gguf()


def check_gguf(mutation) -> None:
    path = os.path.join(TMP, "case.gguf")
    with open(path, "wb") as f:
        f.write(apply(GGUF, mutation))
    STATS["cases"] += 1
    try:
        m = bounded(lambda: load_gguf(path), SECONDS)
    except ModelFileError:
        STATS["errors"] += 1
        return
    STATS["loaded"] += 1
    c = m.config
    assert m.weights["blk.0.attn_q.weight"].shape == (c.q_dim, c.d_model)
    assert all(np.isfinite(w).all() for w in m.weights.values())


# -- driver -------------------------------------------------------------------------------------------
def vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv=None) -> int:
    global SECONDS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=200, help="examples per reader")
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: derandomised)")
    p.add_argument("--memory-mib", type=int, default=1024, help="address space allowed above the baseline")
    p.add_argument("--case-seconds", type=float, default=10.0)
    p.add_argument("--only", choices=("snapshot", "gguf"), default=None)
    args = p.parse_args(argv)
    SECONDS = args.case_seconds
    limit = vm_bytes() + (args.memory_mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    common = dict(max_examples=args.examples, deadline=None, database=None,
                  derandomize=args.seed is None, suppress_health_check=list(HealthCheck))
    runs = []
    if args.only in (None, "snapshot"):
        runs.append(("snapshot", given(snapshot_case)(settings(**common)(check_snapshot))))
    if args.only in (None, "gguf"):
        runs.append(("gguf", given(byte_mutation(len(GGUF), GGUF_WORDS))(settings(**common)(check_gguf))))
    for name, run in runs:
        before = dict(STATS)
        if args.seed is not None:
            from hypothesis import seed
            run = seed(args.seed)(run)
        run()
        print(f"{name}: {STATS['cases'] - before['cases']} cases, {STATS['errors'] - before['errors']} refused "
              f"by name, {STATS['loaded'] - before['loaded']} loaded; slowest {STATS['max_s']:.3f} s; "
              f"address space capped at {limit >> 20} MiB", flush=True)
    return 0


SECONDS = 10.0

if __name__ == "__main__":
    sys.exit(main())
