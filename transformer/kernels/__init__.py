"""CPU fast paths, each beside the plain definition it must equal, switched on from one place."""
