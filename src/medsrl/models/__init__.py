"""Tokenizers and policies: the tiny char-level CPU preset and real Hugging Face models."""
