"""The packed weights' disk cache (streamattn/gguf/packed_cache.py, streamattn/quant/packed_file.py): a warm
load maps the bits a cold load packs, a damaged, stale or foreign file is rebuilt, an unusable folder
falls back to packing in memory, and two processes on one model share the weights' pages."""

import hashlib
import json
import mmap
import os
import struct
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

from _model_util import need_smollm2, smollm2_path, write_tiny_gguf
from streamattn.gguf import packed_cache
from streamattn.gguf.loader import load_gguf
from streamattn.models.transformer import Transformer
from streamattn.quant import matmul as qmatmul
from streamattn.quant import packed_file
from streamattn.quant.weights import QWeight

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not qmatmul.HAVE_KERNELS, reason="the packed kernels need AVX2")]

#: K-quants fused (q, k: Q4_K beside a Q6_K v does not fuse; gate/up Q4_K do), Q8_0 and Q5_K apart, the
#: embedding F32: a plane of the file's own bytes, recorded by its offset in the GGUF.
QUANT = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
         "ffn_up": "Q4_K", "ffn_down": "Q8_0"}
SIZE = dict(arch="llama", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512, vocab=96,
            matrix_scale=1 / 16)
PROMPT, STEPS = [5, 9, 3, 17, 4, 8, 60, 2], [40, 7, 88]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def tiny(tmp_path):
    return str(write_tiny_gguf(tmp_path / "tiny.gguf", quant=QUANT, **SIZE))


@pytest.fixture
def writes(monkeypatch):
    """The packed files written in the test: their paths, in order."""
    done, real = [], packed_file.write

    def counted(path, *a, **k):
        done.append(str(path))
        return real(path, *a, **k)
    monkeypatch.setattr(packed_file, "write", counted)
    return done


def logits(m, compiled=False):
    tf = Transformer(m)
    tf.compile_layers = compiled
    caches = tf.new_caches(batch=1, max_chunk=len(PROMPT))
    out = [tf.forward(np.array([PROMPT]), caches)[0]]
    out += [tf.forward(np.array([[t]]), caches)[0] for t in STEPS]
    return np.concatenate(out)


def planes(m) -> dict:
    """Every packed matrix's fields and planes, fused groups included."""
    out = {}
    for key, w in [*m.weights.items(), *m.fused.items()]:
        if isinstance(w, QWeight):
            out[key] = (w.kind, w.shape, w.group, w.source, w.lanes,
                        *[None if p is None else (p.dtype.str, p.shape, p.tobytes()) for p in (w.qs, w.scale, w.minv)])
    return out


def the_file(folder) -> str:
    files = [f for f in os.listdir(folder) if f.endswith(".packed")]
    assert len(files) == 1, files
    return os.path.join(folder, files[0])


def index_of(path) -> dict:
    """The index of a packed file, read by its documented layout (header: magic, format, 0, offset, length)."""
    with open(path, "rb") as f:
        _, _, _, at, length, _ = struct.unpack("<8sIIQQ32s", f.read(64))
        f.seek(at)
        return json.loads(f.read(length))


def mapped_file_of(a: np.ndarray):
    """The mmap an array's memory belongs to (None for numpy's own allocations)."""
    while a is not None and not isinstance(a, mmap.mmap):
        a = getattr(a, "base", None) if isinstance(a, np.ndarray) else getattr(a, "obj", None)
    return a


def test_warm_load_maps_the_bits_a_cold_load_packs(tiny, tmp_path, writes):
    cache = tmp_path / "cache"
    memory = load_gguf(tiny, packed_cache=False)
    cold = load_gguf(tiny, packed_cache=cache)
    assert len(writes) == 1
    warm = load_gguf(tiny, packed_cache=cache)
    assert len(writes) == 1                                  # mapped, not rebuilt
    want = planes(memory)
    assert {w.kind for w in memory.weights.values() if isinstance(w, QWeight)} == {"q4k", "q6k", "q5", "q8", "f32"}
    assert any(len(k) == 2 for k in memory.fused)            # gate/up fused
    assert planes(cold) == want and planes(warm) == want
    assert memory.fused.keys() == warm.fused.keys()
    for w in warm.weights.values():                          # views of a map, writable (Numba's types unchanged)
        if isinstance(w, QWeight):
            assert mapped_file_of(w.qs) is not None and w.qs.flags.writeable
    for names, whole in warm.fused.items():                  # parts are views of their group, held once
        assert all(np.shares_memory(warm.weights[n].qs, whole.qs) for n in names)
    entries = index_of(the_file(cache))["weights"]
    held = [n for e in entries for n in (e["key"] if isinstance(e["key"], list) else [e["key"]])]
    assert sorted(held) == sorted(n for n, w in memory.weights.items() if isinstance(w, QWeight))
    embd = next(e for e in entries if e["key"] == "token_embd.weight")
    assert "source" in embd["planes"][0]                     # the GGUF's own bytes, not copied
    ref = logits(memory)
    np.testing.assert_array_equal(logits(warm), ref)
    np.testing.assert_array_equal(logits(warm, compiled=True), ref)
    assert ref.std(axis=-1).min() > 0.01


