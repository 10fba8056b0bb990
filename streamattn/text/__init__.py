"""Text: the tokenizer built from GGUF metadata, and chat templates."""
