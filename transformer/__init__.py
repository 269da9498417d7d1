"""The Transformer of "Attention Is All You Need", as a reproducible DVC pipeline."""
