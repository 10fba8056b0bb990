"""The architecture table: GGUF ``general.architecture`` -> its :class:`~streamattn.models.config.Architecture`.

Adding an architecture is one file in streamattn/models/ (its metadata -> config, its layer's tensors) and
one entry here.
"""

from __future__ import annotations

from streamattn.models.gemma3 import GEMMA3
from streamattn.models.llama import LLAMA

ARCHITECTURES = {a.name: a for a in (LLAMA, GEMMA3)}
