import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest


@pytest.fixture
def one_thread():
    """One thread in each CPU pool (Numba's and OpenBLAS's), the previous counts restored after.

    The tests' calls are small, so a second thread only adds wake-up cost, and on a busy 2-core host a
    2-thread launch waits for a descheduled worker (measured: attend 37 us with 1 thread, 21 ms with 2 at
    load ~100); the model tests decode one sequence, which streamattn/threads.py explains.
    """
    from streamattn.threads import threads
    with threads(1):
        yield


def pytest_collection_modifyitems(config, items):
    """Order the scopes (a module, or a class) that pytest-xdist hands out whole under ``--dist loadscope``:
    those marked ``heavy`` first, then the others by their number of tests, most first (xdist's own order,
    which scripts/test.sh turns off with ``--no-loadscope-reorder`` so that this one holds).

    Why: a worker takes the next scope in this order whenever it runs low, so the long scopes should start
    at once and the short ones fill in at the end; a long scope handed out last runs alone while the
    other worker idles (docs/DESIGN.md §26).
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
