"""The model layer: GGUF reading, transformer forward, tokenizer, sampling, generation, model cache.

Built on the engine (``streamattn.CacheSpec``, ``KVCache``, ``attend``); the engine never imports it.
"""
