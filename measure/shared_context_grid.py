"""Compress once, ask many, measured: RULER with K questions per context, each method under `--shared_context
multi_request` next to the same questions each inside its own prompt (the same tokens), per-turn accuracy and
time to first token. Each cell is one run_ruler.py run (resumable: a rerun finishes what is missing).

    python measure/shared_context_grid.py --save_dir results/shared_grid --context_length 2048 \
        --questions_per_context 4 --num_samples 10 --budgets 128 256 \
        --tasks niah_multikey_1 kv_retrieval --methods fullkv snapkv pyramidkv adakv h2o streamingllm l2norm quest

Prints (and writes to {save_dir}/summary.md) one row per (method, budget, protocol): per task the score of
turn 1 and of turns 2..K, and the mean time to first token of turn 1 (prefill and compression included) and of
turns 2..K (the shared protocol's rollback and question only).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

from pyramidkv.benchmarks.ruler import run as ruler
from pyramidkv.methods import budget_flag_applies, get_method_class
from pyramidkv.runner.arguments import ArgumentParser

PROTOCOLS = ("own_prompt", "multi_request")


def cell_argv(args, method: str, budget, protocol: str) -> list[str]:
    argv = ["--model_path", args.model_path, "--method", method, "--tasks", *args.tasks, "--context_lengths",
            str(args.context_length), "--num_samples", str(args.num_samples), "--questions_per_context",
            str(args.questions_per_context), "--save_dir", args.save_dir, "--cache_dir", f"{args.save_dir}/data",
            "--num_threads", str(args.num_threads), "--device", "cpu"]
    if budget is not None:
        argv += ["--max_capacity_prompts", str(budget)]
    return argv + (["--shared_context", protocol] if protocol != "own_prompt" else [])


def run_folder(argv: list[str]) -> Path:
    """The folder a run_ruler.py command line writes to (its --print_run_dir)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ruler.main(argv + ["--print_run_dir"])
    return Path(out.getvalue().strip().splitlines()[-1])


def mean(values) -> float | None:
    values = list(values)
    return round(math.fsum(values) / len(values), 3) if values else None


def summarize(run_dir: Path, tasks: list[str], length: int, k: int) -> dict:
    results = json.loads((run_dir / "results.json").read_text())
    out = {}
    for task in tasks:
        key = f"{task}@{length}"
        rows = [json.loads(line) for line in (run_dir / f"{task}_{length}_q{k}.jsonl").read_text().splitlines()]
        turns = results.get("turn_scores", {}).get(key, {})
        out[task] = {"turn_1": turns.get("1"), "later_turns": turns.get(f"2-{k}"),
                     "ttft_turn_1": mean(r["time_to_first_token"] for r in rows if r["turn"] == 1
                                         and "time_to_first_token" in r),
                     "ttft_later": mean(r["time_to_first_token"] for r in rows if r["turn"] > 1
                                        and "time_to_first_token" in r)}
    return out


def main() -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_path", default="smollm2-135m")
    p.add_argument("--save_dir", required=True)
    p.add_argument("--context_length", type=int, default=2048)
    p.add_argument("--questions_per_context", type=int, default=4)
    p.add_argument("--num_samples", type=int, default=10)
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256])
    p.add_argument("--tasks", nargs="+", default=["niah_multikey_1", "kv_retrieval"])
    p.add_argument("--methods", nargs="+", default=["fullkv", "snapkv", "pyramidkv", "adakv", "h2o", "streamingllm",
                                                    "l2norm", "quest"])
    p.add_argument("--num_threads", type=int, default=1)
    p.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS),
                   help="own_prompt: each question inside its own prompt; multi_request: the context compressed once")
    args = p.parse_args()
    lines = ["| method | budget | protocol | " + " | ".join(f"{t} turn 1 | {t} turns 2-{args.questions_per_context}"
                                                          for t in args.tasks) + " | TTFT turn 1 s | TTFT later s |",
             "|---" * (5 + 2 * len(args.tasks)) + "|"]
    for method in args.methods:
        budgets = args.budgets if budget_flag_applies(get_method_class(method.split(":")[0])) else [None]
        for budget in budgets:
            for protocol in args.protocols:
                argv = cell_argv(args, method, budget, protocol)
                if ruler.main(argv) != 0:
                    raise SystemExit(f"cell failed: run_ruler.py {' '.join(argv)}")
                run_dir = run_folder(argv)
                cell = summarize(run_dir, args.tasks, args.context_length, args.questions_per_context)
                scores = " | ".join(f"{cell[t]['turn_1']} | {cell[t]['later_turns']}" for t in args.tasks)
                ttft = [cell[t][k] for t in args.tasks for k in ("ttft_turn_1", "ttft_later")]
                ttft1, ttft_later = mean(x for x in ttft[0::2] if x is not None), mean(x for x in ttft[1::2]
                                                                                       if x is not None)
                lines.append(f"| {method} | {budget or '-'} | {protocol} | {scores} | {ttft1 or '-'} | "
                             f"{ttft_later or '-'} |")
                print(lines[-1], flush=True)
    Path(args.save_dir, f"summary_{'_'.join(args.protocols)}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
