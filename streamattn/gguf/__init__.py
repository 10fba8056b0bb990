"""GGUF model files: the container reader, metadata checks, the loader (file -> config and weights), the hub."""
