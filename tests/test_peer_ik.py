"""benchmarks/peer_llamacpp.py with ik_llama.cpp as a peer, without its binary: llama-bench's command line,
its JSON parsed, the prompt cut to a token count, both peers in one table, main() end to end stood in."""

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from streamattn.bench.prompt_tokens import cut

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "peer_llamacpp.py"
_spec = importlib.util.spec_from_file_location("peer_llamacpp_ik", _PATH)
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)


def _test(n_prompt: int, n_gen: int, avg_ts: float, label: str) -> str:
    """One test object as llama-bench -o json prints it (a subset of its fields, its layout)."""
    fields = {"build_commit": "8337e4cd", "build_number": 4321, "cpu_info": "AMD EPYC", "model_filename": "m.gguf",
              "model_type": "llama 1B Q4_K - Medium", "n_threads": 2, "type_k": "f16", "flash_attn": True,
              "repack": True, "n_prompt": n_prompt, "n_gen": n_gen, "test_time": "2026-12-07T12:00:00Z",
              "avg_ns": int((n_prompt or n_gen) / max(avg_ts, 1e-9) * 1e9), "stddev_ns": 0, "avg_ts": avg_ts,
              "stddev_ts": 0.0, "test": label}
    body = "".join(f"    {json.dumps(k)}: {json.dumps(v)},\n" for k, v in fields.items())
    return f"  {{\n{body}    \"samples_ns\": [ 1 ],\n    \"samples_ts\": [ {avg_ts} ]\n  }}"


SAMPLE = "[\n" + _test(512, 0, 64.0, "pp512") + ",\n" + _test(0, 64, 16.0, "tg64") + "\n]\n"


def test_llama_bench_command():
    cmd = peer.ik_command(Path("/x/llama-bench"), Path("/m/a.gguf"), threads=2, prompt_tokens=512, decode_steps=64)
    assert cmd == ["/x/llama-bench", "-m", "/m/a.gguf", "-rtr", "1", "-p", "512", "-n", "64", "-t", "2", "-r", "1",
                   "-o", "json"]
    with pytest.raises(ValueError, match="must be >= 1"):
        peer.ik_command(Path("b"), Path("m"), threads=1, prompt_tokens=512, decode_steps=0)


def test_llama_bench_json_parsed():
    r = peer.rates(peer.parse_llama_bench("main: repacked 113 tensors\n" + SAMPLE))
    assert (r["prompt_tokens"], r["decode_steps"], r["decode_start"]) == (512, 64, 0)
    assert r["prefill_tok_s"] == pytest.approx(64.0) and r["decode_tok_s"] == pytest.approx(16.0)
    assert r["prefill_s"] == pytest.approx(8.0) and r["decode_s"] == pytest.approx(4.0)
    assert r["ik_llama_cpp"]["build_commit"] == "8337e4cd" and r["ik_llama_cpp"]["repack"] is True


@pytest.mark.parametrize("out, match", [
    ("", "no JSON array of tests"),
    ("[\n" + _test(512, 0, 64.0, "pp512") + "\n]\n", "one prefill .pp. and one decode .tg. test"),
    ("[\n" + _test(512, 0, 64.0, "pp512") + ",\n" + _test(0, 64, 0.0, "tg64") + "\n]\n", "avg_ts > 0"),
    ("[\n" + _test(512, 0, 64.0, "pp512") + ",\n" + _test(512, 64, 9.0, "pp512+tg64") + "\n]\n", "no -pg/-gp"),
    ("[\n  {\"n_prompt\": 512,\n", "no JSON array of tests"),                    # cut short by a crash
])
def test_llama_bench_json_refused(out, match):
    with pytest.raises(ValueError, match=match):
        peer.parse_llama_bench(out)


def _words(text):
    return ["<bos>"] + text.split()


