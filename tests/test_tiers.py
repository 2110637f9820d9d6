"""The suite's tiers are assigned in one place (tests/conftest.py's TIERS) and hold what they say: no test file
marks a tier itself, every entry names a test that exists, the markers are the ones pyproject.toml registers
(strictly), and a test outside a tier that starts a process or loads SmolLM2's weights is stopped with a line
naming where to list it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REAL_MODEL_FIXTURES, TIERS

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def defined_tests(path: Path) -> set[str]:
    """`name` and `Class::name` of the test functions a file defines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
    return names


def test_no_test_file_marks_a_tier_itself():
    pattern = re.compile(r"\bmark\.(" + "|".join(TIERS) + r")\b")
    marked = [str(p.relative_to(ROOT)) for p in TESTS.rglob("*.py")
              if p.name != "conftest.py" and pattern.search(p.read_text(encoding="utf-8"))]
    assert not marked, f"tiers are assigned in tests/conftest.py's TIERS only: {marked}"


def test_every_tier_entry_names_a_test_that_exists():
    missing = []
    for tier, entries in TIERS.items():
        for entry in entries:
            path, _, name = entry.partition("::")
            if not (ROOT / path).is_file():
                missing.append(f"{tier}: {entry} (no file {path})")
            elif name and name.split("[")[0] not in defined_tests(ROOT / path):
                missing.append(f"{tier}: {entry} (no test {name} in {path})")
    assert not missing, missing


def test_the_markers_are_registered_strictly():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in options["addopts"].split()
    assert sorted(line.split(":")[0] for line in options["markers"]) == sorted(TIERS)
    assert {"smollm2", "eager_setup"} <= REAL_MODEL_FIXTURES


def test_a_fast_test_that_starts_a_process_is_stopped():
    with pytest.raises(AssertionError, match=r"started .*list it under 'integration' in tests/conftest.py's TIERS"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    subprocess.run(["git", "--version"], check=True, capture_output=True)   # the runners' commit lookup is allowed


def test_a_fast_test_that_loads_the_real_weights_is_stopped(smollm2_path):
    from pyramidkv import load_model

    with pytest.raises(AssertionError, match=r"loaded SmolLM2's weights: .*list it under 'real_model'"):
        load_model(smollm2_path, attn_implementation="sdpa", device="cpu")
