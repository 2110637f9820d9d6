"""Print the method table (name, paper, settings with defaults) as Markdown: `python -m pyramidkv.methods`."""

import dataclasses
import sys

from pyramidkv.methods import METHODS, Method

# Settings every method shares, listed under the table (a method's row shows one only where its default differs).
COMMON = {"budget", "budget_ratio", "gqa_layout", "gqa_reduce", "decode_budget", "decode_interval", "num_sinks",
          "random_fraction", "random_seed", "key_channel_ratio", "key_recent_size", "key_query_window", "page_budget",
          "page_size", "page_min_count", "page_keep_last", "page_dense_layers", "page_selection", "cross_layer_merge",
          "cross_layer_start", "cross_layer_t", "cross_layer_retain", "prefill_attention"}


def method_table() -> str:
    lines = ["| method | what it does | settings (defaults) |", "|---|---|---|"]
    for name, cls in METHODS.items():
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")
        summary = " ".join(" ".join(part.split()) for part in doc[:2]).replace("|", "/")
        base = {f.name: f.default for f in dataclasses.fields(Method)}
        settings = ", ".join(f"`{f.name}={f.default!r}`" for f in dataclasses.fields(cls)
                             if f.name not in COMMON or f.default != base[f.name])
        lines.append(f"| `{name}` | {summary} | {settings} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(method_table())
