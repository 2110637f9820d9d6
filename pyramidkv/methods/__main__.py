"""Print the method table (name, paper, settings with defaults) as Markdown: `python -m pyramidkv.methods`."""

import dataclasses
import sys

from pyramidkv.methods import METHODS

COMMON = {"budget", "budget_ratio", "gqa_layout", "gqa_reduce", "decode_budget", "decode_interval"}


def method_table() -> str:
    lines = ["| method | what it does | settings (defaults) |", "|---|---|---|"]
    for name, cls in METHODS.items():
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")
        summary = " ".join(" ".join(part.split()) for part in doc[:2]).replace("|", "/")
        settings = ", ".join(f"`{f.name}={f.default!r}`" for f in dataclasses.fields(cls) if f.name not in COMMON)
        lines.append(f"| `{name}` | {summary} | {settings} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(method_table())
