"""benchmarks/speculative.py's llama-server peer without llama.cpp: response parsing, the report's peer
columns, and the server lifecycle against a stand-in llama-server (a small Python HTTP server on
127.0.0.1 that answers /health and /completion the way llama-server does)."""

import importlib.util
import textwrap
from pathlib import Path

import pytest

from streamattn.bench import llama_server
from tests._stand_in import stand_in

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "speculative.py"
_spec = importlib.util.spec_from_file_location("speculative_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

LOG = ("load_backend: loaded CPU backend from /x/build/bin/libggml-cpu-icelake.so\n"
       "main: server is listening on http://127.0.0.1:1\n")


def test_log_parsing_names_the_variant():
    assert llama_server.loaded_variant(LOG) == "icelake"
    assert llama_server.loaded_variant("load_backend: loaded CPU backend from /x/libggml-cpu.so\n") == "cpu"
    assert llama_server.loaded_variant("nothing here") is None


def test_parse_completion_reads_timings_and_drafts():
    r = llama_server.parse_completion({"tokens": [5, 6, 7],
                                       "timings": {"predicted_n": 3, "predicted_per_second": 80.5, "prompt_n": 40,
                                                   "prompt_per_second": 400.0, "draft_n": 10, "draft_n_accepted": 4}})
    assert r["ids"] == [5, 6, 7] and r["tokens"] == 3 and r["decode_tok_s"] == 80.5
    assert (r["drafted"], r["accepted"], r["acceptance"]) == (10, 4, 0.4)
    plain = llama_server.parse_completion({"tokens": [1],
                                           "timings": {"predicted_n": 1, "predicted_per_second": 0.0}})
    assert plain["drafted"] == 0 and plain["acceptance"] == 0.0
    with pytest.raises(ValueError, match="predicted_per_second"):
        llama_server.parse_completion({"content": "x"})


def test_peer_row_and_markdown_carry_the_peer_columns():
    p = {"ids": [1, 2, 3, 4], "tokens": 4, "decode_tok_s": 40.0, "drafted": 0, "accepted": 0, "acceptance": 0.0}
    q = {**p, "decode_tok_s": 60.0, "drafted": 8, "accepted": 6, "acceptance": 0.75}
    pr = bench.peer_row([(p, q)], ours_ids=[1, 2, 9, 9])
    assert pr["peer_speedup"] == pytest.approx(1.5) and pr["peer_same"] and pr["peer_match_ours"] == 0.5
    row = {"model": "smollm2", "threads": 1, "kind": "copy", "prompt": "rename", "tokens": 4, "plain_tok_s": 50.0,
           "spec_tok_s": 120.0, "speedup": 2.4, "speedup_min": 2.2, "speedup_max": 2.6, "acceptance": 0.9,
           "drafted": 8, "steps_plain": 3, "steps_spec": 1, **pr,
           "ours_vs_peer_spec": 2.0}
    md = bench.markdown([row], bench.summary([row]), "t", 8, "cmd",
                        {"spec": "--spec-type ngram-simple", "servers": [{"cpu_variant": "icelake"}]})
    assert "llama-server n-gram" in md and "icelake" in md and "| 2.00x |" in md and "| yes | 0.50 |" in md
    assert "| 2.40x | 2.20-2.60 |" in md and "| 1 | 2.40x | 2.40x | 2.40x |" in md     # pairs' range; set's lowest
    plain_md = bench.markdown([{k: v for k, v in row.items() if not k.startswith(("peer", "ours_vs"))}],
                              bench.summary([row]), "t", 8, "cmd")
    assert "llama-server" not in plain_md


FAKE = textwrap.dedent('''\
    import json, os, signal, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    if "--version" in args:
        print("version: 1 (fake)"); print("built with test"); sys.exit(0)
    if os.environ.get("FAKE_CRASH"):
        os.kill(os.getpid(), signal.SIGILL)
    port = int(args[args.index("--port") + 1])
    spec = "--spec-type" in args
    print("load_backend: loaded CPU backend from /fake/libggml-cpu-zen4.so", flush=True)
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def _send(self, obj):
            b = json.dumps(obj).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers()
            self.wfile.write(b)
        def do_GET(self):
            self._send({"status": "ok"})
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert req["temperature"] == 0 and req["top_k"] == 1 and req["return_tokens"]
            ids = req["prompt"][-req["n_predict"]:]
            t = {"predicted_n": len(ids), "predicted_per_second": 90.0 if spec else 45.0,
                 "prompt_n": len(req["prompt"]), "prompt_per_second": 300.0}
            if spec:
                t.update(draft_n=10, draft_n_accepted=7)
            self._send({"tokens": ids, "timings": t})
    HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def fake_bin(tmp_path):
    return stand_in(tmp_path, FAKE)


def test_server_lifecycle_against_a_stand_in(fake_bin, tmp_path):
    with llama_server.LlamaServer(fake_bin, tmp_path / "m.gguf", 1, ["--spec-type", "ngram-simple"],
                                  start_timeout=30) as srv:
        assert srv.url.startswith("http://127.0.0.1:") and "--no-webui" in srv.cmd and "--parallel" in srv.cmd
        r = srv.complete([1, 2, 3, 4, 5], 3)
        assert r["ids"] == [3, 4, 5] and r["decode_tok_s"] == 90.0 and r["acceptance"] == 0.7
        assert srv.cpu_variant() == "zen4"                 # the stand-in maps no .so: its log says so
        assert llama_server.server_version(fake_bin) == "version: 1 (fake) built with test"
        proc = srv.proc
    assert proc.poll() is not None                                         # stopped on leaving the block


def test_a_server_that_dies_starting_says_how(fake_bin, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_CRASH", "1")
    srv = llama_server.LlamaServer(fake_bin, tmp_path / "m.gguf", 1, start_timeout=30)
    with pytest.raises(RuntimeError, match="exited while starting") as e:
        with srv:
            pass
    assert "SIGILL" in str(e.value) or "exit 132" in str(e.value) or "exit -4" in str(e.value)
