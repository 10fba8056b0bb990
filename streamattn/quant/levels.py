"""Fixed tables of the GGUF block formats and of our layouts of them, shared by the layouts (weights.py),
their compiled repacking (repack.py) and the LLVM-IR kernels (kernels.py) without one importing another."""

#: IQ4_NL's and IQ4_XS's 16 non-linear levels (ggml-common.h ``kvalues_iq4nl``; gguf-py's
#: ``IQ4_NL.kvalues``): a nibble q stands for ``IQ4_VALUES[q]`` times the block's scale.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

#: Where each four-byte word of a "q6k" block comes from: its byte offset in the file's super-block for
#: the first half (for the second, + 64 in ``ql`` (< 128), + 32 in ``qh`` (< 192), + 8 in the scales), in
#: the order the kernel first reads them (ql 0-15, qh 0-15, scales 0-3, ql 16-31, qh 16-31, ql 32-63,
#: scales 4-7), so that a row's bytes stream forwards (in the file's order the hardware prefetcher lost
#: track: docs/PERF.md).
Q6K_WORDS = (0, 4, 8, 12, 128, 132, 136, 140, 192, 16, 20, 24, 28, 144, 148, 152, 156,
             32, 36, 40, 44, 48, 52, 56, 60, 196)
