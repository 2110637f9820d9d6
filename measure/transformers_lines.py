"""The same model on both transformers lines (docs/transformers5.md): prefill and decode of fullkv, snapkv and kvzip
on SmolLM2-135M, thread CPU time, one torch thread, float32, sdpa.

    PYTHONPATH=. python measure/transformers_lines.py --lengths 4096 --steps 32 --rounds 2
        [--pinned_python .venv/bin/python --tf5_python .venv-tf5/bin/python]

The driver runs each round of each line as a process of that line's venv (.venv: the pinned 4.44.2; .venv-tf5:
5.x), the lines interleaved round by round, and prints per method the median seconds of each line and their ratio
(5.x / 4.44.2). `--child` is the one-line measuring process (what the driver runs): it prints one JSON line.
Prefill: the prompt's forward through the decoder (logits of the last position only) with the cache compressing;
decode: `--steps` greedy steps after it, one token a forward.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINES = {"4.44.2": ROOT / ".venv" / "bin" / "python", "5.x": ROOT / ".venv-tf5" / "bin" / "python"}
METHODS = {"fullkv": dict(name="fullkv"), "snapkv": dict(name="snapkv", budget_ratio=0.3),
           "kvzip": dict(name="kvzip", budget_ratio=0.3)}


def child(n: int, steps: int) -> None:
    import torch

    from pyramidkv import compress, load_model, make_method
    from pyramidkv.models.line import CACHE_ARGUMENT, VERSION
    from pyramidkv.benchmarks.measure import TEXT as STORY   # filler words (a measure script does not import tests)

    torch.set_num_threads(1)
    model, tokenizer = load_model(attn_implementation="sdpa", device="cpu")
    words = (STORY + " ") * (1 + 2 * n // max(1, len(STORY.split())))
    text = tokenizer.decode(tokenizer(words, add_special_tokens=False).input_ids[:n])
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    tokens = tokenizer(rendered, add_special_tokens=False).input_ids
    ids = torch.tensor([tokens])
    out = {"version": VERSION, "tokens": len(tokens)}
    with torch.no_grad():
        model.model(input_ids=ids[:, :64], use_cache=True)   # warm-up: the first forward's one-time costs
        for name, spec in METHODS.items():
            with compress(model, make_method(**spec)) as patch:
                cache = patch.new_cache([tokens], tokenizer)
                start = time.thread_time()
                hidden = model.model(input_ids=ids, use_cache=True, **{CACHE_ARGUMENT: cache}).last_hidden_state
                token = model.lm_head(hidden[:, -1]).argmax(-1, keepdim=True)
                prefill = time.thread_time() - start
                generated = []
                for step in range(steps):
                    position = torch.tensor([[len(tokens) + step]])
                    hidden = model.model(input_ids=token, position_ids=position, use_cache=True,
                                         **{CACHE_ARGUMENT: cache}).last_hidden_state
                    token = model.lm_head(hidden[:, -1]).argmax(-1, keepdim=True)
                    generated.append(int(token))
                out[name] = {"prefill": prefill, "decode": time.thread_time() - start - prefill,
                             "kv_bytes": cache.kv_bytes(), "tokens": generated}
    print(json.dumps(out))


def main() -> None:
    from pyramidkv.runner.arguments import ArgumentParser

    ap = ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--pinned_python", default=str(LINES["4.44.2"]), help="the pinned line's interpreter")
    ap.add_argument("--tf5_python", default=str(LINES["5.x"]), help="the 5.x line's interpreter")
    args = ap.parse_args()
    lines = {"4.44.2": args.pinned_python, "5.x": args.tf5_python}
    if args.child:
        child(args.lengths[0], args.steps)
        return
    for n in args.lengths:
        runs = {line: [] for line in lines}
        for _ in range(args.rounds):
            for line, python in lines.items():
                done = subprocess.run([str(python), __file__, "--child", "--lengths", str(n), "--steps",
                                       str(args.steps)], cwd=ROOT, capture_output=True, text=True,
                                      env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
                if done.returncode:
                    sys.exit(f"{line} failed: {done.stderr.strip().splitlines()[-1]}")
                runs[line].append(json.loads(done.stdout.strip().splitlines()[-1]))
        first = runs["4.44.2"][0]
        print(f"n = {first['tokens']} tokens ({n} context), {args.steps} decode steps, median of {args.rounds}; "
              f"versions {', '.join(r[0]['version'] for r in runs.values())}")
        print("| method | part | 4.44.2 (s) | 5.x (s) | 5.x / 4.44.2 | same tokens | same bytes |")
        print("|---|---|---|---|---|---|---|")
        for name in METHODS:
            for part in ("prefill", "decode"):
                old, new = (statistics.median(r[name][part] for r in runs[line]) for line in lines)
                same = runs["4.44.2"][0][name]["tokens"] == runs["5.x"][0][name]["tokens"]
                same_bytes = runs["4.44.2"][0][name]["kv_bytes"] == runs["5.x"][0][name]["kv_bytes"]
                print(f"| {name} | {part} | {old:.2f} | {new:.2f} | {new / old:.2f}x | {same} | {same_bytes} |")


if __name__ == "__main__":
    main()
