"""Fixtures shared by the GPU-on-CPU tests (import them into a test module: ``from gpu_fixtures import ...``)."""
from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

from cuda_emu import emu


def shared_library(config, tmp_path_factory) -> Path:
    """Path of the emulation library (the loader's exact kernel text, every specialisation), built once per
    test run: under pytest-xdist the workers share one build (the first to ask builds it under a file lock,
    the others wait and load it). A build takes 15-25 s; the emulator in each worker and the fake-CuPy
    dry runs of two modules need it."""
    if not emu.have_compiler():
        pytest.skip("g++ (C++20) is needed for the CUDA emulation harness")
    root = tmp_path_factory.getbasetemp()
    if hasattr(config, "workerinput"):             # an xdist worker: this run's folder, above the worker's
        root = root.parent
    out = root / "cuda_emu_shared"
    with open(root / "cuda_emu_shared.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # released when the file closes
        if not (out / "built").exists():
            lib = emu.build(out)
            (out / "built").write_text(lib.name)
        return out / (out / "built").read_text()


@pytest.fixture(scope="session")
def emu_library(request, tmp_path_factory):
    """:func:`shared_library`."""
    return shared_library(request.config, tmp_path_factory)


@pytest.fixture(scope="session")
def runner(request, tmp_path_factory):
    """The emulator over :func:`shared_library`."""
    return emu.Emulator(shared_library(request.config, tmp_path_factory))
