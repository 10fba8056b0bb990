"""The forward pass: model configs, one file per architecture, the transformer, its layer, the compiled CPU
layers.

Built on the attention core (``streamattn.CacheSpec``, ``KVCache``, ``attend``), on :mod:`streamattn.quant`
and :mod:`streamattn.gguf`; the core never imports it.
"""
