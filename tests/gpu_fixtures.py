"""Fixtures shared by the GPU-on-CPU tests (import them into a test module: ``from gpu_fixtures import ...``)."""
from __future__ import annotations

import pytest

from cuda_emu import emu


@pytest.fixture(scope="session")
def runner(tmp_path_factory):
    """The emulator (library built from the loader's exact kernel text, every specialisation)."""
    if not emu.have_compiler():
        pytest.skip("g++ (C++20) is needed for the CUDA emulation harness")
    return emu.Emulator(emu.build(tmp_path_factory.mktemp("cuda_emu")))
