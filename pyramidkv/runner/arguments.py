"""The argument parser every command line of pyramidkv uses (runners, scripts, measure/): argparse's, with
what argparse lets through refused in one line (`<prog>: error: ...`, exit status 2) before anything runs:

- a flag written shorter (`--key_channel 0.5` for `--key_channel_ratio`): argparse's prefix matching is off;
- one setting given twice, by one flag repeated (`--num_samples 5 --num_samples 3`) or by two names of it
  (`--max_capacity_prompts 128 --budget 64`): argparse keeps the last, so the run would not be what half the
  command line says;
- a number that is not plain ASCII: a `type=int` / `type=float` flag reads `read_int` / `read_float`
  (components.py), which refuse `٨`, `1_0`, `1e3` for an integer, `nan` and `inf` for a number.

And what argparse refuses for want of a reading, it reads: a value that starts with `-` and reads as a number
(`-1e308`, `-inf`, `-.5`, `-1/2`: argparse knows only `-1` and `-0.5`) is a value, so it reaches the flag's own
check and gets its message there (kvzap's thresholds are negative by nature); a flag whose value is itself flags
(`--runner_args '--x'`, declared with `type=flags_text`) takes a value that starts with `-`; any other flag followed
by a word that starts with `-` and is no number is told to write `--flag=-word`, not only "expected one argument".

The flags a user typed, by dest, are in `parser.given` after parsing ({"budget": "--max_capacity_prompts"}).
`output_file` is the type of a flag naming a file written at the end: checked before the work.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from pyramidkv.components import check_output, read_float, read_int


def integer(text: str) -> int:
    try:
        return read_int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def number(text: str) -> float:
    try:
        return read_float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


STRICT_TYPES = {int: integer, float: number}

# A word that starts with "-" and is a value, not an option: a number as any type here reads it (argparse's own
# matcher takes only -1 and -0.5), or an i/n pair such as a shard.
NEGATIVE_VALUE = re.compile(r"^-(\d|\.\d|inf(inity)?$|nan$)", re.IGNORECASE)


def flags_text(text: str) -> str:
    """An argparse type for a value that is itself command-line flags (`--runner_args '--device cuda'`): it may start
    with `-` (the parser takes `--runner_args --x` as the value `--x`); refused when its quotes do not close."""
    try:
        shlex.split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} does not split into flags ({e})") from None
    return text


def output_file(text: str) -> str:
    """An argparse type for a file the script writes when it is done: refused at once when its folder does
    not exist or cannot be written, or when it is a folder, not after the work."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file path")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: its folder {str(folder)!r} does not exist")
    try:
        check_output(path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def output_folder(text: str) -> str:
    """An argparse type for a folder the script writes its files into when it is done (made if missing): refused at
    once when it is a file or cannot be made or written, not after the work."""
    try:
        check_output(text, folder=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with the refusals of the module docstring; errors are one line."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_VALUE
        self.given: dict[str, str] = {}
        self._words: list[str] = []

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {self._explained(message)}\n")

    def _explained(self, message: str) -> str:
        """argparse's "expected one argument" for a flag followed by a word that starts with "-": say how to give it."""
        match = re.fullmatch(r"argument (\S+?)(/\S+)*: expected one argument", message)
        if not match:
            return message
        for i, word in enumerate(self._words[:-1]):
            action = self._option_string_actions.get(word)
            following = self._words[i + 1]
            if action is not None and match[1] in action.option_strings and following.startswith("-"):
                return (f"{word}: expected one value, got the flag-like {following!r}; a value that starts with '-' is "
                        f"written {word}={following}")
        return message

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        for action in self._actions:          # every action, the ones added to groups included
            action.type = STRICT_TYPES.get(action.type, action.type)
        args = self._flag_values(args)
        self._words = args
        self.given = self._check_once(args)
        return super().parse_known_args(args, namespace)

    def _flag_values(self, args: list[str]) -> list[str]:
        """`--runner_args --x` as `--runner_args=--x` for a flag of type flags_text (its value is flags)."""
        out, i = [], 0
        while i < len(args):
            word = args[i]
            if word == "--":
                return out + args[i:]
            action = self._option_string_actions.get(word)
            if action is not None and action.type is flags_text and i + 1 < len(args) \
                    and args[i + 1].startswith("-") and args[i + 1] != "--":
                out.append(f"{word}={args[i + 1]}")
                i += 2
                continue
            out.append(word)
            i += 1
        return out

    def _check_once(self, args: list[str]) -> dict[str, str]:
        """{dest: option as typed} of the options in `args`; an error when two of them set one dest."""
        seen: dict[argparse.Action, str] = {}
        given: dict[str, str] = {}
        for i, token in enumerate(args):
            if token == "--":
                break
            option, eq, value = token.partition("=")
            action = self._option_string_actions.get(option if option.startswith("--") else token)
            if action is None or action.dest == argparse.SUPPRESS:      # --help
                continue
            if not eq:
                value = " ".join(self._values(args[i + 1:], action))
            shown = f"{option} {value}".strip()
            if action in seen:
                earlier = seen[action]
                same = earlier.split(" ")[0] == option
                self.error(f"{earlier} and {shown}: {'the flag is given twice' if same else 'both set ' + action.dest}"
                           f"; give it once")
            seen[action], given[action.dest] = shown, option
        return given

    def _values(self, rest: list[str], action: argparse.Action) -> list[str]:
        """The words after an option that argparse gives it (for the message only)."""
        if action.nargs == 0:
            return []
        words = []
        for word in rest:
            if word.startswith("-") and not self._negative_number_matcher.match(word):
                break
            words.append(word)
            if action.nargs in (None, "?"):
                break
        return words
