"""Fixed value tables of the GGUF block formats, shared by the layouts (weights.py) and the LLVM-IR
kernels (kernels.py) without either importing the other."""

#: IQ4_NL's and IQ4_XS's 16 non-linear levels (ggml-common.h ``kvalues_iq4nl``; gguf-py's
#: ``IQ4_NL.kvalues``): a nibble q stands for ``IQ4_VALUES[q]`` times the block's scale.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
