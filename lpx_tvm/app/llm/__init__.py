"""Decoders run token by token: generate, many users at once, Hugging Face graphs."""
