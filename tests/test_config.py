"""One set of defaults: every settings class (the command line's ModelOptions, the server's ServeConfig,
Generator, token_losses) starts from EngineConfig's, and differs only where it says why."""

import dataclasses

import pytest

from streamattn.engine.options import DEFAULTS, EngineConfig, ModelOptions
from streamattn.serve.config import ServeConfig

#: The stated overrides (each a commented line in its class) and the engine's own value.
OVERRIDES = {ModelOptions: {"prefill_chunk": 256, "threads": 1},
             ServeConfig: {"prefill_chunk": 32, "threads": 1, "prompt_cache_mb": 256.0}}


@pytest.mark.parametrize("cls", [ModelOptions, ServeConfig])
def test_shared_fields_take_the_engine_defaults_unless_overridden(cls):
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    mine = {f.name: f.default for f in dataclasses.fields(cls) if f.name in engine}
    assert len(mine) >= 12                                   # the cache, thread, chunk and speculation fields
    differs = {k: v for k, v in mine.items() if v != engine[k]}
    assert differs == OVERRIDES[cls]


def test_the_server_and_the_command_line_build_the_engine_config_they_describe():
    assert ServeConfig().engine_config == dataclasses.replace(DEFAULTS, slots=4, **OVERRIDES[ServeConfig])
    opts = ModelOptions(cache="sinks", window=64, speculative="ngram", draft_max=3)
    cfg = opts.engine_config(slots=2)
    assert (cfg.slots, cfg.window_n, cfg.sinks_n, cfg.prefill_chunk, cfg.spec_params.draft_max) == (2, 64, 4, 256, 3)
    assert cfg.cache_kwargs["sinks"] == 4 and opts.sinks_n == 4 and opts.window_n == 64


def test_window_and_sinks_resolve_where_they_apply():
    assert EngineConfig().window_n is None and EngineConfig().sinks_n == 0
    assert EngineConfig(cache="window").window_n == 256 and EngineConfig(cache="window", sinks=9).sinks_n == 0
    assert EngineConfig(cache="sinks", window=32, sinks=2).cache_kwargs["sinks"] == 2


def test_generator_keywords_replace_the_config_fields():
    from types import SimpleNamespace
    from streamattn.engine.generate import Generator
    seen = []
    model = SimpleNamespace(new_caches=lambda **kw: seen.append(kw))
    g = Generator(model, None, EngineConfig(cache="window", window=16), prefill_chunk=8)
    assert g.config == EngineConfig(cache="window", window=16, prefill_chunk=8)
    assert seen[-1]["window"] == 16 and seen[-1]["max_chunk"] == 8
    assert Generator(model, None).config == DEFAULTS
    with pytest.raises(ValueError, match=r"prefill_chunk must be an integer >= 1 \(got 0\)"):
        Generator(model, None, prefill_chunk=0)
    with pytest.raises(TypeError, match="chunk_size"):
        Generator(model, None, chunk_size=8)


def _parsed(*argv):
    import argparse
    from streamattn.engine.options import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    return ModelOptions.from_args(p.parse_args(list(argv)))


def test_device_places_the_model_and_backend_gpu_keeps_meaning_it():
    """--device says where the model runs; the attention kernels follow it unless --backend names others,
    and --backend gpu alone still puts the model on the GPU (the flag it replaces)."""
    from streamattn.kv.backends import gpu
    here = "gpu" if gpu.available() else "cpu"
    assert (_parsed().device, _parsed().backend) == ("cpu", DEFAULTS.backend)
    assert (_parsed("--device", "gpu").device, _parsed("--device", "gpu").backend) == ("gpu", "gpu")
    assert (_parsed("--backend", "gpu").device, _parsed("--backend", "gpu").backend) == ("gpu", "gpu")
    assert _parsed("--device", "auto").device == here
    assert _parsed("--device", "auto", "--backend", "cpu").device == "cpu"
    assert _parsed("--device", "cpu", "--backend", "reference").backend == "reference"
    opts = ModelOptions(device="gpu", backend="auto")
    assert dataclasses.replace(opts, threads=2).device == "gpu"          # resolved values survive a replace
    with pytest.raises(ValueError, match="--device must be one of cpu, gpu, auto"):
        ModelOptions(device="tpu")
    if here == "cpu":
        with pytest.raises(ValueError, match="--device gpu: no CUDA device"):
            opts.check_device()
        with pytest.raises(ValueError, match="--backend gpu: no CUDA device.*use --backend cpu"):
            ModelOptions(backend="gpu").check_device()


def test_a_load_pauses_the_cyclic_gc_and_puts_it_back(tmp_path, monkeypatch):
    """Paused while the file is read, enabled after (also when the load fails); left off when it was off."""
    import gc
    from _model_util import write_tiny_gguf
    from streamattn.gguf import loader
    path = str(write_tiny_gguf(tmp_path / "t.gguf"))
    seen, real = [], loader.load_gguf

    def spy(*a, **k):
        seen.append(gc.isenabled())
        return real(*a, **k)
    monkeypatch.setattr(loader, "load_gguf", spy)
    assert gc.isenabled()
    tf, tok, m = ModelOptions(model=path).load()
    assert seen == [False] and gc.isenabled() and m.config.n_layers == tf.config.n_layers
    with pytest.raises(Exception, match="no such file"):
        ModelOptions(model=str(tmp_path / "absent.gguf")).load()
    assert gc.isenabled()
    gc.disable()
    try:
        ModelOptions(model=path).load()
        assert not gc.isenabled()
    finally:
        gc.enable()
