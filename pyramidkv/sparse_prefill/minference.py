"""MInference (Jiang et al., NeurIPS 2024, "MInference 1.0: Accelerating Pre-filling for Long-Context LLMs
via Dynamic Sparse Attention") as a prefill attention any method can use: each query head of each layer
follows its pattern from a table (official JSON layout, tables.py), its index built online from the
prompt (indices.py). On CPU the pattern's entries are computed exactly with a mask (attention.py):
MInference's accuracy, not its speed; with CUDA and the optional `minference` package its kernels run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from pyramidkv.components import ModelShape
from pyramidkv.sparse_prefill.base import HeadMasks, PrefillPattern, SparsePrefill
from pyramidkv.sparse_prefill.indices import (block_sparse_blocks, diagonal_blocks, last_query_attention,
                                              vertical_slash_sets)
from pyramidkv.sparse_prefill.tables import check_table_shape, default_pattern_table, load_pattern_table

SLASH_COVERAGES = ("kernel", "lines")


@lru_cache(maxsize=8)
def _table(path: Optional[str], model_name: str):
    return load_pattern_table(path if path is not None else default_pattern_table(model_name))


@dataclass(frozen=True)
class MInference(SparsePrefill):
    """pattern_table: a table in MInference's JSON layout (None: the one packaged for the model).
    last_q: queries whose attention estimates the vertical-slash index (official 64).
    block_size: block-sparse heads' block (official 64), also the block of the kernel's diagonal coverage; at
        most the model's context window (max_position_embeddings).
    block_top_k: blocks a block-sparse head reads per query block (official 100).
    slash_coverage: "kernel" computes what the official CUDA kernel computes for a diagonal (the 64-column
        blocks around it, per 64-row block); "lines" only the diagonal's own entries (the paper's mask).
    start_layer: layers below it prefill densely (official `starting_layer`, 0)."""

    name = "minference"
    pattern_table: Optional[str] = None
    last_q: int = 64
    block_size: int = 64
    block_top_k: int = 100
    slash_coverage: str = "kernel"
    start_layer: int = 0
    path_settings = ("pattern_table",)

    def validate(self) -> None:
        for setting in ("last_q", "block_size", "block_top_k"):
            if getattr(self, setting) < 1:
                raise ValueError(f"{setting} must be an integer >= 1, got {getattr(self, setting)!r}")
        if self.start_layer < 0:
            raise ValueError(f"start_layer must be an integer >= 0, got {self.start_layer!r}")
        if self.slash_coverage not in SLASH_COVERAGES:
            raise ValueError(f"slash_coverage must be one of {'|'.join(SLASH_COVERAGES)}, got {self.slash_coverage!r}")
        if self.pattern_table is not None and not Path(self.pattern_table).is_file():
            raise ValueError(f"pattern_table {self.pattern_table!r} is not a file")

    def check_prompt(self, prompt_len: int) -> None:
        if self.last_q != type(self)().last_q and self.last_q > prompt_len:
            raise ValueError(f"last_q {self.last_q} is longer than the {prompt_len}-token prompt: the run would estimate "
                             f"the index with all {prompt_len} queries under a label that says {self.last_q}; use "
                             f"last_q <= {prompt_len}")

    def packaged_files(self, model: Optional[ModelShape]) -> dict[str, str]:
        if self.pattern_table is not None or model is None or not model.name:
            return {}
        path = default_pattern_table(model.name)
        return {f"pattern_table=packaged {path.name}": str(path)}

    def check_model(self, model: ModelShape) -> None:
        if model.form.sliding or model.form.capped:
            raise ValueError("prefill_attention minference: this model has sliding-window layers or a soft-capped "
                             "attention, which the sparse prefill kernels do not apply; use dense prefill")
        context = getattr(model, "context_window", None)
        if context and self.last_q > context:
            raise ValueError(f"last_q {self.last_q} is longer than any prompt of this model (max_position_embeddings "
                             f"{context}); use last_q <= {context}")
        if self.start_layer >= model.num_layers:
            raise ValueError(f"start_layer {self.start_layer} leaves none of the model's {model.num_layers} layers "
                             f"sparse (every layer would prefill densely: that is fullkv); use start_layer < "
                             f"{model.num_layers}")
        if model.context_window and self.block_size > model.context_window:
            raise ValueError(f"block_size {self.block_size} is longer than the model's context window "
                             f"({model.context_window} tokens): one block would hold every prompt; allowed: 1 <= "
                             f"block_size <= {model.context_window}")
        source = self.pattern_table or default_pattern_table(model.name)
        check_table_shape(_table(self.pattern_table, model.name), model.num_layers, model.num_query_heads, source)

    def pattern(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor, pad_lens: list[int],
                model_name: str = "") -> Optional[PrefillPattern]:
        if layer_idx < self.start_layer:
            return None
        row = _table(self.pattern_table, model_name)[layer_idx]
        return PrefillPattern([self.head_masks(row, queries[b, :, pad:], keys[b, :, pad:])
                               for b, pad in enumerate(pad_lens)], pad_lens)

    def head_masks(self, patterns: list[tuple[str, int, int]], queries: torch.Tensor, keys: torch.Tensor) -> HeadMasks:
        """One prompt: queries [Hq, n, D], keys [Hkv, n, D] -> its heads' masks."""
        heads, n, _ = queries.shape
        group = heads // keys.shape[0]
        device = queries.device
        columns = torch.zeros(heads, n, dtype=torch.bool, device=device)
        diagonals = torch.zeros(heads, n, dtype=torch.bool, device=device)
        blocks = None
        sources, kernel_heads, kernel_offsets = [], [], []
        for h, (kind, vertical, slash) in enumerate(patterns):
            k = keys[h // group]
            if kind == "vertical_and_slash":
                cols, offsets = vertical_slash_sets(last_query_attention(queries[h], k, self.last_q), vertical, slash)
                columns[h, cols] = True
                if self.slash_coverage == "lines":
                    diagonals[h, offsets] = True
                else:
                    kernel_heads.append(h)
                    kernel_offsets.append(offsets)
                sources.append((kind, cols, offsets))
            elif kind == "stream_llm":
                columns[h, :vertical] = True
                diagonals[h, :slash] = True
                sources.append((kind, vertical, slash))
            else:
                chosen = block_sparse_blocks(queries[h], k, self.block_size, self.block_top_k)
                blocks = self._blocks(blocks, heads, n, device)
                blocks[h] = chosen.repeat_interleave(self.block_size, dim=1)[:, :n]
                sources.append((kind, self.block_top_k, 0))
        if kernel_heads:
            blocks = self._blocks(blocks, heads, n, device)
            blocks[kernel_heads] = diagonal_blocks(kernel_offsets, n, self.block_size)
        return HeadMasks(columns, diagonals, blocks, self.block_size, sources)

    def _blocks(self, blocks: Optional[torch.Tensor], heads: int, n: int, device) -> torch.Tensor:
        if blocks is not None:
            return blocks
        return torch.zeros(heads, -(-n // self.block_size), n, dtype=torch.bool, device=device)
