"""Locally built models and tokenizers (no download)."""
from .tiny import CHAT_TEMPLATE, TinyModelConfig, build_corpus, build_tiny_model

__all__ = ["CHAT_TEMPLATE", "TinyModelConfig", "build_corpus", "build_tiny_model"]
