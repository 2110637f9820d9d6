"""The docs' generated tables, each written from its one source: `python -m pyramidkv.doc_tables`.

    file                   heading                               source
    docs/methods.md        ## The method table                   the registry (`method_table`, methods/__main__.py)
    docs/methods.md        ## Budget kinds (the sizing)          SIZINGS (pyramidkv/sizing), one row per kind
    docs/architecture.md   ## The engine (`pyramidkv/core/`)     each core module's docstring, first paragraph
    docs/models.md         ## Supported models                   MODEL_GLUE (models/patch.py), one row per family
    README.md              ## Models                             the same table

A generated table is the first Markdown table under its heading. The command rewrites every one in place
(run it from the repository root, or pass `--root`); `--check` writes nothing and exits with status 1
when a table differs from its source. tests/test_docs.py fails on the same difference: a core file added,
a docstring or a method changed, a row edited by hand.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Callable

from pyramidkv.methods.__main__ import method_table
from pyramidkv.models.loading import family_name
from pyramidkv.models.patch import MODEL_GLUE
from pyramidkv.runner.arguments import ArgumentParser

CORE = Path(__file__).resolve().parent / "core"


def summary(doc: str, paragraphs: int = 1) -> str:
    """The first `paragraphs` paragraphs of a docstring as one table cell: one line, `|` written `/`."""
    parts = doc.strip().split("\n\n")[:paragraphs]
    return " ".join(" ".join(part.split()) for part in parts).replace("|", "/")


def core_table(core: Path = CORE) -> str:
    """One row per module of pyramidkv/core/ (alphabetical, `__init__.py` aside): the first paragraph of its
    docstring. A module without a docstring is an error, not a missing row."""
    lines = ["| file | what |", "|---|---|"]
    for path in sorted(core.glob("*.py")):
        if path.name == "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        if not doc:
            raise ValueError(f"{path} has no module docstring; its first paragraph is the file's row in "
                             f"docs/architecture.md")
        lines.append(f"| `{path.name}` | {summary(doc)} |")
    return "\n".join(lines)


def sizing_table() -> str:
    """One row per kind of SIZINGS, in its order: its settings, whether --max_capacity_prompts sets it, whether
    its count is an outcome, whether it evicts, and the first paragraph of its module's docstring."""
    import dataclasses
    import sys as _sys

    from pyramidkv.sizing import SIZINGS

    lines = ["| kind | settings | `--max_capacity_prompts` sets it | count is an outcome | evicts | what |",
             "|---|---|---|---|---|---|"]
    for name, cls in SIZINGS.items():
        settings = ", ".join(f"`{f.name}`" for f in dataclasses.fields(cls)) or "none"
        flag = "yes" if cls.budget_kind else "a unit that reads a budget (quest's pages)" if "budget_names" in vars(cls) else "no"
        doc = summary(_sys.modules[cls.__module__].__doc__ or "")
        lines.append(f"| `{name}` | {settings} | {flag} | {'yes' if cls.outcome else 'no'} | "
                     f"{'yes' if cls.evicts else 'no'} | {doc} |")
    return "\n".join(lines)


def model_table(glues: dict | None = None) -> str:
    """One row per family of MODEL_GLUE, in its order: the name (its causal-LM class less ForCausalLM), the
    config's model_type (the --model_class value), the transformers class loaded, the attention classes
    patched, the config settings the compressed cache does not apply (ModelGlue.unapplied_settings)."""
    lines = ["| family | `model_type` (`--model_class`) | transformers class | attention patched | "
             "settings not applied |", "|---|---|---|---|---|"]
    for model_type, glue in (MODEL_GLUE if glues is None else glues).items():
        attention = ", ".join(f"`{cls.__name__}`" for cls in glue.attention_classes)
        unapplied = ", ".join(f"`{name}`" for name in glue.unapplied_settings) or "none"
        lines.append(f"| {family_name(glue)} | `{model_type}` | `{glue.causal_lm.__name__}` | {attention} | "
                     f"{unapplied} |")
    return "\n".join(lines)


# (file under the repository root, the heading the table stands under, what writes the table)
TABLES: list[tuple[str, str, Callable[[], str]]] = [
    ("docs/methods.md", "## The method table", method_table),
    ("docs/methods.md", "## Budget kinds (the sizing)", sizing_table),
    ("docs/architecture.md", "## The engine (`pyramidkv/core/`)", core_table),
    ("docs/models.md", "## Supported models", model_table),
    ("README.md", "## Models", model_table),
]


def table_span(lines: list[str], heading: str) -> tuple[int, int]:
    """[start, end) of the first table (lines starting with `|`) under `heading`, before the next heading."""
    if heading not in lines:
        raise ValueError(f"no heading {heading!r}")
    start = lines.index(heading) + 1
    while start < len(lines) and not lines[start].startswith("|"):
        if lines[start].startswith("#"):
            break
        start += 1
    if start == len(lines) or not lines[start].startswith("|"):
        raise ValueError(f"no table under {heading!r}")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def written_table(text: str, heading: str) -> str:
    """The table that stands under `heading` in `text`, as written there."""
    lines = text.split("\n")
    start, end = table_span(lines, heading)
    return "\n".join(lines[start:end])


def with_table(text: str, heading: str, table: str) -> str:
    """`text` with the table under `heading` replaced by `table`."""
    lines = text.split("\n")
    start, end = table_span(lines, heading)
    return "\n".join(lines[:start] + table.split("\n") + lines[end:])


def stale(root: Path, tables=TABLES) -> list[str]:
    """`file: heading` of each generated table that differs from what its source gives now."""
    found = []
    for name, heading, make in tables:
        try:
            written = written_table((root / name).read_text(encoding="utf-8"), heading)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
        if written != make():
            found.append(f"{name}: {heading}")
    return found


def rewrite(root: Path, tables=TABLES) -> list[str]:
    """Write every generated table from its source; returns `file: heading` of those that changed."""
    changed = []
    for name, heading, make in tables:
        path = root / name
        text = path.read_text(encoding="utf-8")
        new = with_table(text, heading, make())
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(f"{name}: {heading}")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m pyramidkv.doc_tables", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root (default: here)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    missing = [name for name, _, _ in TABLES if not (args.root / name).is_file()]
    if missing:
        parser.error(f"{args.root.resolve()} is not the repository root: no {', '.join(missing)}")
    try:
        found = stale(args.root)
    except ValueError as error:
        parser.error(str(error))
    if args.check:
        print("\n".join(f"stale: {entry}" for entry in found) or "every generated table is up to date")
        return 1 if found else 0
    changed = rewrite(args.root)
    print("\n".join(f"rewritten: {entry}" for entry in changed) or "every generated table was up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
