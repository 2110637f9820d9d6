"""The docs stay true: generated tables equal their sources, the README stays short and starts with the two
commands, its method table names every registered method, and every path and link the docs give exists."""

import re
import shutil
import sys
from pathlib import Path

import pytest

from pyramidkv.doc_tables import CORE, TABLES, core_table, rewrite, stale, written_table
from pyramidkv.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
METHODS_DOC = ROOT / "docs" / "methods.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ENGINE = "## The engine (`pyramidkv/core/`)"
# The files whose paths and links are checked.
DOCS = [README, ROOT / "CONTRIBUTING.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "examples").glob("*.md"))]


# ---- generated tables ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, heading, make", TABLES, ids=[name for name, _, _ in TABLES])
def test_generated_table_is_what_its_source_gives(name, heading, make):
    written = written_table((ROOT / name).read_text(encoding="utf-8"), heading)
    assert written == make(), f"{name} is stale: regenerate with: python -m pyramidkv.doc_tables"


def test_engine_table_lists_every_file_of_core_once():
    rows = written_table(ARCHITECTURE.read_text(encoding="utf-8"), ENGINE).split("\n")[2:]
    listed = [re.match(r"\| `([\w.]+)` \|", row).group(1) for row in rows]
    files = sorted(p.name for p in (ROOT / "pyramidkv" / "core").glob("*.py") if p.name != "__init__.py")
    assert listed == files


def _core_copy(tmp_path: Path) -> Path:
    core = tmp_path / "core"
    shutil.copytree(CORE, core, ignore=shutil.ignore_patterns("__pycache__"))
    return core


def test_a_new_core_file_changes_the_engine_table(tmp_path):
    core = _core_copy(tmp_path)
    (core / "sketch.py").write_text('"""Count-min sketches of attention, one per layer."""\n')
    table = core_table(core)
    assert "| `sketch.py` | Count-min sketches of attention, one per layer. |" in table.split("\n")
    assert table != written_table(ARCHITECTURE.read_text(encoding="utf-8"), ENGINE)


def test_a_core_file_without_a_docstring_is_refused(tmp_path):
    core = _core_copy(tmp_path)
    (core / "sketch.py").write_text("import torch\n")
    with pytest.raises(ValueError, match="sketch.py has no module docstring"):
        core_table(core)


@pytest.mark.parametrize("edit", ["change a row", "add a row", "drop a row"])
def test_a_table_edited_by_hand_is_found_and_rewritten(tmp_path, edit):
    for name, _, _ in TABLES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    assert stale(tmp_path) == []
    path = tmp_path / "docs" / "architecture.md"
    text = path.read_text(encoding="utf-8")
    row = next(line for line in text.split("\n") if line.startswith("| `store.py` |"))
    edited = {"change a row": row[:-len(" |")] + " Edited by hand. |",
              "add a row": row + "\n| `sketch.py` | Count-min sketches. |",
              "drop a row": ""}[edit]
    path.write_text(text.replace(row + "\n", edited + "\n" if edited else ""), encoding="utf-8")
    assert path.read_text(encoding="utf-8") != text
    assert stale(tmp_path) == [f"docs/architecture.md: {ENGINE}"]
    assert rewrite(tmp_path) == [f"docs/architecture.md: {ENGINE}"]
    assert path.read_text(encoding="utf-8") == text and stale(tmp_path) == []


def test_a_family_added_to_model_glue_is_a_row_of_the_model_tables_and_of_help(monkeypatch, capsys):
    """The README's and docs/models.md's model tables and the runners' --help list MODEL_GLUE's rows, a row added
    there (a Qwen2 variant under a model_type of its own) included, with no other edit."""
    from transformers.models.qwen2 import modeling_qwen2

    import pyramidkv.models.loading as loading
    from pyramidkv.doc_tables import model_table
    from pyramidkv.models.patch import MODEL_GLUE
    from pyramidkv.models.rope import RotateHalfGlue
    from pyramidkv.runner.protocol import build_parser
    from pyramidkv.benchmarks.ruler.run import Ruler

    glues = {**MODEL_GLUE, "my_qwen2": RotateHalfGlue(causal_lm=modeling_qwen2.Qwen2ForCausalLM,
                                                   attention_classes=(modeling_qwen2.Qwen2Attention,),
                                                   apply_rotary_pos_emb=modeling_qwen2.apply_rotary_pos_emb,
                                                   unapplied_settings=("sliding_window",))}
    rows = model_table(glues).split("\n")[2:]
    assert rows[:-1] == model_table().split("\n")[2:]
    assert rows[-1] == "| Qwen2 | `my_qwen2` | `Qwen2ForCausalLM` | `Qwen2Attention` | `sliding_window` |"
    monkeypatch.setattr(loading, "MODEL_GLUE", glues)
    help_text = " ".join(build_parser(Ruler(), []).format_help().split())
    assert all(f"{model_type} ({glue.causal_lm.__name__})" in help_text for model_type, glue in glues.items())
    assert "my_qwen2 (Qwen2ForCausalLM) (docs/models.md)" in help_text


# ---- the README ---------------------------------------------------------------------------------------

def test_readme_is_short():
    assert README.stat().st_size < 15_000, "the README is a front page: move details to docs/"


def test_readme_starts_with_quickstart_and_test_commands():
    lines = [l for l in README.read_text().splitlines() if l.strip()]
    assert lines[1] == "```bash"
    assert lines[2].startswith("make quickstart") and lines[3].startswith("make test")


def test_ci_runs_the_readme_test_command():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


def paper_cited(cls) -> str:
    """The citation in parentheses after the method's name at the start of its module docstring, or '-'."""
    doc = " ".join((sys.modules[cls.__module__].__doc__ or "").split())
    opening = re.match(r"[^(:.]*\(", doc)
    if not opening:
        return "-"
    depth = 0
    for end in range(opening.end() - 1, len(doc)):
        depth += {"(": 1, ")": -1}.get(doc[end], 0)
        if depth == 0:
            return doc[opening.end():end]
    raise ValueError(f"unbalanced parentheses in the docstring of {cls.__module__}")


def readme_method_rows() -> list[tuple[str, str, str, str]]:
    """(name, anchor in docs/methods.md, paper, line) of each row of the README's method table."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Methods"):text.index("## Python API")]
    rows = []
    for line in section.splitlines():
        if line.startswith("| [`"):
            found = re.fullmatch(r"\| \[`(\w+)`\]\(docs/methods\.md#([\w-]+)\) \| ([^|]+) \| ([^|]+) \|", line)
            assert found, f"a README method row is not | [`name`](docs/methods.md#anchor) | paper | line |: {line}"
            rows.append(found.groups())
    return rows


def test_readme_method_table_names_every_method_with_its_paper():
    rows = readme_method_rows()
    assert [name for name, *_ in rows] == list(METHODS), "one row per registered method, in the registry's order"
    anchors = heading_anchors(METHODS_DOC)
    for name, anchor, paper, line in rows:
        assert anchor in anchors, f"{name}: docs/methods.md has no heading #{anchor}"
        assert paper == paper_cited(METHODS[name]), f"{name}: the paper as its module docstring cites it"
        assert len(line) <= 100, f"{name}: one short line ({len(line)} characters)"


def test_paper_cited_reads_the_docstring_citation():
    from pyramidkv.methods.fullkv import FullKV
    from pyramidkv.methods.snapkv import SnapKV
    from pyramidkv.methods.zigzagkv import ZigZagKV

    assert paper_cited(SnapKV) == 'Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"'
    assert paper_cited(ZigZagKV) == "Zhong et al., COLING 2025, arXiv 2412.09036"
    assert paper_cited(FullKV) == "-"


def test_readme_python_api_block_runs_as_written():
    """The README's Python API block, run as is (max_new_tokens cut to 2 to stay fast)."""
    text = README.read_text()
    section = text[text.index("## Python API"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "max_new_tokens=32" in block
    namespace: dict = {}
    exec(compile(block.replace("max_new_tokens=32", "max_new_tokens=2"), "README.md", "exec"), namespace)
    assert isinstance(namespace["outputs"][0].text, str) and namespace["outputs"][0].kv_bytes_per_prompt > 0


@pytest.mark.parametrize("path", [README, RESULTS], ids=["README.md", "docs/results.md"])
def test_commands_do_not_overwrite_tracked_docs(path):
    assert not re.search(r"--out\s+docs/", path.read_text())


# ---- paths and links ----------------------------------------------------------------------------------

@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_path_and_link_in_the_docs_exists(doc):
    text = doc.read_text(encoding="utf-8")
    missing = [path for path in re.findall(r"(?<![\w/.])((?:scripts|measure|examples|tests)/[\w./-]+\.(?:py|sh|sbatch|ipynb))",
                                           text) if not (ROOT / path).exists()]
    for target, anchor in re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]*))?\)", text):
        if target.startswith(("http://", "https://")):
            continue
        if not (doc.parent / target).exists():
            missing.append(target)
        elif anchor and target.endswith(".md") and anchor not in heading_anchors(doc.parent / target):
            missing.append(f"{target}#{anchor}")
    assert not missing, f"{doc.relative_to(ROOT)} names what is not there: {missing}"


