"""The 5.x transformers line: the engine behind the attention interface (docs/transformers5.md)."""
