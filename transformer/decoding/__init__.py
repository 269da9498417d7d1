"""Decoding: beam search and the Translator that the decode stage and users run."""
