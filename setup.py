"""Ship the top-level kernels/ sources inside the package (streamattn/kernels/) of wheels.

The CUDA sources live in kernels/ at the repository root (one place for the GPU backend, the NVRTC
compile check and the CPU emulation harness). Wheels carry them as package data:
build_py copies them into the build tree, and streamattn.kv.backends.gpu_source.kernel_dir() looks there
first, then in a checkout's kernels/. All metadata is in pyproject.toml.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

KERNELS = Path(__file__).resolve().parent / "kernels"


class build_py_with_kernels(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "streamattn" / "kernels"
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted(KERNELS.glob("*.cu")) + sorted(KERNELS.glob("*.cuh")):
            shutil.copyfile(source, target / source.name)  # plain copies: no symlinks in wheels


setup(cmdclass={"build_py": build_py_with_kernels})
