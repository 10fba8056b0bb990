"""Snapshot files crafted to break the reader (issue 17 item 5): every one is StateFileError, nothing changes,
and nothing is allocated beyond what the file's own bytes and the max_bytes bound allow."""

import io
import json
import re
import struct
import zipfile

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache
from streamattn.kv import snapshot

from test_state import assert_same_state, clone, reseal, rewrite


def saved(tmp_path):
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=8, window=4, sinks=1, max_chunk=2, dtype="float16"))
    for t in range(5):
        cache.append(np.full((2, 1, 1, 8), t, np.float32), np.full((2, 1, 1, 8), -t, np.float32))
    path = tmp_path / "s.npz"
    snapshot.save(path, cache)
    return cache, path


def refused(path, match):
    """Every reading entry point raises StateFileError naming the file; the target cache is unchanged."""
    target = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=8, window=4, sinks=1, max_chunk=2, dtype="float16"))
    target.append(np.ones((2, 1, 1, 8), np.float32), np.ones((2, 1, 1, 8), np.float32))
    keep = clone(target)
    for call in (lambda: snapshot.load(path), lambda: snapshot.restore(target, path),
                 lambda: snapshot.load_sequence(path, target, 0)):
        with pytest.raises(snapshot.StateFileError, match=rf"^{re.escape(str(path))}: .*{match}"):
            call()
    assert_same_state(target, keep)


def members_of(path):
    with np.load(path) as z:
        return {n: z[n] for n in z.files}


def test_a_flipped_compression_method_is_a_state_file_error(tmp_path):
    _, path = saved(tmp_path)
    raw = bytearray(path.read_bytes())
    at = raw.find(b"PK\x01\x02")                 # first central-directory record: method at offset 10
    raw[at + 10] ^= 0x01
    path.write_bytes(bytes(raw))
    refused(path, "compressed")


def test_deeply_nested_meta_json(tmp_path):
    _, path = saved(tmp_path)
    m = members_of(path)
    m["meta"] = np.frombuffer(b'{"format": "streamattn-kv", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                              np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **m)
    refused(path, "meta is not valid JSON")


@pytest.mark.parametrize("spec_change,match", [
    (dict(window=2**40), r"window must be at most"),
    (dict(window=1 << 24, kv_heads=1 << 12, head_dim=1 << 14), r"ask for \d+ bytes of K/V storage, more than"),
    (dict(batch=True), r"batch must be an integer"),
])
def test_sealed_meta_with_an_absurd_spec(tmp_path, spec_change, match):
    _, path = saved(tmp_path)
    rewrite(path, lambda m, meta: (meta["layers"][0]["spec"].update(spec_change), reseal(m, meta)))
    refused(path, match)


def test_max_bytes_bounds_what_a_file_may_allocate(tmp_path):
    cache, path = saved(tmp_path)
    assert cache.nbytes == 384
    with pytest.raises(snapshot.StateFileError, match=r"ask for 384 bytes of K/V storage, more than max_bytes=383"):
        snapshot.load(path, max_bytes=383)
    assert snapshot.load(path, max_bytes=384).lengths.tolist() == [5, 5]


def test_a_compressed_member_is_refused_before_it_is_inflated(tmp_path):
    """A deflate bomb: 64 MB of zeros in ~64 KB. Today's numpy would inflate it; we read the zip directory
    first and refuse compressed members (save never writes them)."""
    _, path = saved(tmp_path)
    m = members_of(path)
    m["layer0.k"] = np.zeros((2, 1, 4 << 20, 8), np.float16)
    with open(path, "wb") as f:
        np.savez_compressed(f, **m)
    assert path.stat().st_size < 1 << 20
    refused(path, r"member 'layer0.k.npy' is compressed \(method 8, \d+ -> 134217856 bytes\)")


def test_the_valid_file_recompressed_is_refused_too(tmp_path):
    _, path = saved(tmp_path)
    m = members_of(path)
    with open(path, "wb") as f:
        np.savez_compressed(f, **m)
    refused(path, "is compressed")


def npy_bytes(header: dict, payload: bytes) -> bytes:
    text = repr(header).encode()
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + payload


def test_an_npy_header_that_promises_more_than_the_member_holds(tmp_path):
    """The header of a stored member says 2**40 elements; numpy would allocate them before reading."""
    _, path = saved(tmp_path)
    m = members_of(path)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, a in m.items():
            b = io.BytesIO()
            np.save(b, a)
            z.writestr(name + ".npy", b.getvalue())
        z.writestr("huge.npy", npy_bytes({"descr": "<f8", "fortran_order": False, "shape": (1 << 40,)}, b"\0" * 64))
    path.write_bytes(buf.getvalue())
    refused(path, r"huge.npy: header says \(1099511627776,\)")


def test_an_object_member_is_refused(tmp_path):
    _, path = saved(tmp_path)
    m = members_of(path)
    m["evil"] = np.array([{"a": 1}], dtype=object)
    with open(path, "wb") as f:
        np.savez(f, **m)
    refused(path, "is not a member streamattn writes")


def test_meta_that_is_not_an_object(tmp_path):
    _, path = saved(tmp_path)
    m = members_of(path)
    for text in (b"[1, 2]", b'"streamattn-kv"', b'{"format": "streamattn-kv", "version": 1, "layout": "cache", '
                                                  b'"layers": {"a": 1}}'):
        meta = json.loads(text)
        if isinstance(meta, dict):
            reseal({k: v for k, v in m.items() if k != "meta"}, meta)
            text = json.dumps(meta).encode()
        m["meta"] = np.frombuffer(text, np.uint8)
        with open(path, "wb") as f:
            np.savez(f, **m)
        refused(path, "")
