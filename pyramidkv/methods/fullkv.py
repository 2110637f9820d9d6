"""FullKV: no compression (the reference every method is compared against)."""

from dataclasses import dataclass

from pyramidkv.methods.base import Method


@dataclass(frozen=True)
class FullKV(Method):
    name = "fullkv"
    needs_budget = False
    window_size: int = 0
