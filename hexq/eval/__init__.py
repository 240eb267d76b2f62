"""Perplexity evaluation and benchmark helpers."""
