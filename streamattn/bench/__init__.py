"""Tooling: throughput sweeps against the read ceiling (sweep), their report, the ceiling probe, peer
implementations, the long-stream check and the demo. Built on the engine; the engine never imports it.

``python -m streamattn.bench`` runs the sweeps (same as ``streamattn bench``).
"""
