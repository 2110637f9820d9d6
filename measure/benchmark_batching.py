"""Samples per minute of the RULER runner's generation path at several batch sizes, side by side, with the
time split by phase, and a check that every batch size predicts the same.

    python measure/benchmark_batching.py --batch_sizes 1 4 --repeats 3 -- \
        --method snapkv --max_capacity_prompts 128 --tasks niah_single_1 --context_lengths 2048 \
        --num_samples 8 --num_threads 2 --save_dir /tmp/ruler_bench

Everything after `--` is run_ruler.py's command line (`--decode_threads 1` runs the decode steps on one
thread, the prompt's forward on --num_threads): the samples are the runner's (same generator, cache,
chat template and tokenisation), batched by the runner's `batches` and decoded by its `decode_batch`;
nothing is written but the generated samples cache. Each repeat takes the samples one batch of the largest
size at a time and runs that batch at every size in turn (the order alternating from batch to batch), so a
burst of load from the machine's other work, which comes and goes within minutes, hits the sizes alike; the
model loads once.

Phases, summed over a pass (all samples at one batch size):
  tokenise      the runner's tokenisation of every sample (once per repeat, outside the samples/min)
  prefill       the prompt's forward through the model, compression excluded
  compression   the cache's prefill step: scoring, selection, gathering the kept tokens
  decode        the forwards of the decode steps (cache append and attention included)
  overhead      the rest of generate(): tokens in and out, transformers' generation loop, Python
Reported per batch size: samples/min (median and range over repeats), its ratio to the first batch size
per repeat (median and range), and the median seconds of each phase per sample.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from pyramidkv.runner.arguments import ArgumentParser


class PhaseClock:
    """Seconds spent in the prompt forward, in the cache's prefill step and in the decode forwards of `model`."""

    def __init__(self, model):
        self.model = model
        self.seconds = {"prefill": 0.0, "compression": 0.0, "decode": 0.0}
        self.decode_steps = 0

    @contextmanager
    def running(self):
        from pyramidkv.core.cache import CompressedCache

        started: list[float] = []

        def before(module, args, kwargs):
            started.append(time.perf_counter())

        def after(module, args, kwargs, output):
            ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
            phase = "prefill" if ids.shape[1] > 1 else "decode"
            self.seconds[phase] += time.perf_counter() - started.pop()
            self.decode_steps += phase == "decode"

        cache_prefill = CompressedCache.prefill

        def timed_prefill(cache, *args, **kwargs):
            start = time.perf_counter()
            try:
                return cache_prefill(cache, *args, **kwargs)
            finally:
                self.seconds["compression"] += time.perf_counter() - start

        hooks = [self.model.register_forward_pre_hook(before, with_kwargs=True),
                 self.model.register_forward_hook(after, with_kwargs=True)]
        CompressedCache.prefill = timed_prefill   # the compression step has no hook of its own
        try:
            yield self
        finally:
            CompressedCache.prefill = cache_prefill
            for hook in hooks:
                hook.remove()


def run_samples(model, tokenizer, method, sample_file, samples, batch_size: int, benchmark, run: argparse.Namespace):
    """Some samples of one file at one batch size, batched as the runner batches: (seconds, phase seconds,
    decode steps, {(file, key): prediction})."""
    from pyramidkv.runner.protocol import batches, decode_batch

    clock = PhaseClock(model)
    predictions = {}
    stops = benchmark.stop_token_ids(model.generation_config, tokenizer, sample_file)
    start = time.perf_counter()
    with clock.running():
        for batch in batches(samples, batch_size, benchmark.batch_by_length):
            outputs = decode_batch(model, tokenizer, method, batch, stops, sample_file.min_new_tokens,
                                   run.question_as_decode, run.decode_threads)
            for sample, output in zip(batch, outputs):
                predictions[(sample_file.name, sample.key)] = output.text
    seconds = time.perf_counter() - start
    phases = dict(clock.seconds)
    phases["prefill"] -= phases["compression"]   # the cache's prefill step runs inside the prompt forward
    phases["overhead"] = seconds - clock.seconds["prefill"] - clock.seconds["decode"]
    return seconds, phases, clock.decode_steps, predictions


