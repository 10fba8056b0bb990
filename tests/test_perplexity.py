"""Positions within the cache on a real model, and the teacher-forced perplexity tool (issue 15).

The long text of the benchmark (scripts/get_text.sh) is never needed here: tests/data/short_text.txt."""

import json
from pathlib import Path

import numpy as np
import pytest

from _model_util import load, need_smollm2, smollm2_path
from streamattn.engine.perplexity import bucket_perplexity, token_losses

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = Path(__file__).resolve().parent / "data" / "short_text.txt"


def ids(n):
    _, _, tok = load(smollm2_path())
    return tok.encode(TEXT.read_text())[:n]


def test_bucket_perplexity():
    nll = np.log([2.0, 2.0, 4.0, 4.0, 8.0])
    got = bucket_perplexity(nll, bucket=2)
    assert [(b["start"], b["end"]) for b in got] == [(0, 2), (2, 4), (4, 5)]
    np.testing.assert_allclose([b["ppl"] for b in got], [2.0, 4.0, 8.0])
    with pytest.raises(ValueError, match="bucket must be >= 1"):
        bucket_perplexity(nll, bucket=0)


@need_smollm2
def test_window_longer_than_the_text_cache_positions_equal_full():
    """Nothing ever slides: cache positions are the absolute ones, and logits equal the full cache's."""
    _, tf, _ = load(smollm2_path())
    x = np.asarray([ids(14)])
    full = tf.forward(x, tf.new_caches(mode="full", max_chunk=14))
    sink = tf.forward(x, tf.new_caches(mode="sinks", window=16, sinks=2, max_chunk=14), positions="cache")
    assert np.abs(full - sink).max() < 1e-3


@need_smollm2
def test_generator_cache_positions_match_full_within_the_window():
    from streamattn.engine.generate import Generator
    _, tf, tok = load(smollm2_path())
    prompt = ids(10)
    full = Generator(tf, tok, cache="full").generate(prompt, max_tokens=4)
    sinks = Generator(tf, tok, cache="sinks", window=30, sinks=2, positions="cache").generate(prompt, max_tokens=4)
    assert sinks == full and len(full) > 0
    with pytest.raises(ValueError, match="positions must be one of"):
        Generator(tf, tok, positions="relative")


@need_smollm2
def test_losses_chunked_equal_one_forward():
    """Teacher forcing through ring chunks = one forward of the whole text (full cache)."""
    _, tf, _ = load(smollm2_path())
    x = ids(21)
    logits = tf.forward(np.asarray([x]), tf.new_caches(mode="full", max_chunk=21))[0].astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = lse[:-1] - logits[np.arange(20), x[1:]]
    got = token_losses(tf, x, cache="full", chunk=6)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@need_smollm2
def test_cache_positions_change_losses_once_the_window_slides():
    _, tf, _ = load(smollm2_path())
    x = ids(25)
    kw = dict(cache="sinks", window=6, sinks=2, chunk=4)
    a = token_losses(tf, x, positions="absolute", **kw)
    c = token_losses(tf, x, positions="cache", **kw)
    np.testing.assert_allclose(a[:8], c[:8], atol=1e-4)        # i < n_s + n_c: the same positions
    assert np.abs(a[10:] - c[10:]).max() > 1e-3


@need_smollm2
def test_cli_writes_json_buckets_and_png(tmp_path, capsys):
    from streamattn.cli import main
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["perplexity", str(TEXT), "--cache", "sinks", "--window", "8", "--sinks", "2", "--positions",
               "cache", "--max-tokens", "24", "--prefill-chunk", "5", "--bucket", "10", "--json", str(out), "--png",
               str(png), "-q"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert (r["cache"], r["window"], r["sinks"], r["positions"], r["tokens"]) == ("sinks", 8, 2, "cache", 24)
    assert [(b["start"], b["end"]) for b in r["buckets"]] == [(0, 10), (10, 20), (20, 24)]
    assert all(1 < b["ppl"] < 1e5 for b in r["buckets"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["perplexity", str(TEXT), "--window", "8", "-q"]) == 2           # the shared flags' checks
    assert "--window 8 applies to --cache window or sinks" in capsys.readouterr().err
    assert main(["perplexity", str(tmp_path / "missing.txt"), "-q"]) == 2
