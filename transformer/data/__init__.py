"""Data: the download, tokenize and build_vocab stages' code, and training's token batches."""
