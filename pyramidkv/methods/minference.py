"""MInference (Jiang et al., NeurIPS 2024, "MInference 1.0: Accelerating Pre-filling for Long-Context LLMs
via Dynamic Sparse Attention"): the full cache, the prompt's attention computed sparsely. Each query head
follows its pattern from the model's table (official JSON layout; the default model's ships with the
package, scripts/minference_patterns.py writes one for any model): vertical-slash (columns and diagonals
estimated from the last 64 queries), A-shape or block-sparse (pyramidkv/sparse_prefill/). On CPU an exact
masked reference (accuracy, not speed); the optional `minference` package's kernels on CUDA. Any method
takes the same prefill: make_method("snapkv", budget=256, prefill_attention="minference").
"""

from dataclasses import dataclass
from typing import Optional

from pyramidkv.methods.fullkv import FullKV
from pyramidkv.sparse_prefill.base import SparsePrefill
from pyramidkv.sparse_prefill.minference import MInference


@dataclass(frozen=True)
class MInferenceMethod(FullKV):
    name = "minference"
    prefill_attention: Optional[SparsePrefill] = MInference()
