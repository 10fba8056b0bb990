"""benchmarks/serve_load.py: its argument handling, the two-engine table, a whole run against stand-in
servers (small Python OpenAI-streaming servers on 127.0.0.1), and one short real llama-server load."""

import importlib.util
import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests._stand_in import stand_in

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_load.py"
_spec = importlib.util.spec_from_file_location("serve_load_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

FAKE = textwrap.dedent('''\
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = sys.argv[1:]
    if "--version" in args:
        print("version: 1 (fake)"); sys.exit(0)
    port = int(args[args.index("--port") + 1])
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
            self.wfile.write(b"ok")
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if os.environ.get("FAKE_DIE") and "-m" in args and req["max_tokens"] > 4:   # not in the warm-up
                print("fake: dying", flush=True); os._exit(3)
            drop = os.environ.get("FAKE_DROP_ONCE")
            if drop and "-m" in args and req["max_tokens"] > 4 and not os.path.exists(drop):
                open(drop, "w").close()          # closed unanswered, once: a stale kept-alive connection
                self.close_connection = True
                return
            assert self.path == "/v1/completions" and req["stream"] and req["ignore_eos"]
            assert req["temperature"] == 0 and req["cache_prompt"] is False
            self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
            for i in range(req["max_tokens"]):
                time.sleep(0.002)
                ev = {"choices": [{"text": f" t{i}", "index": 0, "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(ev)}\\n\\n".encode()); self.wfile.flush()
            ev = {"choices": [], "usage": {"completion_tokens": req["max_tokens"]}}
            self.wfile.write(f"data: {json.dumps(ev)}\\n\\ndata: [DONE]\\n\\n".encode())
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def fake_bin(tmp_path):
    return stand_in(tmp_path, FAKE)


@pytest.mark.parametrize("argv, says", [
    ([], "give --url of a running server or --start"),
    (["--url", "http://127.0.0.1:1", "--peer", "llama-server"], "--peer llama-server needs --start"),
    (["--start", "--concurrency", "1,x"], "--concurrency must be comma-separated positive integers"),
    (["--start", "--concurrency", "0,8"], "(got '0,8')"),
    (["--start", "--parallel", "0"], "--parallel must be >= 1 (got 0)"),
    (["--start", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--start", "--repeats", "0"], "--repeats must be >= 1"),
    (["--start", "--ours-args", "--cache-dtype 'float16"], "not a shell-quoted argument list"),
    (["--start", "--peer", "llama-server", "--peer-bin", "/nonexistent/llama-server"],
     "scripts/install_llamacpp_native.sh"),
])
def test_bad_arguments_are_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_arguments_with_the_peer(fake_bin):
    args = bench.parse_args(["--start", "--peer", "llama-server", "--peer-bin", str(fake_bin), "--concurrency",
                             "1,8,16", "--threads", "2"])
    assert args.levels == [1, 8, 16] and args.peer_bin == str(fake_bin) and args.peer_status == {}


def _row(conc, agg, itl50, itl99):
    return {"concurrency": conc, "requests": 16, "tokens": 512, "wall_s": 1.0, "aggregate_tok_s": agg,
            "decode_tok_s": agg * 1.1, "ttft_p50_s": 0.05, "ttft_p99_s": 0.1, "itl_p50_s": itl50, "itl_p99_s": itl99}


def test_medians_and_the_two_engine_table():
    med = bench.median_row([_row(8, 100, 0.01, 0.02), _row(8, 300, 0.03, 0.05), _row(8, 200, 0.02, 0.09)])
    assert med["aggregate_tok_s"] == 200 and med["itl_p99_s"] == 0.05 and med["repeats"] == 3
    table = bench.markdown({"streamattn": [_row(1, 60, 0.016, 0.02), _row(8, 240, 0.03, 0.05)],
                            "llama-server": [_row(1, 50, 0.02, 0.025), _row(8, 120, 0.06, 0.09)]}).splitlines()
    assert table[0].startswith("| clients | aggregate tok/s streamattn / llama-server | ratio |")
    assert table[3] == "| 8 | 240 / 120 | 2.00× | 264 / 132 | 50 / 50 | 30.0 / 60.0 | 50.0 / 90.0 |"
    alone = bench.markdown({"streamattn": [_row(1, 60, 0.016, 0.02)]}).splitlines()
    assert "ratio" not in alone[0] and alone[2] == "| 1 | 60 | 66 | 50 | 16.0 | 20.0 |"


def _stand_in_start(fake_bin, started):
    """start_server's stand-in: the fake binary as our server (no model loaded)."""

    def fake_start(args):
        port = bench.socket.socket()
        port.bind(("127.0.0.1", 0))
        n = port.getsockname()[1]
        port.close()
        proc = subprocess.Popen([str(fake_bin), "--port", str(n)])
        started.append(proc)
        url = f"http://127.0.0.1:{n}"
        for _ in range(200):
            try:
                if bench.httpx.get(url + "/health").status_code == 200:
                    return proc, url
            except bench.httpx.TransportError:
                bench.time.sleep(0.05)
        raise RuntimeError("stand-in did not start")

    return fake_start


def _argv(fake_bin, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    return ["--start", "--model", str(model), "--peer", "llama-server", "--peer-bin", str(fake_bin), "--concurrency",
            "1,4", "--requests", "4", "--max-tokens", "5", "--parallel", "4", "--threads", "2", "--out",
            str(tmp_path / "serve_load_t")]


def test_a_whole_run_against_stand_ins(fake_bin, tmp_path, monkeypatch, capsys):
    """Both 'servers' are the stand-in; ours is started the way start_server would (patched: no model)."""
    started = []
    monkeypatch.setattr(bench, "start_server", _stand_in_start(fake_bin, started))
    model, out = tmp_path / "m.gguf", tmp_path / "serve_load_t"
    assert bench.main(_argv(fake_bin, tmp_path)) == 0
    printed = [ln.split()[0] for ln in capsys.readouterr().out.splitlines() if " c=" in ln]
    assert printed == ["streamattn", "llama-server", "llama-server", "streamattn"]      # alternated
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [r["concurrency"] for r in doc["rows"]] == [r["concurrency"] for r in doc["peer_rows"]] == [1, 4]
    assert all(r["tokens"] == r["requests"] * 5 for r in doc["rows"] + doc["peer_rows"])
    cmd = doc["peer"]["command"]
    assert "--parallel 4" in cmd and "-t 2 -tb 2" in cmd and f"-m {model}" in cmd and "-c 1044" in cmd
    assert "llama-server" in out.with_suffix(".md").read_text() and out.with_suffix(".png").stat().st_size > 1000
    assert all(p.poll() is not None for p in started)                  # ours stopped at the end


def test_a_llama_server_that_dies_under_load_says_so(fake_bin, tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(bench, "start_server", _stand_in_start(fake_bin, started))
    monkeypatch.setenv("FAKE_DIE", "1")
    with pytest.raises(RuntimeError, match="llama-server died under 1 clients .exit 3") as e:
        bench.main(_argv(fake_bin, tmp_path))
    assert "fake: dying" in str(e.value) and all(p.poll() is not None for p in started)


def test_a_request_the_server_closed_unanswered_is_sent_once_more(fake_bin, tmp_path, monkeypatch, capsys):
    """A connection closed with no answer (llama-server on back-to-back streamed requests) costs one resend,
    counted in the row, not the run."""
    started = []
    monkeypatch.setattr(bench, "start_server", _stand_in_start(fake_bin, started))
    monkeypatch.setenv("FAKE_DROP_ONCE", str(tmp_path / "dropped"))
    assert bench.main(_argv(fake_bin, tmp_path)) == 0
    doc = json.loads((tmp_path / "serve_load_t.json").read_text())
    assert sum(r["retried"] for r in doc["peer_rows"]) == 1 and sum(r["retried"] for r in doc["rows"]) == 0
    assert all(r["tokens"] == r["requests"] * 5 for r in doc["peer_rows"])
    assert "(1 sent again)" in capsys.readouterr().out


@pytest.mark.model
def test_a_real_llama_server_under_two_clients():
    """One level of 2 clients × 4 tokens against the real llama-server and SmolLM2 (a few seconds)."""
    from streamattn.bench.llama_server import LlamaServer, find_binary
    from streamattn.gguf.hub import resolve_model
    try:
        binary, _ = find_binary()
    except FileNotFoundError as e:
        pytest.skip(f"llama-server is not built here ({e})")
    with LlamaServer(binary, resolve_model("smollm2-135m", quiet=True), 1, parallel=2, ctx=2 * 260) as srv:
        r = bench.asyncio.run(bench.level(srv.url, "bench", 2, 2, 4))
    assert r["tokens"] == 8 and r["aggregate_tok_s"] > 0 and 0 < r["itl_p50_s"] <= r["itl_p99_s"]
