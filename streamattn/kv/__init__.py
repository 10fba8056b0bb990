"""The attention core: the cache contract (spec), the ring cache and its storages, the rotation and sink
parts, state files, the attend front door and its CPU/GPU kernels (backends/), and the float64 reference.

Nothing here knows of packed weights, model files, text, models, the engine or serving (tests/test_layout.py).
"""
