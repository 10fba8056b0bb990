"""Where the benchmark peers live: the ``.peer/`` folder that scripts/install_llamacpp_*.sh fill.

The install scripts write into ``.peer/`` of the checkout they run in (git-ignored). A git worktree of
that checkout has no ``.peer/`` of its own; rather than installing llama.cpp again (minutes, and ~1 GB
for the native build), a worktree uses its main checkout's. Standard library only (benchmarks/
peer_llamacpp.py loads it by path, see streamattn/bench/noise.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def peer_home(root: Path = ROOT) -> Path:
    """``root/.peer`` if it exists, else the ``.peer`` of the main checkout when ``root`` is a linked git
    worktree and that folder exists, else ``root/.peer`` (absent: callers say how to install)."""
    own = Path(root) / ".peer"
    if own.is_dir():
        return own
    try:
        common = subprocess.run(["git", "-C", str(root), "rev-parse", "--path-format=absolute",
                                 "--git-common-dir"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return own
    main = Path(common.stdout.strip()).parent / ".peer" if common.returncode == 0 and common.stdout.strip() else None
    return main if main is not None and main.is_dir() else own
