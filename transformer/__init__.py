"""The Transformer of "Attention Is All You Need", as a reproducible DVC pipeline.

`from transformer import Translator` is the Python API (transformer.decoding.translate); it is imported
on first use, so importing the package stays light (no torch)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Translator":
        from transformer.decoding.translate import Translator

        return Translator
    raise AttributeError(f"module 'transformer' has no attribute {name!r}")
