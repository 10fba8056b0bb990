"""Packed GGUF weights and their CPU kernels: block formats, memory layout, activation quantizers, matmuls."""
