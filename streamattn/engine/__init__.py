"""The decode engine every entry point drives: the scheduler and its step (core), one request's state and
the stop rule (sequence), sampling, speculative decoding (speculative), constrained decoding (grammar), the
shared model flags (options), the Python generation API (generate), teacher-forced perplexity (perplexity)
and the prompt cache.

>>> from streamattn.engine import Generator, SamplingParams                       # doctest: +SKIP
"""

from streamattn.engine.core import Engine, EngineConfig, QueueFull
from streamattn.engine.generate import GenerationStats, Generator, TokenEvent
from streamattn.engine.grammar import GrammarError, Grammars
from streamattn.engine.options import ModelOptions
from streamattn.engine.sampling import SamplingParams
from streamattn.engine.sequence import Event, Job, Sequence, StopFilter
from streamattn.engine.speculative import SpecParams

__all__ = ["Engine", "EngineConfig", "Event", "GenerationStats", "Generator", "GrammarError", "Grammars", "Job",
           "ModelOptions", "QueueFull", "SamplingParams", "Sequence", "SpecParams", "StopFilter", "TokenEvent"]
