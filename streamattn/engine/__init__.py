"""The decode engine every entry point drives: the scheduler and its step (core), one request's state and
the stop rule (sequence), sampling, the Python generation API (generate), teacher-forced perplexity
(perplexity) and the prompt cache.

>>> from streamattn.engine import Generator, SamplingParams                       # doctest: +SKIP
"""

from streamattn.engine.core import Engine, EngineConfig, QueueFull
from streamattn.engine.generate import GenerationStats, Generator, TokenEvent
from streamattn.engine.sampling import SamplingParams
from streamattn.engine.sequence import Event, Job, Sequence, StopFilter

__all__ = ["Engine", "EngineConfig", "Event", "GenerationStats", "Generator", "Job", "QueueFull",
           "SamplingParams", "Sequence", "StopFilter", "TokenEvent"]
