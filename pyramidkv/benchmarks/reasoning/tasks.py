"""The reasoning tasks: GSM8K and MATH-500 (first rows shipped in data/, see data/README.md) and `chain`, generated
from a seed: an arithmetic chain whose value is known after every step.

A problem is (its text for the prompt, its reference answer, the per-step values for `chain`); `prompt_text` puts the
instruction around it. The instruction asks for the answer in the form its grader reads (answers.py).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pyramidkv.benchmarks.reasoning.answers import gsm8k_answer

DATA = Path(__file__).resolve().parent / "data"
FILES = {"gsm8k": DATA / "gsm8k_test_first200.jsonl", "math500": DATA / "math500_test.jsonl"}
TASKS = ("chain", "gsm8k", "math500")
DEFAULT_TASKS = ("chain", "gsm8k")

GSM8K_INSTRUCTION = ("Solve the math problem step by step. End with a line '#### ' followed by the final number.\n\n"
                     "Question: ")
MATH_INSTRUCTION = "Solve the math problem step by step. Put the final answer in \\boxed{}.\n\nProblem: "
CHAIN_INSTRUCTION = ("Follow the steps in order. After each step write the value of x on its own line as "
                     "'Step N: x = VALUE'; after the last step write '#### VALUE'.\n\n"
                     "Example: Start with x = 2. Steps: 1. add 5; 2. multiply by 3.\n"
                     "Step 1: x = 7\nStep 2: x = 21\n#### 21\n\n")

# What opens the assistant's turn (the trace continues it; the grader reads it with the trace): the generated chain
# starts its first step line, which SmolLM2-135M otherwise skips.
ANSWER_PREFIX = {"chain": "Step 1: x =", "gsm8k": "", "math500": ""}


@dataclass
class Problem:
    index: int
    text: str                     # the problem as the prompt shows it (without the instruction)
    answer: str                   # the reference answer (GSM8K: the number after ####; MATH: its answer field)
    steps: list[int] = field(default_factory=list)   # chain: x after each step


def chain_problem(index: int, steps: int, seed: int) -> Problem:
    """Chain `index` of a seed: x starts in 2..20; each step adds or subtracts 1..9 (x stays >= 0) or multiplies by 2
    or 3 (x stays <= 500). The same (index, steps, seed) gives the same problem on every machine."""
    rng = random.Random(seed * 1_000_003 + index)
    x = rng.randint(2, 20)
    start, ops, values = x, [], []
    for _ in range(steps):
        choices = ["add"] + (["subtract"] if x >= 1 else []) + (["multiply"] if x * 2 <= 500 else [])
        op = rng.choice(choices)
        if op == "multiply":
            k = rng.choice([m for m in (2, 3) if x * m <= 500])
            x, words = x * k, f"multiply by {k}"
        elif op == "subtract":
            k = rng.randint(1, min(9, x))
            x, words = x - k, f"subtract {k}"
        else:
            k = rng.randint(1, 9)
            x, words = x + k, f"add {k}"
        ops.append(words)
        values.append(x)
    text = f"Start with x = {start}. Steps: " + "; ".join(f"{i}. {op}" for i, op in enumerate(ops, 1)) + "."
    return Problem(index, text, str(values[-1]), values)


def read_rows(path: Path, task: str, count: int) -> list[Problem]:
    """The first `count` problems of a GSM8K (question, answer with ####) or MATH (problem, answer) JSONL file;
    ValueError naming the row for one without its question or answer, or for fewer rows than asked."""
    question, answer = ("question", "answer") if task == "gsm8k" else ("problem", "answer")
    problems = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if len(problems) == count:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number} is not JSON ({e.msg})") from None
            for name in (question, answer):
                if not isinstance(row, dict) or not isinstance(row.get(name), str) or not row[name].strip():
                    raise ValueError(f"{path} line {number} has no {name!r} text: a {task} row needs {question!r} "
                                     f"and {answer!r} (the reference the score needs)")
            reference = gsm8k_answer(row[answer]) if task == "gsm8k" else row[answer]
            if reference is None:
                raise ValueError(f"{path} line {number}: its answer has no '#### <number>' line (GSM8K's reference)")
            problems.append(Problem(len(problems), row[question], reference))
    if len(problems) < count:
        raise ValueError(f"--num_samples {count}: {path} holds {len(problems)} {task} rows; use at most "
                         f"{len(problems)}")
    return problems


def problems(task: str, count: int, chain_steps: int, chain_seed: int,
             data_file: Optional[str] = None) -> list[Problem]:
    if task == "chain":
        return [chain_problem(i, chain_steps, chain_seed) for i in range(count)]
    return read_rows(Path(data_file).expanduser() if data_file else FILES[task], task, count)


def prompt_text(task: str, problem: Problem, frame: tuple[str, str]) -> str:
    """The whole prompt: the chat frame (before, after) around the instruction and the problem, then the task's
    answer prefix."""
    instruction = {"chain": CHAIN_INSTRUCTION, "gsm8k": GSM8K_INSTRUCTION, "math500": MATH_INSTRUCTION}[task]
    return f"{frame[0]}{instruction}{problem.text}{frame[1]}{ANSWER_PREFIX[task]}"
