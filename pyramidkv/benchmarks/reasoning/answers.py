"""Answer extraction, as the datasets' own graders do it (written from their rules, docs/reasoning.md):

GSM8K (openai/grade-school-math, dataset.py): the answer is the first `#### <number>` of the text (the number:
digits, `-`, `.`, `,`; commas removed), compared as a string with the reference's; no `####`: invalid (wrong).

MATH (hendrycks/math, and prm800k's grader for MATH-500): the answer is the last `\\boxed{...}` (or `\\fbox{...}`,
braces matched, so `\\boxed{\\frac{1}{2}}` is `\\frac{1}{2}`; `\\boxed 5` without braces reads to the next `$`),
and two answers are equal when their normalised strings are (`normalize_math`: units in `\\text{ ...}` on the right,
`\\left`/`\\right`, degrees, `\\$`, `\\%`, spaces, `dfrac`/`tfrac`, `\\frac12`, `a/b`, `0.5`, a leading `x =`).

The generated chain (tasks.py): `Step k: x = <integer>` lines and a final `#### <integer>`.
"""

from __future__ import annotations

import re
from typing import Optional

GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_answer(text: str) -> Optional[str]:
    """The number after the first `#### ` (commas removed); None when there is none."""
    match = GSM8K_ANSWER.search(text)
    return match.group(1).strip().replace(",", "") if match else None


def last_boxed(text: str) -> Optional[str]:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` (braces matched), or of `\\boxed x` up to the next `$`;
    None when there is none or its braces do not close."""
    at = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if at < 0:
        return None
    rest = text[at:]
    name = "\\boxed" if rest.startswith("\\boxed") else "\\fbox"
    opening = rest.find("{")
    if opening < 0 or rest[len(name):opening].strip():     # no brace right after: `\\boxed 5$`
        return rest[len(name) + 1:].split("$")[0].strip() or None if rest[len(name):len(name) + 1] == " " else None
    depth = 0
    for i in range(opening, len(rest)):
        depth += {"{": 1, "}": -1}.get(rest[i], 0)
        if depth == 0:
            return rest[opening + 1:i]
    return None


def _braced_fractions(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`, `\\frac{1}2` -> `\\frac{1}{2}`."""
    parts = text.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if not part or part[0] == "{":
            numerator, rest = _group(part)
        else:
            numerator, rest = "{" + part[0] + "}", part[1:]
        if numerator is None:
            return text
        if rest and rest[0] == "{":
            denominator, rest = _group(rest)
            if denominator is None:
                return text
        elif rest:
            denominator, rest = "{" + rest[0] + "}", rest[1:]
        else:
            return text
        out += numerator + denominator + rest
    return out


def _group(text: str) -> tuple[Optional[str], str]:
    """(the leading `{...}` group, the rest); (None, text) when text does not start with a closed group."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return (text[:i + 1], text[i + 1:]) if i else (None, text)
    return None, text


def normalize_math(answer: str) -> str:
    """A MATH answer in the normal form two equal answers share (the module docstring lists the rules)."""
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "").replace("$", "")
    if "\\text{ " in s:                                   # units on the right: "5\\text{ cm}"
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:     # "x = 5", "k=3"
        s = sides[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _braced_fractions(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    match = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if match:
        s = f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}"
    return s


def math_equal(predicted: Optional[str], reference: str) -> bool:
    """MATH's equality of two answers: their normal forms are the same string (None: wrong)."""
    return predicted is not None and normalize_math(predicted) == normalize_math(reference)


STEP_LINE = re.compile(r"Step\s+(\d+)\s*:\s*x\s*=\s*(-?\d+)")


def chain_steps(text: str) -> dict[int, int]:
    """{step number: value} of the `Step k: x = v` lines, the first line of each step counting."""
    found: dict[int, int] = {}
    for number, value in STEP_LINE.findall(text):
        found.setdefault(int(number), int(value))
    return found
