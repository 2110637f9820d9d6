"""Generate RULER samples only (no model run):

    python -m pyramidkv.benchmarks.ruler --tasks all --context_lengths 4096 8192 --num_samples 100 \
        --cache_dir data/ruler [--model_path smollm2-135m] [--questions_per_context K]

writes {cache_dir}/{model}/{task}_{length}.jsonl (RULER format; K > 1: {task}_{length}_q{K}.jsonl), the files
run_ruler.py reads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from pyramidkv.runner.arguments import ArgumentParser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from pyramidkv.benchmarks.ruler.run import resolve_tasks
    from pyramidkv.benchmarks.ruler.tasks import DEFAULT_TASKS
    from pyramidkv.models.default_model import DEFAULT_MODEL_NAME

    parser = ArgumentParser(prog="python -m pyramidkv.benchmarks.ruler", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME, help="whose tokenizer sizes the samples")
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS))
    parser.add_argument("--context_lengths", nargs="+", type=int, default=[4096])
    parser.add_argument("--num_samples", type=int, default=25)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--cache_dir", default="results/ruler/data")
    parser.add_argument("--squad_file", default=None)
    parser.add_argument("--hotpot_file", default=None)
    parser.add_argument("--no_chat_template", action="store_true")
    parser.add_argument("--system_prompt", default=None, metavar="TEXT",
                        help="a system turn before the task (default: none, as RULER); needs the chat template")
    parser.add_argument("--questions_per_context", type=int, default=1, metavar="K",
                        help="questions about each context (default 1; docs/ruler.md lists the tasks that pose more)")
    args = parser.parse_args(argv)
    try:
        from transformers import AutoTokenizer

        from pyramidkv.benchmarks.ruler.generate import PromptFormatter, cache_paths, load_or_generate
        from pyramidkv.benchmarks.ruler.tasks import check_questions_per_context
        from pyramidkv.models.loading import resolve_model_path
        from pyramidkv.runner.labels import model_label

        tasks = resolve_tasks(args.tasks)
        if args.num_samples < 1 or any(n < 1 for n in args.context_lengths):
            raise ValueError("--num_samples and --context_lengths must be positive")
        for task in tasks:
            check_questions_per_context(task, args.questions_per_context)
        formatter = PromptFormatter(AutoTokenizer.from_pretrained(resolve_model_path(args.model_path)),
                                    use_chat_template=not args.no_chat_template,
                                    system_prompt=args.system_prompt)
        model = model_label(args.model_path)
        for task in tasks:
            for length in args.context_lengths:
                rows = load_or_generate(task, length, args.num_samples, formatter, Path(args.cache_dir), model,
                                        args.seed, args.squad_file, args.hotpot_file, args.questions_per_context)
                path, _ = cache_paths(Path(args.cache_dir), model, task, length, args.questions_per_context)
                lengths = [r["length"] for r in rows]
                print(f"{path}: {len(rows)} samples, length {min(lengths)}..{max(lengths)} (target {length})")
    except (FileNotFoundError, ValueError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