def test_cut_prompt_to_a_token_count():
    text = "one two  three\nfour five six"
    assert cut(text, 4, _words) == ("one two  three", 4)
    assert cut(text, 99, _words) == (text, 7)                   # fits whole: the text itself, its count
    assert cut(text, 2, _words) == ("one", 2)
    # a word worth two tokens at the limit: one fewer than asked, never more
    assert cut("ab cd ef", 4, lambda s: ["<bos>"] + [c for w in s.split() for c in (w[0], w[1:])]) == ("ab", 3)
    with pytest.raises(ValueError, match="first word"):
        cut(text, 1, _words)
    with pytest.raises(ValueError, match="n_tokens must be >= 1"):
        cut(text, 0, _words)


def _run(engine, dec, pre, rss, start, threads=1):
    return {"model": "m", "threads": threads, "engine": engine, "decode_tok_s": dec, "prefill_tok_s": pre,
            "rss_mb": rss, "prompt_tokens": 512, "decode_start": start}


def test_two_peers_in_one_table():
    runs = [_run("streamattn", 20.0, 60.0, 1700, 512), _run("llama.cpp", 10.0, 30.0, 1600, 512),
            _run("ik_llama.cpp", 16.0, 120.0, 1500, 0), _run("streamattn", 6.64, 80.0, 1710, 512, threads=2)]
    rows = peer.summarize(runs)
    one, two = rows
    assert one["peers"] == ["llama.cpp", "ik_llama.cpp"]
    assert one["ratios"]["ik_llama.cpp"] == {"decode": pytest.approx(1.25), "prefill": pytest.approx(0.5)}
    assert one["decode_ratio"] == pytest.approx(2.0)                          # against the first peer
    assert two["ik_llama.cpp"] is None and two["ratios"]["ik_llama.cpp"]["decode"] is None
    head, _, row1, row2 = peer.markdown(rows).splitlines()
    assert "decode tok/s llama.cpp / ik_llama.cpp / streamattn, quiet | ratio vs llama.cpp | ratio vs ik_llama.cpp" \
        in head
    assert row1 == ("| m | 1 | 10 / 16 / 20 | 2.00× | 1.25× | 30 / 120 / 60 | 2.00× | 0.50× | 1600 / 1500 / 1700 |")
    assert row2 == "| m | 2 | – / – / 6.6 | –× | –× | – / – / 80 | –× | –× | – / – / 1710 |"   # < 10: a decimal


def test_wall_bytes_follow_the_positions_decoded():
    prof = {"weights": 1000, "kv_per_key": [10, 10], "windows": [None, 4]}
    assert peer.step_bytes_mean(prof, 7, 3) == pytest.approx(peer.wall.decode_bytes(prof, 7, 3))
    # from an empty cache: positions 0, 1, 2 see 1, 2, 3 keys in both layers
    assert peer.step_bytes_mean(prof, 0, 3) == pytest.approx(1000 + 2 * 10 * 2)


def test_missing_ik_binary_is_a_clear_error(tmp_path, capsys):
    assert peer.main(["--peers", "ik_llama.cpp", "--ik-bin", str(tmp_path / "llama-bench")]) == 2
    err = capsys.readouterr().err
    assert "scripts/install_ik_llamacpp.sh" in err and str(tmp_path / "llama-bench") in err


