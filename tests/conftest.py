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
