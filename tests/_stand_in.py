"""A stand-in for a server binary in tests: a Python script behind an executable named like the real one."""

import stat
import sys


def stand_in(folder, source: str, name: str = "llama-server"):
    """Write ``source`` (a Python program) to ``folder`` and an executable ``folder/name`` that runs it with
    this interpreter and the arguments it is given; returns that executable's path."""
    script = folder / f"{name}_stand_in.py"
    script.write_text(source)
    exe = folder / name
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe
