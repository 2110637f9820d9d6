"""Figures of what KV-cache compression sees and keeps (matplotlib; every `plot_*` returns
`Plot(figure, data)`, the data being exactly what is drawn).

    from pyramidkv.viz import plot_attention_map, plot_kept_tokens, plot_score_curve, plot_budget_maps
    fig, maps = plot_kept_tokens(model, tokenizer, prompt, [snapkv, pyramidkv], highlight="73691")

Attention maps need a model loaded with attn_implementation="eager". Kept maps, score curves and
budget maps read the compressed cache through its public inspection API. Layer and head indices
out of range, an empty prompt or an unknown highlight raise one error naming the bad value.
`plot_needle_heatmap` (and `plot_run`/`plot_grid`, which write PNGs) live in `pyramidkv.viz.needle`.
"""

from pyramidkv.viz.data import (
    Prompt,
    ScoreCurve,
    allocation_variants,
    attention_weights,
    prefill,
    score_curve,
    tokenize,
)
from pyramidkv.viz.needle import plot_needle_heatmap
from pyramidkv.viz.plots import (
    AttentionMap,
    BudgetMap,
    KeptTokenMap,
    Plot,
    budget_maps,
    describe_figure,
    kept_token_maps,
    plot_attention_map,
    plot_budget_maps,
    plot_kept_tokens,
    plot_score_curve,
)

__all__ = [
    "AttentionMap", "BudgetMap", "allocation_variants", "KeptTokenMap", "Plot", "Prompt", "ScoreCurve", "attention_weights",
    "budget_maps", "describe_figure", "kept_token_maps", "plot_attention_map", "plot_budget_maps",
    "plot_kept_tokens", "plot_needle_heatmap", "plot_score_curve", "prefill", "score_curve", "tokenize",
]
