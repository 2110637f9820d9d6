"""Print the method table (name, paper, settings with defaults) as Markdown: `python -m pyramidkv.methods`."""

import dataclasses
import sys

from pyramidkv.components import flat_settings
from pyramidkv.methods import METHODS, Method

# Settings every method shares, listed under the table (a method's row shows one only where its default differs).
# Capabilities (Method.flat_units) show their settings the same way.
COMMON = {"budget", "budget_ratio", "gqa_layout", "gqa_reduce", "prefill_attention"}


def method_table() -> str:
    lines = ["| method | what it does | settings (defaults) |", "|---|---|---|"]
    for name, cls in METHODS.items():
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")
        summary = " ".join(" ".join(part.split()) for part in doc[:2]).replace("|", "/")
        base = {f.name: f.default for f in dataclasses.fields(Method)}
        shown = []
        for f in dataclasses.fields(cls):
            if f.name in Method.flat_units:   # a capability: its settings where this method's default differs
                unit = Method.flat_units[f.name]
                before, after = flat_settings(unit, base[f.name]), flat_settings(unit, f.default)
                shown.extend(f"`{k}={v!r}`" for k, v in after.items() if v != before.get(k) and v is not None)
            elif f.name not in COMMON or f.default != base[f.name]:
                shown.append(f"`{f.name}={f.default!r}`")
        settings = ", ".join(shown)
        lines.append(f"| `{name}` | {summary} | {settings} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(method_table())