def test_a_run_with_both_peers(tmp_path, monkeypatch):
    """main() with the engines, the prompt cut and the probe stood in: every engine in every repeat, the
    order flipped each repeat, the cut prompt given to the text engines and its count to llama-bench, the
    wall bytes from the positions each engine decoded, the default 65 tokens (64 decode steps)."""
    (tmp_path / "peer" / "node_modules" / "node-llama-cpp").mkdir(parents=True)
    ik_bin = tmp_path / "ik" / "build" / "bin" / "llama-bench"        # as scripts/install_ik_llamacpp.sh lays out
    ik_bin.parent.mkdir(parents=True)
    ik_bin.write_text("#!/bin/sh\n")
    (tmp_path / "ik" / "status.json").write_text(json.dumps({"source": "tarball ik.tar, commit abc"}))
    ik_bin.chmod(0o755)
    model = tmp_path / "tiny-q4_k_m.gguf"
    model.write_bytes(b"GGUF")
    seen, cuts = [], []

    def fake_cut(path, n_tokens, folder, timeout):
        cuts.append((path, n_tokens, folder))
        (folder / "p.txt").write_text("cut")
        return folder / "p.txt", n_tokens - 1

    def fake_run(engine, model_path, threads, tokens, ours_args, peer_dir, timeout, *, prompt, ik_bin,
                 prompt_tokens):
        seen.append((engine, prompt.read_text(), prompt_tokens, tokens))
        start = 0 if engine == "ik_llama.cpp" else 511
        return peer.rates({"prompt_tokens": 511, "prefill_s": 2.0, "decode_steps": tokens - 1, "decode_start": start,
                           "decode_s": (tokens - 1) / 20.0}) | {"rss_mb": 900.0, "wall_s": 3.0}

    prof = {"weights": 100_000_000, "kv_per_key": [1000] * 4, "windows": [None] * 4, "tied": True, "file_bytes": 1}
    monkeypatch.setattr(peer, "cut_prompt", fake_cut)
    monkeypatch.setattr(peer, "run_one", fake_run)
    monkeypatch.setattr(peer, "child_json", lambda args, env=None, timeout=0: prof)
    monkeypatch.setattr(peer, "probe_wall", lambda threads, mb, timeout: {"threads": threads, "gbps": 10.0})
    assert peer.main(["--models", str(model), "--peers", "ik_llama.cpp", "llama.cpp", "--threads", "1", "--repeats",
                      "2", "--peer-dir", str(tmp_path / "peer"), "--ik-bin", str(ik_bin), "--out", str(tmp_path),
                      "--tag", "t_llama-3.2-1b"]) == 0
    assert [c[:2] for c in cuts] == [(model.resolve(), 512)]
    assert [e for e, *_ in seen] == ["streamattn", "llama.cpp", "ik_llama.cpp", "ik_llama.cpp", "llama.cpp",
                                     "streamattn"]
    assert all(text == "cut" and n == 512 and tokens == 65 for _, text, n, tokens in seen)
    doc = json.loads((tmp_path / "peer_llamacpp_t_llama-3.2-1b.json").read_text())
    per_step = {r["engine"]: r["bytes_per_step"] for r in doc["runs"]}
    assert per_step["ik_llama.cpp"] == pytest.approx(100e6 + 4 * 1000 * statistics.mean(range(1, 65)))
    assert per_step["streamattn"] == pytest.approx(100e6 + 4 * 1000 * statistics.mean(range(512, 576)))
    assert doc["summary"][0]["wall_tok_s"] == pytest.approx(10e9 / per_step["streamattn"])   # after the prompt
    assert doc["meta"]["peers"] == ["llama.cpp", "ik_llama.cpp"] and doc["meta"]["prompt_tokens_cut"] == 512
    assert doc["meta"]["ik_llama_cpp_build"]["source"] == "tarball ik.tar, commit abc"
    md = (tmp_path / "peer_llamacpp_t_llama-3.2-1b.md").read_text()
    assert "llama.cpp / ik_llama.cpp / streamattn" in md and "from an empty cache" in md
    assert not cuts[0][2].exists()                                        # the cut prompt's folder removed


def test_models_take_fixture_names(tmp_path):
    names = peer.fixture_names()
    assert {"llama-3.2-1b-q4_k_m", "llama-3.2-1b-q4_0", "llama-3.2-1b-q8_0", "llama-3.1-8b-q4_k_m"} <= set(names)
    (tmp_path / "llama-3.2-1b-q4_0.gguf").write_bytes(b"GGUF")
    other = tmp_path / "mine.gguf"
    other.write_bytes(b"GGUF")
    paths = peer.fixture_paths(["smollm2", "llama-3.2-1b-q4_0", str(other)], tmp_path)
    assert paths == ["smollm2", str(tmp_path / "llama-3.2-1b-q4_0.gguf"), str(other)]
    assert peer.model_labels(paths)[paths[1]] == "llama-3.2-1b-q4_0"
    with pytest.raises(ValueError, match="--models llama-3.1-8b --types q4_k_m --out"):
        peer.fixture_paths(["llama-3.1-8b-q4_k_m"], tmp_path)