@need_smollm2
def test_smollm2_mapped_from_the_cache_gives_the_logits_of_a_load_in_memory(tmp_path):
    model, cache = smollm2_path(), tmp_path / "cache"
    memory = load_gguf(model, packed_cache=False)
    cold = load_gguf(model, packed_cache=cache)
    warm = load_gguf(model, packed_cache=cache)
    want = planes(memory)
    assert planes(cold) == want and planes(warm) == want
    ref = logits(memory, compiled=True)
    np.testing.assert_array_equal(logits(cold, compiled=True), ref)
    np.testing.assert_array_equal(logits(warm, compiled=True), ref)
    np.testing.assert_array_equal(logits(warm), ref)             # the array layers too


def damage(path, how):
    data = bytearray(open(path, "rb").read())
    at = index_of(path)
    if how == "payload byte":
        data[packed_file.PAGE + (at["end"] - packed_file.PAGE) // 2] ^= 0x10
    elif how == "index byte":
        data[-10] ^= 0x01
    elif how == "header byte":
        data[3] ^= 0xFF
    elif how == "truncated":
        data = data[:len(data) - 1000]
    elif how == "empty":
        data = b""
    elif how == "garbage":
        data = np.random.default_rng(0).integers(0, 256, len(data), dtype=np.uint8).tobytes()
    elif how in ("a plane too short", "a plane past the end", "a matrix renamed"):   # a re-signed index
        e = next(e for e in at["weights"] if e["kind"] == "q4k")
        if how == "a plane too short":
            e["planes"][0]["shape"][1] -= 4
        elif how == "a plane past the end":
            e["planes"][0]["offset"] = at["end"] - 64
        else:
            e["key"] = "blk.1.attn_output.weight" if e["key"] != "blk.1.attn_output.weight" else "blk.0.attn_output.weight"
        index = json.dumps(at).encode()
        start = struct.unpack("<8sIIQQ32s", bytes(data[:64]))[3]
        data = data[:start] + index
        data[:64] = struct.pack("<8sIIQQ32s", packed_file.MAGIC, packed_file.FORMAT, 0, start, len(index),
                                hashlib.sha256(index).digest())
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("how", ["payload byte", "index byte", "header byte", "truncated", "empty", "garbage",
                                 "a plane too short", "a plane past the end"])
def test_a_damaged_file_is_detected_and_rebuilt(tiny, tmp_path, writes, how):
    cache = tmp_path / "cache"
    want = planes(load_gguf(tiny, packed_cache=False))
    load_gguf(tiny, packed_cache=cache)
    path = the_file(cache)
    key = index_of(path)["key"]
    damage(path, how)
    with pytest.raises(packed_file.Miss, match="damaged|shorter|not a packed|malformed"):
        packed_file.read(path, key, source=tiny)
    assert planes(load_gguf(tiny, packed_cache=cache)) == want
    assert writes == [path, path]                            # rebuilt in place, once
    packed_file.read(path, key, source=tiny)                 # whole again
    assert not [f for f in os.listdir(cache) if f.endswith(".tmp")]


def test_an_index_that_misnames_a_matrix_is_rebuilt(tiny, tmp_path, writes):
    """Planes that fit their weight but under another tensor's name (an index re-signed by hand): the loader
    checks the names and shapes against the GGUF's tensor table, and rebuilds."""
    cache = tmp_path / "cache"
    want = planes(load_gguf(tiny, packed_cache=False))
    load_gguf(tiny, packed_cache=cache)
    path = the_file(cache)
    damage(path, "a matrix renamed")
    packed_file.read(path, index_of(path)["key"], source=tiny)          # the file itself reads
    assert planes(load_gguf(tiny, packed_cache=cache)) == want
    assert writes == [path, path]


@pytest.mark.parametrize("change", ["mtime", "size", "layout version", "sources"])
def test_a_stale_file_misses(tiny, tmp_path, writes, monkeypatch, change):
    cache = tmp_path / "cache"
    load_gguf(tiny, packed_cache=cache)
    old = index_of(the_file(cache))["key"]
    if change == "mtime":
        st = os.stat(tiny)
        os.utime(tiny, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    elif change == "size":
        with open(tiny, "ab") as f:                          # bytes after the last tensor: still a valid GGUF
            f.write(bytes(64))
    elif change == "layout version":
        monkeypatch.setattr(packed_cache, "LAYOUT_VERSION", packed_cache.LAYOUT_VERSION + 1)
    else:
        monkeypatch.setattr(packed_cache, "_sources_digest", lambda: "another packing")
    with pytest.raises(packed_file.Miss, match="stale"):
        packed_file.read(the_file(cache), packed_cache.key(tiny, _header(tiny), old["lanes"]), source=tiny)
    m = load_gguf(tiny, packed_cache=cache)
    assert len(writes) == 2 and index_of(the_file(cache))["key"] != old
    assert planes(m) == planes(load_gguf(tiny, packed_cache=False))


def crc_reads(monkeypatch) -> list:
    """The chunks whose CRC-32 is computed from here on (one entry each)."""
    done, real = [], packed_file._crc_of

    def counted(view):
        done.append(len(view))
        return real(view)
    monkeypatch.setattr(packed_file, "_crc_of", counted)
    return done


def test_a_file_checked_whole_is_read_again_only_once_it_changed(tiny, tmp_path, writes, monkeypatch):
    """A whole check is recorded (once the file has settled) and a later load of the same file skips the
    CRC-32s; a write to the file after that check sends it through the whole check again: rebuilt."""
    cache = tmp_path / "cache"
    want = planes(load_gguf(tiny, packed_cache=False))
    load_gguf(tiny, packed_cache=cache)                      # built: just written, nothing recorded
    path = the_file(cache)
    crcs = crc_reads(monkeypatch)
    monkeypatch.setattr(packed_file, "SETTLE_S", 3600.0)     # (a slow host must not let the file settle)
    load_gguf(tiny, packed_cache=cache)                      # the file changed under SETTLE_S ago: not recorded
    assert crcs and not os.path.exists(path + packed_file.STAMP)
    monkeypatch.setattr(packed_file, "SETTLE_S", 0.0)
    crcs.clear()
    load_gguf(tiny, packed_cache=cache)                      # whole check, recorded
    assert crcs and os.path.exists(path + packed_file.STAMP)
    crcs.clear()
    assert planes(load_gguf(tiny, packed_cache=cache)) == want and not crcs     # unchanged: no CRC-32 read
    recorded = json.loads(open(path + packed_file.STAMP).read())
    time.sleep(0.1)                                          # past the file system clock's tick
    damage(path, "payload byte")
    assert os.stat(path).st_ctime_ns != recorded["ctime_ns"]
    assert planes(load_gguf(tiny, packed_cache=cache)) == want
    assert crcs and writes == [path, path]                   # checked whole, found damaged, rebuilt
    assert not os.path.exists(path + packed_file.STAMP)      # the rebuilt file has no record yet


def test_read_refuses_an_unknown_verify(tiny, tmp_path):
    load_gguf(tiny, packed_cache=tmp_path)
    with pytest.raises(ValueError, match="verify must be True, False or 'changed' .got 'yes'"):
        packed_file.read(the_file(tmp_path), {}, verify="yes")


def test_a_rebuild_leaves_no_packed_file_of_an_old_version(tiny, tmp_path, writes):
    """Rebuilt for a changed model file: the file of the same name is replaced, and the model's file for the
    other lanes, built from the old version, is deleted; one built from the current version stays."""
    cache = tmp_path / "cache"
    load_gguf(tiny, packed_cache=cache)
    path = the_file(cache)
    lanes = index_of(path)["key"]["lanes"]
    other = str(packed_cache.file_for(cache, tiny, next(n for n in packed_cache.ALL_LANES if n != lanes)))
    with open(path, "rb") as f, open(other, "wb") as g:     # (its key names the lanes of this CPU; only its
        g.write(f.read())                                    # "gguf" part decides whether it is old)
    damage(path, "payload byte")                             # rebuilt, the model file unchanged: the other stays
    load_gguf(tiny, packed_cache=cache)
    assert os.path.exists(other) and len(writes) == 2
    st = os.stat(tiny)
    os.utime(tiny, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    load_gguf(tiny, packed_cache=cache)                      # a new version: the old one's files go
    assert len(writes) == 3 and not os.path.exists(other)
    assert sorted(f for f in os.listdir(cache) if not f.endswith(".lock")) == [os.path.basename(path)]


def test_key_of_reads_the_index_alone(tiny, tmp_path):
    load_gguf(tiny, packed_cache=tmp_path)
    path = the_file(tmp_path)
    assert packed_file.key_of(path) == index_of(path)["key"]
    damage(path, "index byte")
    with pytest.raises(packed_file.Miss, match="damaged"):
        packed_file.key_of(path)
    with pytest.raises(packed_file.Miss, match="absent"):
        packed_file.key_of(path + ".nothing")


def _header(path):
    from streamattn.gguf.reader import GGUFFile
    r = GGUFFile(path)
    return r.data[:r.header_size]


def test_the_key_reads_the_header_not_the_tensor_data(tiny):
    """A changed tensor byte with the same size, mtime and header gives the same key (the data is not read);
    a changed metadata byte a different one."""
    from streamattn.gguf.reader import GGUFFile
    r = GGUFFile(tiny)
    k = packed_cache.key(tiny, r.data[:r.header_size], 8)
    data, st = bytearray(open(tiny, "rb").read()), os.stat(tiny)
    data[r.tensors[0].data_offset] ^= 1
    with open(tiny, "wb") as f:
        f.write(data)
    os.utime(tiny, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert packed_cache.key(tiny, _header(tiny), 8) == k
    data[r.header_size // 2] ^= 1
    with open(tiny, "wb") as f:
        f.write(data)
    os.utime(tiny, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert packed_cache.key(tiny, bytes(data[:r.header_size]), 8) != k


def test_an_unusable_folder_warns_and_packs_in_memory(tiny, tmp_path):
    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="packed-weights cache .*packing .* in memory"):
        m = load_gguf(tiny, packed_cache=blocked)
    assert planes(m) == planes(load_gguf(tiny, packed_cache=False))
    assert all(mapped_file_of(w.qs) is None for w in m.weights.values() if isinstance(w, QWeight))


def test_the_folder_follows_the_option_and_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(packed_cache.ENV, raising=False)
    monkeypatch.setenv("STREAMATTN_HOME", str(tmp_path))
    big = packed_cache.MIN_BYTES
    assert packed_cache.folder(None, big) == tmp_path / "packed"        # beside <home>/models
    assert packed_cache.folder(None, big - 1) is None                   # small files: packed in memory
    assert packed_cache.folder(True, 1) == tmp_path / "packed"          # ... unless asked
    assert packed_cache.folder(tmp_path / "x", 1) == tmp_path / "x"
    assert packed_cache.folder(False, big) is None
    monkeypatch.setenv(packed_cache.ENV, "off")
    assert packed_cache.folder(None, big) is None
    monkeypatch.setenv(packed_cache.ENV, str(tmp_path / "y"))
    assert packed_cache.folder(None, 1) == tmp_path / "y"
    a, b = packed_cache.file_for(tmp_path, "m.gguf", 8), packed_cache.file_for(tmp_path, "m.gguf", 16)
    assert a != b and a.name.startswith("m.")                           # one file per CPU target


_LOADER = textwrap.dedent("""
    import json, sys
    from streamattn.gguf.loader import load_gguf
    import numpy as np
    from streamattn.quant.weights import QWeight
    m = load_gguf(sys.argv[1], packed_cache=sys.argv[2] if sys.argv[2] != "off" else False)
    for w in [*m.weights.values(), *m.fused.values()]:   # a byte of every page, as a forward pass reads
        for p in (w.qs, w.scale, w.minv) if isinstance(w, QWeight) else ():
            if p is not None:
                p.reshape(-1).view(np.uint8)[::4096].sum()
    def mapping(path):          # this process's pages of the packed file, from /proc/self/smaps
        got, inside = {}, False
        for line in open("/proc/self/smaps"):
            head = line.split()
            if not line[0].isupper() or ":" not in head[0]:          # a mapping's first line
                inside = head[-1] == path
            elif inside and head[0][:-1] in ("Rss", "Private_Clean", "Private_Dirty", "Shared_Clean",
                                                                   "Shared_Dirty", "Anonymous"):
                got[head[0][:-1]] = got.get(head[0][:-1], 0) + int(head[1]) * 1024
        return got
    got = mapping(sys.argv[3])
    for line in open("/proc/self/smaps_rollup"):        # the whole process's private pages
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            got["process_private"] = got.get("process_private", 0) + int(line.split()[1]) * 1024
    print(json.dumps(got), flush=True)
    sys.stdin.read()            # hold the map until told
""")


def _start(model, cache, path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-c", _LOADER, model, str(cache), path], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = p.stdout.readline()
    assert line, f"the loader process failed (exit {p.wait()})"
    return p, json.loads(line)


@need_smollm2
def test_two_processes_on_one_model_share_its_pages(tmp_path):
    """The second process's pages of the packed file are the first's (Shared), not its own (Private); the
    control: one process alone holds them as Private, so the measure can tell the two apart."""
    model, cache = smollm2_path(), tmp_path / "cache"
    load_gguf(model, packed_cache=cache)
    path = the_file(cache)
    payload = index_of(path)["end"] - packed_file.PAGE
    first, _ = _start(model, cache, path)                # (the loader reads a byte of every page)
    try:
        second, seen = _start(model, cache, path)
        second.communicate("")
    finally:
        first.communicate("")
    alone, control = _start(model, cache, path)
    alone.communicate("")
    packing, in_memory = _start(model, "off", path)
    packing.communicate("")
    print(f"\npayload {payload / 1e6:.1f} MB; second process: {seen}; alone: {control}; in memory: {in_memory}")
    # the whole process (smaps_rollup): one packing in memory holds the planes privately, the second does not
    assert in_memory["process_private"] - seen["process_private"] >= 0.8 * payload
    assert seen["Rss"] >= 0.9 * payload                  # the pages are mapped ...
    assert seen["Private_Clean"] + seen["Private_Dirty"] <= 0.05 * payload    # ... and shared
    assert control["Private_Clean"] + control["Private_Dirty"] >= 0.9 * payload
    assert seen.get("Anonymous", 0) == control.get("Anonymous", 0) == 0          # no page copied on write


def test_concurrent_cold_loads_build_one_whole_file(tiny, tmp_path):
    cache = tmp_path / "cache"
    code = "import sys; from streamattn.gguf.loader import load_gguf; load_gguf(sys.argv[1], packed_cache=sys.argv[2])"
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", code, tiny, str(cache)], env=env, cwd=ROOT) for _ in range(3)]
    assert [p.wait() for p in procs] == [0, 0, 0]
    path = the_file(cache)
    assert not [f for f in os.listdir(cache) if f.endswith(".tmp")]
    packed_file.read(path, index_of(path)["key"], source=tiny)    # whole: every CRC-32 holds
    assert planes(load_gguf(tiny, packed_cache=cache)) == planes(load_gguf(tiny, packed_cache=False))


def _two_lanes(tiny, cache):
    """Build the model's packed file, and a copy of it standing for the other lanes' file: (this, other)."""
    load_gguf(tiny, packed_cache=cache)
    path = the_file(cache)
    lanes = index_of(path)["key"]["lanes"]
    other = str(packed_cache.file_for(cache, tiny, next(n for n in packed_cache.ALL_LANES if n != lanes)))
    with open(path, "rb") as f, open(other, "wb") as g:
        g.write(f.read())
    return path, other


def _touch(path, seconds):
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def test_a_file_of_a_newer_version_of_the_model_stays(tiny, tmp_path, writes):
    """Two hosts sharing a folder, each with its copy of the model made at another time: the rebuild for the
    older copy leaves the other lanes' file of the newer copy (neither deletes the other's, so neither
    rebuilds at every other run)."""
    cache = tmp_path / "cache"
    path, other = _two_lanes(tiny, cache)
    _touch(tiny, -5)                                         # this host's copy is older than the other's
    load_gguf(tiny, packed_cache=cache)
    assert len(writes) == 2 and os.path.exists(other)


def test_a_file_whose_lock_is_held_is_not_deleted(tiny, tmp_path, writes):
    """The other lanes' file of an old version, locked by a process (rebuilding it), stays: that one decides."""
    import fcntl
    cache = tmp_path / "cache"
    path, other = _two_lanes(tiny, cache)
    _touch(tiny, 1)
    fd = os.open(other + ".lock", os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        load_gguf(tiny, packed_cache=cache)
        assert len(writes) == 2 and os.path.exists(other)
    finally:
        os.close(fd)
    _touch(tiny, 1)
    load_gguf(tiny, packed_cache=cache)                      # unlocked now: deleted
    assert len(writes) == 3 and not os.path.exists(other)


def test_a_failed_deletion_keeps_the_rebuilt_file(tiny, tmp_path, writes, monkeypatch):
    """Deleting an old version's file fails (a folder shared between users): the rebuild stands, mapped from
    disk, no warning, no second packing."""
    cache = tmp_path / "cache"
    path, other = _two_lanes(tiny, cache)
    _touch(tiny, 1)

    def refused(f):
        raise PermissionError(13, "Permission denied", str(f))
    monkeypatch.setattr(packed_file, "remove", refused)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_gguf(tiny, packed_cache=cache)
    assert len(writes) == 2 and os.path.exists(other) and os.path.exists(path)


def _vm_flags(address: int) -> list:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        lines = f.readlines()
    for line in lines:
        head = line.split()
        if not line[0].isupper() or ":" not in head[0]:          # a mapping's first line: start-end ...
            start, end = (int(x, 16) for x in head[0].split("-"))
            inside = start <= address < end
        elif inside and head[0] == "VmFlags:":
            return head[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _takes_huge_page_advice() -> bool:
    """Whether this kernel has transparent huge pages and takes MADV_HUGEPAGE on a file map."""
    if not os.path.exists("/sys/kernel/mm/transparent_hugepage") or not os.path.exists("/proc/self/smaps"):
        return False
    with open(__file__, "rb") as f:
        probe = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        return "MADV_HUGEPAGE" in packed_file._advise(probe, ("MADV_HUGEPAGE",))
    finally:
        probe.close()


def test_a_mapped_model_asks_for_huge_pages(tiny, tmp_path):
    """The packed file's map (and the model file's, for the planes it holds) carries the huge-page advice
    (smaps' ``hg``): the kernel may then map the page cache's 2 MiB folios whole."""
    if not _takes_huge_page_advice():
        pytest.skip("this kernel has no transparent huge pages (or refuses MADV_HUGEPAGE on a file map)")
    cache = tmp_path / "cache"
    load_gguf(tiny, packed_cache=cache)
    warm = load_gguf(tiny, packed_cache=cache)
    w = warm.weights["blk.0.attn_q.weight"]
    assert mapped_file_of(w.qs) is not None
    assert "hg" in _vm_flags(w.qs.ctypes.data)
    embd = warm.weights["token_embd.weight"]                 # a plane of the GGUF's own bytes
    assert "hg" in _vm_flags(embd.qs.ctypes.data)


def test_a_map_without_madvise_gets_no_advice():
    """A map object without ``madvise`` (Windows' mmap) is left as it is, no error: advice is a hint."""
    assert packed_file._advise(object()) == []


def test_advice_the_kernel_refuses_leaves_loading_working(tiny, tmp_path, monkeypatch):
    """An advice value the kernel does not know (EINVAL) is skipped: the weights load, the same bits."""
    cache = tmp_path / "cache"
    want = planes(load_gguf(tiny, packed_cache=False))
    load_gguf(tiny, packed_cache=cache)
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)
    with open(the_file(cache), "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    took = packed_file._advise(mm)
    mm.close()
    assert "MADV_HUGEPAGE" not in took
    assert took == (["MADV_WILLNEED"] if hasattr(mmap, "MADV_WILLNEED") else [])
    assert planes(load_gguf(tiny, packed_cache=cache)) == want
