"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    """Counters, gauges and histograms the engine and the routes update; ``render()`` is /metrics."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "streamattn_"
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Counter(p + "prompt_cached_tokens", "Prompt tokens served by the prompt cache",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.spec_drafted = Counter(p + "spec_drafted_tokens", "Tokens drafted by speculative decoding",
                                    registry=r)
        self.spec_accepted = Counter(p + "spec_accepted_tokens", "Drafted tokens the model accepted", registry=r)
        self.requests = Counter(p + "requests", "Finished requests by outcome", ["finish_reason"], registry=r)
        self.rejected = Counter(p + "requests_rejected", "Requests refused with 429 (queue full)", registry=r)
        self.running = Gauge(p + "requests_running", "Requests holding a sequence slot", registry=r)
        self.queued = Gauge(p + "requests_queued", "Requests waiting for a slot", registry=r)
        self.steps = Counter(p + "engine_steps", "Engine steps (one batched forward each)", registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "Wall time of one engine step", registry=r,
                                      buckets=(.005, .01, .02, .04, .08, .16, .32, .64, 1.28, 2.56, 5.12))
        self.cache_lookups = Counter(p + "prompt_cache_lookups", "Prompt-cache lookups", registry=r)
        self.cache_hits = Counter(p + "prompt_cache_hits", "Prompt-cache lookups that reused a prefix",
                                  registry=r)
        self.cache_bytes = Gauge(p + "prompt_cache_bytes", "Bytes held by the prompt cache", registry=r)
        self.cancel_steps = Histogram(p + "cancel_steps", "Engine steps between a client's disconnect and its "
                                      "slot being freed", registry=r, buckets=(0, 1, 2, 4, 8, 16))

    def render(self) -> bytes:
        return generate_latest(self.registry)