def test_the_figures_of_the_results_page_are_there():
    """Every figure and raw JSON the README once showed, now on docs/results.md."""
    text = RESULTS.read_text(encoding="utf-8")
    for figure in ("needle_smollm2-135m_grid_recall.png", "needle_smollm2-135m_grid_rouge1_f.png",
                   "ruler_smollm2-135m_2048.png"):
        assert f"](figures/{figure})" in text
    for raw in ("latency_memory_cpu_n4096_b256.json", "latency_memory_cpu_n1000_b128.json"):
        assert f"](benchmarks/{raw})" in text
    assert "python measure/benchmark_latency_memory.py --context_length 4096" in text


# ---- docs/method_spec.md: every example reads as the page says ----------------------------------------

METHOD_SPEC = ROOT / "docs" / "method_spec.md"


def _blocks(kind: str) -> list[str]:
    lines = [line.strip() for block in re.findall(rf"```{kind}\n(.*?)```", METHOD_SPEC.read_text(encoding="utf-8"),
                                                  re.S) for line in block.splitlines()]
    return [line for line in lines if line]


@pytest.mark.parametrize("line", _blocks("spec"))
def test_method_spec_page_examples_parse_to_their_canonical_form(line):
    from pyramidkv.methods import method_spec, parse_method_spec

    spec, _, canonical = (part.strip() for part in line.partition(" -> "))
    method = parse_method_spec(spec)
    assert method_spec(method) == (canonical or spec)
    assert parse_method_spec(method_spec(method)) == method


@pytest.mark.parametrize("spec", _blocks("refused"))
def test_method_spec_page_refused_examples_are_refused(spec):
    from pyramidkv.methods import parse_method_spec

    with pytest.raises(ValueError, match=re.escape(f"method spec {spec!r}")):
        parse_method_spec(spec)


def test_method_spec_page_has_examples():
    assert len(_blocks("spec")) >= 10 and len(_blocks("refused")) >= 5
