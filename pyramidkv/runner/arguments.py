"""The argument parser every command line of pyramidkv uses (runners, scripts, measure/): argparse's, with
what argparse lets through refused in one line (`<prog>: error: ...`, exit status 2) before anything runs:

- a flag written shorter (`--key_channel 0.5` for `--key_channel_ratio`): argparse's prefix matching is off;
- one setting given twice, by one flag repeated (`--num_samples 5 --num_samples 3`) or by two names of it
  (`--max_capacity_prompts 128 --budget 64`): argparse keeps the last, so the run would not be what half the
  command line says;
- a number that is not plain ASCII: a `type=int` / `type=float` flag reads `read_int` / `read_float`
  (components.py), which refuse `٨`, `1_0`, `1e3` for an integer, `nan` and `inf` for a number.

The flags a user typed, by dest, are in `parser.given` after parsing ({"budget": "--max_capacity_prompts"}).
`output_file` is the type of a flag naming a file written at the end: checked before the work.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pyramidkv.components import read_float, read_int


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


def output_file(text: str) -> str:
    """An argparse type for a file the script writes when it is done: refused at once when its folder does
    not exist or cannot be written, or when it is a folder, not after the work."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file path")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: its folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written (permissions)")
    return text


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with the refusals of the module docstring; errors are one line."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.given: dict[str, str] = {}

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        for action in self._actions:          # every action, the ones added to groups included
            action.type = STRICT_TYPES.get(action.type, action.type)
        self.given = self._check_once(args)
        return super().parse_known_args(args, namespace)

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
