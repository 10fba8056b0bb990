"""benchmarks/peer_llamacpp.py without node: parsing both engines' output, medians, ratios, table, PNG."""

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "peer_llamacpp.py"
_spec = importlib.util.spec_from_file_location("peer_llamacpp", _PATH)
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)


def test_parse_ours_takes_the_stats_line():
    err = ("loading x.gguf: 272/272 tensors\nprefill 705/705 tokens\n"
           "[prompt 705 tokens, prefill 2050 ms; 127 decode steps, 50.8 tok/s]\n")
    r = peer.rates(peer.parse_ours(err))
    assert (r["prompt_tokens"], r["decode_steps"]) == (705, 127)
    assert r["prefill_tok_s"] == pytest.approx(705 / 2.05) and r["decode_tok_s"] == pytest.approx(50.8)
    with pytest.raises(ValueError, match="no '\\[prompt N tokens"):
        peer.parse_ours("Traceback: boom")


def test_parse_peer_skips_noise_and_needs_the_result_line():
    line = {"prompt_tokens": 705, "prefill_s": 2.9, "decode_s": 1.0, "decode_steps": 127, "token_ids": [1, 2],
            "llama_cpp": {"release": "b1"}}
    r = peer.rates(peer.parse_peer("[node-llama-cpp] warming up\n{not json\n" + json.dumps(line) + "\n"))
    assert r["decode_tok_s"] == 127 and r["prefill_tok_s"] == pytest.approx(705 / 2.9)
    assert "token_ids" not in r and r["llama_cpp"] == {"release": "b1"}
    with pytest.raises(ValueError, match="no JSON result line"):
        peer.parse_peer(json.dumps({"prompt_tokens": 1}))


def _runs():
    runs = []
    for engine, dec, pre, rss in (("streamattn", (50, 60, 40), (300, 320, 310), 900),
                                  ("llama.cpp", (130, 140, 120), (240, 250, 260), 290)):
        for i in range(3):
            runs.append({"model": "smollm2", "threads": 1, "engine": engine, "decode_tok_s": dec[i],
                         "prefill_tok_s": pre[i], "rss_mb": rss + i, "prompt_tokens": 705})
    runs.append({"model": "smollm2", "threads": 2, "engine": "streamattn", "decode_tok_s": 70,
                 "prefill_tok_s": 350, "rss_mb": 910, "prompt_tokens": 705})
    return runs


def test_summary_medians_ratios_table_and_png(tmp_path):
    rows = peer.summarize(_runs())
    one, two = rows
    assert one["streamattn"]["decode_tok_s"] == 50 and one["llama.cpp"]["decode_tok_s"] == 130   # medians
    assert one["decode_ratio"] == pytest.approx(50 / 130) and one["prefill_ratio"] == pytest.approx(310 / 250)
    assert one["n_streamattn"] == one["n_llama.cpp"] == 3 and one["llama.cpp"]["rss_mb"] == 291
    assert two["llama.cpp"] is None and two["decode_ratio"] is None        # a missing engine, not a crash
    table = peer.markdown(rows).splitlines()
    assert len(table) == 4 and table[2].startswith("| smollm2 | 1 | 130 | 50 | 0.38× | 250 | 310 | 1.24× |")
    assert "| – |" in table[3]
    png = tmp_path / "p.png"
    assert peer.plot(rows, png) and png.stat().st_size > 1000


def test_missing_peer_is_a_clear_error(tmp_path, capsys):
    assert peer.main(["--peer-dir", str(tmp_path)]) == 2
    assert "scripts/install_llamacpp_peer.sh" in capsys.readouterr().err
