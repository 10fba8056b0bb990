"""``python -m streamattn.bench``: the throughput sweeps (``streamattn bench``)."""
import sys

from .sweep import main

sys.exit(main())
