"""The README stays true: its method table is the registry's, and it starts with the two commands."""

from pathlib import Path

from pyramidkv.methods.__main__ import method_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_method_table_is_generated_from_the_registry():
    assert method_table() in README.read_text(), "regenerate with: python -m pyramidkv.methods"


def test_readme_starts_with_quickstart_and_test_commands():
    lines = [l for l in README.read_text().splitlines() if l.strip()]
    assert lines[1] == "```bash"
    assert lines[2].startswith("make quickstart") and lines[3].startswith("make test")


def test_ci_runs_the_readme_test_command():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci


def test_readme_python_api_block_runs_as_written():
    """The README's Python API block, run as is (max_new_tokens cut to 2 to stay fast)."""
    import re

    text = README.read_text()
    section = text[text.index("## Python API"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "max_new_tokens=32" in block
    namespace: dict = {}
    exec(compile(block.replace("max_new_tokens=32", "max_new_tokens=2"), "README.md", "exec"), namespace)
    assert isinstance(namespace["outputs"][0].text, str) and namespace["outputs"][0].kv_bytes_per_prompt > 0


def test_readme_commands_do_not_overwrite_tracked_docs():
    import re

    assert not re.search(r"--out\s+docs/", README.read_text())
