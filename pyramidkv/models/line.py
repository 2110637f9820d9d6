"""Which transformers line is installed, read once: the pinned 4.44.2 (the reference line, its models patched by
the glue rows of models/) or the 5.x line (models/tf5/: one registered attention function and a `Cache`)."""

from __future__ import annotations

import transformers

PINNED = "4.44.2"   # requirements.txt; requirements-tf5.txt pins the 5.x line
VERSION = transformers.__version__
INTERFACE_LINE = int(VERSION.split(".")[0]) >= 5   # the attention interface is the seam (models/tf5/)


def line_name() -> str:
    """The installed line in words, for messages."""
    return f"transformers {VERSION} ({'the 5.x line' if INTERFACE_LINE else 'the pinned line'})"
CACHE_ARGUMENT = "cache" if INTERFACE_LINE else "past_key_values"   # a forward's / generate()'s cache argument
