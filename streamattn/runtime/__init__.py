"""Process runtime: thread pools and their wait policy, memory and array helpers, the CPU target, the
Numba kernel-cache registry, LLVM-IR building blocks shared by the compiled kernels, and file helpers.

Imports nothing else of streamattn: every other room may use it.
"""
