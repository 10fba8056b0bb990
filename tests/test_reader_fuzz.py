"""The derandomised CI slice of the reader fuzz (tests/fuzz_readers.py; scripts/fuzz.sh runs more).

It runs in a subprocess because the worker caps its own address space (RLIMIT_AS) and times each case with
SIGALRM: a reader that allocates what a file says, or loops on what a file says, fails here.
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_worker(*args, timeout=300):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, os.path.join(HERE, "fuzz_readers.py"), *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_readers_survive_mutated_files():
    r = run_worker("--examples", os.environ.get("STREAMATTN_READER_FUZZ_EXAMPLES", "120"), "--memory-mib", "768",
                   "--case-seconds", "10")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    lines = [x for x in r.stdout.splitlines() if " cases, " in x]
    assert [x.split(":")[0] for x in lines] == ["snapshot", "gguf"]
    for line in lines:   # both outcomes happen: the mutations reach past the first check
        refused, loaded = (int(line.split(", ")[i].split()[0]) for i in (1, 2))
        assert refused > 0 and loaded > 0, line
