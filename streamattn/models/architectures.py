"""The architecture table: GGUF ``general.architecture`` -> its :class:`~streamattn.models.config.Architecture`.

Adding an architecture is one file in streamattn/models/ (its metadata -> config, its layer's tensors) and
one entry here.
"""

from __future__ import annotations

from streamattn.models.gemma2 import GEMMA2
from streamattn.models.gemma3 import GEMMA3
from streamattn.models.llama import LLAMA
from streamattn.models.phi3 import PHI3
from streamattn.models.qwen2 import QWEN2
from streamattn.models.qwen3 import QWEN3

ARCHITECTURES = {a.name: a for a in (LLAMA, QWEN2, QWEN3, PHI3, GEMMA2, GEMMA3)}
