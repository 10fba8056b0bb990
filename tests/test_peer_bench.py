"""benchmarks/peer_llamacpp.py without node: parsing both engines' output, medians, ratios, table, PNG."""

import importlib.util
import json
import statistics
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
    assert "decode_steps_on_ceiling" not in r                   # one thread: the line has no count
    two = peer.parse_ours("[prompt 705 tokens, prefill 1610 ms; 127 decode steps, 117.1 tok/s; 6 on 2 threads]")
    assert (two["decode_steps"], two["decode_steps_on_ceiling"]) == (127, 6)
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
    assert one["noise"] == 0 and "wall_tok_s" not in one                   # runs without noise or probe
    assert two["llama.cpp"] is None and two["decode_ratio"] is None        # a missing engine, not a crash
    table = peer.markdown(rows).splitlines()
    assert len(table) == 4 and "quiet" in table[0] and "wall" not in table[0]
    assert table[2] == "| smollm2 | 1 | 130 / 50 | 0.38× | 250 / 310 | 1.24× | 291 / 901 |"
    assert table[3].startswith("| smollm2 | 2 | – / 70 | –× |")
    png = tmp_path / "p.png"
    assert peer.plot(rows, png) and png.stat().st_size > 1000


def test_quiet_and_noisy_side_by_side_with_the_memory_wall():
    runs = []
    for duty, slow in ((0, 1.0), (50, 0.5)):
        for engine, dec in (("streamattn", 60.0), ("llama.cpp", 40.0)):
            for rep, gbps in ((0, 20.0), (1, 30.0)):
                wall_tok_s = gbps * 1e9 / 100e6                           # 100 MB a step
                runs.append({"model": "smollm2", "threads": 2, "noise": duty, "engine": engine,
                             "decode_tok_s": dec * slow, "prefill_tok_s": 300.0 * slow, "rss_mb": 300.0,
                             "prompt_tokens": 705, "wall_tok_s": wall_tok_s, "ceiling_gbps": gbps,
                             "wall_pct": 100 * dec * slow / wall_tok_s})
    rows = peer.summarize(runs)
    assert [r["noise"] for r in rows] == [0, 50]
    quiet, noisy = rows
    assert quiet["wall_tok_s"] == pytest.approx(250) and quiet["ceiling_gbps"] == pytest.approx(25)
    assert noisy["streamattn"]["wall_pct"] == pytest.approx(statistics.median([30 / 200 * 100, 30 / 300 * 100]))
    head, _, row = peer.markdown(rows).splitlines()
    assert head.index("quiet") < head.index("noise 50%") and "memory wall tok/s" in head
    assert row.startswith("| smollm2 | 2 | 40 (17%) / 60 (25%) | 1.50× | 20 (8%) / 30 (12%) | 1.50× | "
                          "300 / 300 | 1.00× | 150 / 150 | 1.00× | 250 |")


@pytest.mark.parametrize("given, levels", [(None, [0]), ([], [50]), (["both"], [0, 50]), (["30"], [30]),
                                           (["0", "12.5", "0"], [0, 12.5]), (["both", "100"], [0, 50, 100])])
def test_noise_levels(given, levels):
    assert peer.noise_levels(given) == levels


@pytest.mark.parametrize("bad", ["150", "-1", "half"])
def test_bad_noise_is_refused_by_name(bad, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        peer.main(["--noise", bad, "--peer-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--noise takes duty percents in 0..100" in err and repr(bad) in err


def test_a_run_with_both_noise_levels_and_the_wall(tmp_path, monkeypatch, capsys):
    """main() end to end with the engines and the probe stood in: every run of both engines has the
    neighbour at the asked duty (a real process, reaped after), quiet and noisy alternate, files appear."""
    (tmp_path / "peer" / "node_modules" / "node-llama-cpp").mkdir(parents=True)
    active, pids, seen = [], [], []

    class Recorded(peer.noise.Noise):
        def __enter__(self):
            active.append(super().__enter__())
            pids.extend([self.proc.pid] if self.proc else [])
            return self

        def __exit__(self, *exc):
            active.remove(self)
            return super().__exit__(*exc)

    def fake_run(engine, model_path, threads, tokens, ours_args, peer_dir, timeout, **where):
        seen.append((engine, [n.duty for n in active if n.proc is not None and n.proc.poll() is None]))
        return peer.rates({"prompt_tokens": 705, "prefill_s": 2.0, "decode_steps": tokens - 1,
                           "decode_s": (tokens - 1) / (50.0 if engine == "streamattn" else 40.0)}) | {
            "rss_mb": 300.0, "wall_s": 3.0}

    monkeypatch.setattr(peer.noise, "Noise", Recorded)
    monkeypatch.setattr(peer, "run_one", fake_run)
    monkeypatch.setattr(peer, "resolve_path", lambda name: tmp_path / "m.gguf")
    prof = {"weights": 100_000_000, "kv_per_key": [768] * 30, "windows": [None] * 30, "tied": True,
            "file_bytes": 1}
    monkeypatch.setattr(peer, "child_json", lambda args, env=None, timeout=0: prof)
    monkeypatch.setattr(peer, "probe_wall", lambda threads, mb, timeout: {"threads": threads, "gbps": 20.0})
    assert peer.main(["--models", "smollm2", "--threads", "1", "--repeats", "2", "--tokens", "8", "--noise",
                      "both", "--peer-dir", str(tmp_path / "peer"), "--out", str(tmp_path), "--tag", "t"]) == 0
    # repeat 0: the quiet pair, then the noisy pair; repeat 1 in reverse order
    assert seen == [("streamattn", []), ("llama.cpp", []), ("streamattn", [0.5]), ("llama.cpp", [0.5]),
                    ("llama.cpp", [0.5]), ("streamattn", [0.5]), ("llama.cpp", []), ("streamattn", [])]
    assert len(pids) == 4 and all(_gone(pid) for pid in pids) and not active
    doc = json.loads((tmp_path / "peer_llamacpp_t.json").read_text())
    noisy = [r for r in doc["runs"] if r["noise"] == 50]
    assert len(noisy) == 4 and all("noise_duty_achieved" in r for r in noisy) and len(doc["probes"]) == 2
    per_step = 100e6 + 30 * 768 * statistics.mean(range(706, 713))      # positions 705..711 see 706..712 keys
    assert doc["runs"][0]["bytes_per_step"] == pytest.approx(per_step)
    assert doc["summary"][0]["streamattn"]["wall_pct"] == pytest.approx(100 * 50 * per_step / 20e9)
    md = (tmp_path / "peer_llamacpp_t.md").read_text()
    assert "noise 50%" in md and "memory wall" in md and (tmp_path / "peer_llamacpp_t.png").is_file()


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def test_missing_peer_is_a_clear_error(tmp_path, capsys):
    assert peer.main(["--peer-dir", str(tmp_path)]) == 2
    assert "scripts/install_llamacpp_peer.sh" in capsys.readouterr().err


def test_models_take_short_names_and_files(tmp_path):
    f = tmp_path / "llama-3.2-1b-q4_k_m.gguf"
    f.write_bytes(b"GGUF")
    assert peer.model_labels(["smollm2", str(f)]) == {"smollm2": "smollm2", str(f): "llama-3.2-1b-q4_k_m"}
    with pytest.raises(ValueError, match="neither a short name"):
        peer.model_labels([str(tmp_path / "absent.gguf")])
    with pytest.raises(SystemExit):
        peer.main(["--models", "nosuchmodel"])