def tokenise_seconds(tokenizer, benchmark) -> float:
    start = time.perf_counter()
    for sample_set in benchmark.sets:
        for row in sample_set.rows:
            tokenizer(row["input"], add_special_tokens=False)
    return time.perf_counter() - start


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv[:cut])

    from transformers import AutoTokenizer

    from pyramidkv.benchmarks.ruler.run import Ruler, build_parser
    from pyramidkv.models.loading import load_model
    from pyramidkv.runner.cli import apply_num_threads, check_run_args
    from pyramidkv.runner.method_args import check_model_args, method_from_args

    benchmark = Ruler()
    runner_parser = build_parser()
    run = runner_parser.parse_args(argv[cut + 1:])
    check_run_args(runner_parser, run)
    benchmark.check_arguments(run)
    method = method_from_args(run, runner_parser)
    model_dir, config = check_model_args(run, method)[:2]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    files = benchmark.prepare(run, tokenizer, config, None)
    apply_num_threads(run)
    model, tokenizer = load_model(run.model_path, attn_implementation=run.attn_implementation, device=run.device,
                                  dtype=run.dtype, model_class=run.model_class)
    count = sum(len(f.samples) for f in files)
    print(f"{count} samples ({', '.join(f.name for f in files)}), {method.label()}, batch sizes {args.batch_sizes}, "
          f"{args.repeats} repeats, {torch.get_num_threads()} threads, decode threads "
          f"{run.decode_threads or torch.get_num_threads()}", flush=True)

    from pyramidkv.runner.protocol import batches

    largest = max(args.batch_sizes)
    rates = {size: [] for size in args.batch_sizes}
    phases = {size: [] for size in args.batch_sizes}
    steps = {size: 0 for size in args.batch_sizes}
    reference, differing = None, []
    tokenise = []
    with torch.no_grad():
        for repeat in range(args.repeats):
            tokenise.append(tokenise_seconds(tokenizer, benchmark))
            seconds = {size: 0.0 for size in args.batch_sizes}
            split = {size: dict.fromkeys(("prefill", "compression", "decode", "overhead"), 0.0)
                     for size in args.batch_sizes}
            steps = {size: 0 for size in args.batch_sizes}
            predictions = {size: {} for size in args.batch_sizes}
            turn = 0
            for sample_file in files:
                # One batch of the largest size at a time, run at every size in turn (the order alternating).
                for chunk in batches(sample_file.samples, largest, benchmark.batch_by_length):
                    order = args.batch_sizes if turn % 2 == 0 else args.batch_sizes[::-1]
                    turn += 1
                    for size in order:
                        took, parts, decode_steps, texts = run_samples(model, tokenizer, method, sample_file, chunk,
                                                                       size, benchmark, run)
                        seconds[size] += took
                        steps[size] += decode_steps
                        predictions[size].update(texts)
                        for phase, value in parts.items():
                            split[size][phase] += value
            for size in args.batch_sizes:
                rates[size].append(60 * count / seconds[size])
                phases[size].append(split[size])
                reference = reference or predictions[size]
                differing += [(size, key) for key, text in predictions[size].items() if text != reference[key]]
                print(f"repeat {repeat + 1}, batch {size}: {seconds[size]:7.1f} s, {rates[size][-1]:6.2f} samples/min"
                      "  " + "  ".join(f"{phase} {value:6.1f}" for phase, value in split[size].items()), flush=True)

    first = args.batch_sizes[0]
    print(f"\ntokenise: {statistics.median(tokenise) / count * 1e3:.1f} ms per sample (outside samples/min)")
    print(f"{'batch':>5} {'samples/min':>12} {'range':>15} {'ratio':>6} {'ratio range':>13}   "
          f"seconds per sample: prefill  compression  decode  overhead   decode steps per pass")
    for size in args.batch_sizes:
        ratios = [rate / base for rate, base in zip(rates[size], rates[first])]
        per_sample = {phase: statistics.median(split[phase] for split in phases[size]) / count
                      for phase in phases[size][0]}
        print(f"{size:>5} {statistics.median(rates[size]):>12.2f} {min(rates[size]):>7.2f}-{max(rates[size]):<7.2f}"
              f"{statistics.median(ratios):>6.2f} {min(ratios):>6.2f}-{max(ratios):<6.2f}   "
              f"{per_sample['prefill']:>26.2f} {per_sample['compression']:>12.2f} {per_sample['decode']:>7.2f} "
              f"{per_sample['overhead']:>9.2f} {steps[size]:>14}")
    if differing:
        print(f"\npredictions differ from batch {first}'s first pass: {sorted(set(differing))}")
        return 1
    print(f"\npredictions identical at every batch size and repeat ({count} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
