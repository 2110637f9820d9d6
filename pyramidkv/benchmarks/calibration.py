"""What the calibration scripts share (scripts/calibrate_qfilter.py, calibrate_triattention.py, calibrate_duo.py,
calibrate_kvzap.py, kvzip_head_scores.py): the flags naming the model and the essays, the essay tokens they read,
the one-line refusal before the weights load, and the provenance every artifact's record carries (the command,
threads, CPU and wall seconds, versions, git commit)."""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from pyramidkv.benchmarks.prompting import essay_dir
from pyramidkv.runner.arguments import ArgumentParser


def calibration_parser(prog: str, doc: str) -> ArgumentParser:
    """A script's parser with the flags every calibration takes: --model_path, --model_class, --haystack_dir."""
    from pyramidkv.models.default_model import DEFAULT_MODEL_NAME
    from pyramidkv.models.patch import MODEL_GLUE

    parser = ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--model_class", choices=list(MODEL_GLUE), default=None,
                        help="load the weights as this architecture (as the runners' --model_class)")
    parser.add_argument("--haystack_dir", default=None, help="folder of .txt files (default: the Paul Graham essays)")
    return parser


def add_device(parser: ArgumentParser, dtype: bool = True) -> None:
    """--device (and --dtype) for a script that runs where the user says."""
    parser.add_argument("--device", default="cpu")
    if dtype:
        parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])


def require_positive(parser: ArgumentParser, args: argparse.Namespace, names) -> None:
    """parser.error naming the first of `names` below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")


def default_artifact(args: argparse.Namespace, kind: str) -> Path:
    """--out, or "{model}_{kind}.safetensors" (model: the model path's last component, lowercased)."""
    return Path(args.out or f"{Path(str(args.model_path).rstrip('/')).name.lower()}_{kind}.safetensors")


def essay_folder(args: argparse.Namespace) -> Path:
    """--haystack_dir, or the packaged essays."""
    return Path(args.haystack_dir) if args.haystack_dir else essay_dir()


def essay_windows(tokenizer, folder: Path, count: int, length: int,
                  flags: tuple[str, str] = ("--num_texts", "--length")) -> tuple[list[list[int]], list[dict]]:
    """(`count` consecutive windows of `length` tokens, the files read: [{file, sha256}]): the .txt files of `folder`
    in name order, each followed by a blank line, tokenized without special tokens, read until enough; a ValueError
    naming the two flags that set count and length when they hold too few."""
    files = sorted(folder.glob("*.txt"))
    ids, sources, need = [], [], count * length
    for path in files:
        data = path.read_bytes()
        sources.append({"file": path.name, "sha256": hashlib.sha256(data).hexdigest()})
        ids += tokenizer(data.decode("utf-8") + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(f"the {len(files)} .txt files of {folder} hold {len(ids)} tokens, fewer than {flags[0]} "
                         f"{count} x {flags[1]} {length}; lower one of them")
    return [ids[i * length:(i + 1) * length] for i in range(count)], sources


@contextmanager
def refused_before_loading(prog: str, errors=(ValueError, OSError)):
    """Every check before the weights load: a failure is one line `prog: error: ...` and exit status 2."""
    try:
        yield
    except errors as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


class Clock:
    """The calibration's own CPU and wall seconds, from its construction."""

    def __init__(self):
        self.wall, self.cpu = time.time(), time.process_time()

    def seconds(self) -> dict:
        return {"cpu_seconds": round(time.process_time() - self.cpu, 1),
                "wall_seconds": round(time.time() - self.wall, 1)}


def provenance(clock: Clock, argv) -> dict:
    """The record's fields of how an artifact was made: seconds, threads, the command, versions, git commit."""
    import torch

    from pyramidkv.runner.results import _git_commit, _versions

    return {**clock.seconds(), "threads": torch.get_num_threads(),
            "command": [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])],
            "git_commit": _git_commit(), "versions": _versions(["torch", "transformers"])}
