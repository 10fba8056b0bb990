"""llama-server as a benchmark peer: one process on 127.0.0.1, started, health-checked, asked, stopped.

Used by benchmarks/speculative.py (``/completion`` with token ids, its n-gram speculation) and
benchmarks/serve_load.py (the OpenAI streaming endpoint under concurrent clients). The binary comes
from scripts/install_llamacpp_native.sh (``.peer/llamacpp-native``, found from a git worktree too:
:mod:`streamattn.bench.peer_home`), which records in ``status.json`` the llama-cpp-python sources it
built and the CPU variant that loads. Standard library only.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from streamattn.bench.peer_home import peer_home

PEER_BIN = peer_home() / "llamacpp-native" / "build" / "bin" / "llama-server"
PEER_STATUS = peer_home() / "llamacpp-native" / "status.json"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))      # 127.0.0.1 only, never a proxy
_VARIANT = re.compile(r"loaded CPU backend from \S*?libggml-cpu-?([A-Za-z0-9_.]*)\.so")


def loaded_variant(log: str):
    """The CPU variant a llama-server log says it loaded (``sapphirerapids``, ``icelake``, ...); None if
    it names none (a build without GGML_BACKEND_DL)."""
    found = _VARIANT.findall(log)
    return (found[-1] or "cpu") if found else None


def server_version(binary) -> str:
    """``llama-server --version`` on one line (``version: 0.5.0-dev (build 0, commit unknown) built with
    GNU 12.2.0 for Linux x86_64``); '' if it says nothing."""
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return " ".join(ln.strip() for ln in (r.stdout + r.stderr).splitlines()
                    if re.match(r"\s*(version|built with)\b", ln))


def parse_completion(resp: dict) -> dict:
    """Token ids and timings of one ``/completion`` response (``return_tokens``; greedy)."""
    t = resp.get("timings")
    if not isinstance(t, dict) or "predicted_per_second" not in t:
        raise ValueError(f"llama-server's response has no timings.predicted_per_second: {str(resp)[:300]}")
    ids = [int(i) for i in resp.get("tokens") or []]
    drafted, accepted = int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))
    return {"ids": ids, "tokens": int(t.get("predicted_n", len(ids))), "decode_tok_s": float(t["predicted_per_second"]),
            "prompt_tokens": int(t.get("prompt_n", 0)), "prefill_tok_s": float(t.get("prompt_per_second", 0.0)),
            "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process on 127.0.0.1: started, health-checked, asked, stopped (also on errors).

    ``-t threads -tb threads -c ctx --parallel parallel`` (``ctx``: the context of all slots
    together); ``extra``: more flags (speculative.py's speculation flags). Its log goes to
    a temporary file that :meth:`log` reads (a crash's last words, quoted in the error) and :meth:`stop`
    removes. ValueError for a threads, ctx or parallel that is not a positive integer."""

    def __init__(self, binary, gguf, threads: int, extra=(), ctx: int = 4096, start_timeout: float = 300.0,
                 parallel: int = 1):
        for name, v in (("threads", threads), ("ctx", ctx), ("parallel", parallel)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer (got {v!r})")
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "0", "-t", str(threads),
                    "-tb", str(threads), "-c", str(ctx), "--parallel", str(parallel), "--no-webui", *extra]
        self.start_timeout = start_timeout
        self.proc = None
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def cpu_variant(self):
        """The libggml-cpu-<variant>.so the running server has mapped (/proc/PID/maps; its log at the
        default verbosity does not say), else what its log says, else None."""
        try:
            maps = Path(f"/proc/{self.proc.pid}/maps").read_text()
        except (OSError, AttributeError):
            maps = ""
        found = re.findall(r"libggml-cpu-?([A-Za-z0-9_.]*?)\.so", maps)
        return (found[-1] or "cpu") if found else loaded_variant(self.log())

    def _died(self, what: str):
        rc = self.proc.returncode
        why = f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit {rc}"
        tail = "\n    ".join(self.log().splitlines()[-12:])
        return RuntimeError(f"llama-server {what} ({why}; CPU variant {loaded_variant(self.log())}); "
                            f"command: {shlex.join(self.cmd)}\n    {tail}")

    def start(self):
        self.port = _free_port()
        self.cmd[self.cmd.index("--port") + 1] = str(self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.start_timeout:
            if self.proc.poll() is not None:
                raise self._died("exited while starting")
            try:
                with _NO_PROXY.open(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not healthy after {self.start_timeout:.0f} s: {shlex.join(self.cmd)}")

    def raise_if_dead(self, what: str, grace: float = 5.0) -> None:
        """RuntimeError with the exit status and the log's last lines if the process exits within ``grace``
        seconds (a request broken by a crash can reach the client before the process has ended)."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            return
        raise self._died(what)

    def complete(self, ids: list, n_predict: int) -> dict:
        body = {"prompt": [int(i) for i in ids], "n_predict": int(n_predict), "temperature": 0.0, "top_k": 1,
                "seed": 0, "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with _NO_PROXY.open(req, timeout=900) as r:
                return parse_completion(json.loads(r.read()))
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            if self.proc.poll() is not None:
                raise self._died("died during a request") from e
            raise

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)        # errors above already quoted its tail


def peer_status() -> dict:
    """What scripts/install_llamacpp_native.sh recorded (llama-cpp-python version, CPU variant, fallbacks)."""
    try:
        return json.loads(PEER_STATUS.read_text())
    except (OSError, ValueError):
        return {}


def find_binary(explicit=None) -> tuple:
    """(llama-server path, install status) for ``--peer llama-server``: ``explicit`` (a ``--peer-bin``)
    if given, else the binary scripts/install_llamacpp_native.sh recorded, else :data:`PEER_BIN`. The
    status (:func:`peer_status`) is ``{}`` for a binary that script did not build.

    Raises
    ------
    FileNotFoundError
        No such file, saying how to build one.
    """
    status = peer_status()
    binary = Path(explicit) if explicit else (Path(status["bin"]) / "llama-server" if status.get("bin") else PEER_BIN)
    if not binary.is_file():
        raise FileNotFoundError(f"no llama-server at {binary}: run bash scripts/install_llamacpp_native.sh "
                                "(or give --peer-bin PATH)")
    if not status.get("bin") or binary.parent.resolve() != Path(status["bin"]).resolve():
        status = {}
    return binary, status
