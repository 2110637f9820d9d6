"""Prefill time, per-token decode time and KV bytes per method, each also as a ratio to fullkv and to the
unpatched model (plain transformers, row "plain") measured in the same run.

    python measure/benchmark_latency_memory.py --context_length 4096 --max_capacity_prompts 256 \
        --methods fullkv snapkv pyramidkv h2o streamingllm l2norm [--attn_implementation sdpa] [--threads 1] [--out FILE.json]

A method may carry settings: `snapkv:merge=mergingpress`, `snapkv:merge=mergingpress,merge_fraction=0.5`,
`h2o:window_size=16`, `snapkv:quant_method=kivi,nbits=2` (comma-separated setting=value; the row is named
by the whole spec), so a method and its variants are measured side by side in one run.

Quantized storage (`quant_method=...`): each row also gets its KV bytes by part (`kv_bytes_breakdown`:
codes, scales, zeros, codebook, outliers, factors, positions, residual; an unquantized cache is all
residual), its KV bytes as a ratio to fullkv stored in fp16 (`kv_ratio_fp16`: the full-precision rows
counted at 2 bytes per value whatever the run's dtype; the quantized parts are fp16 / packed already),
for KIVI rows the same ratio from the formula (`formula_kv_ratio_fp16`: per stored head of k kept tokens,
q = G * floor((k - R) / G) quantized at nbits per value with an fp16 scale and zero per group, keys per
channel and values per token, k - q residual tokens in fp16), and the decode time as a ratio to the same
spec without its quantizer where that row is in the run (`decode_ratio_unquantized`).

Timing: `--clock wall` (default) times with time.perf_counter; `--clock cpu` with time.thread_time, the CPU time
of the calling thread, which on a machine shared with other jobs moves far less with their load than the wall clock
(use it with `--threads 1`: other threads' work is not counted; on CUDA it misses the device's time and is refused).
A warm-up round, then `--repeats` rounds that visit every method in turn (so drifting
machine load hits all alike); each round is one prefill and `--new_tokens` greedy decode steps
(median step, and the mean: compression during decoding makes some steps slower). Figures are
medians over rounds. On CUDA each row also gets its peak GPU memory (`peak_gpu_bytes`:
torch.cuda.max_memory_allocated over one prefill and its decode steps, the weights included). KV bytes are counted after prefill; peak prefill KV bytes are the cache's
`peak_prefill_kv_bytes` where it reports one, else its bytes after prefill; peak KV bytes are the
most stored at any moment of the whole run (prefill peak, after every decode step, and for
compression during decoding, e.g. `snapkv:decode_budget=512`, just before each re-selection). The
plain row decodes over transformers' DynamicCache (its bytes: the K/V tensors it holds).

Quest (`quest`, or `snapkv:page_budget=64`) evicts nothing: its KV bytes are what it holds (K/V + page
metadata, part "page_metadata"), and `read_bytes_per_step` is what decode attention read per step (mean
over the decode steps: the chosen pages' K/V + all page metadata in paged layers, everything held in the
others), also as a ratio to fullkv's. MiniCache rows (`minicache`) break their bytes into directions,
magnitudes, retained rows and indices.

Chunked prefill (docs/speed.md, "Chunked prefill"): `--prefill_chunk_sizes 512 1024` adds, for each method it is
defined for, a row `SPEC chunk=N` whose prompt is prefilled N tokens at a time (its prefill time includes its last
token's step); every row also gets `peak_in_flight_kv_bytes`: the most K/V held at once during prefill counting
the layer that is computing (its whole prompt, or its kept tokens + the chunk), which the stored-bytes peak leaves
out:

    python measure/benchmark_latency_memory.py --context_length 4096 --max_capacity_prompts 256 \
        --methods snapkv pyramidkv h2o --prefill_chunk_sizes 512 --new_tokens 8 --threads 1 --clock cpu

Compression during decoding (docs/decoding.md), 1024 new tokens:

    python measure/benchmark_latency_memory.py --context_length 1024 --max_capacity_prompts 512 \
        --methods fullkv snapkv snapkv:decode_budget=512 --new_tokens 1024 --repeats 1 --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Optional

import torch
from transformers import DynamicCache

from pyramidkv import DEFAULT_MODEL_NAME, METHODS, compress, load_model
from pyramidkv.benchmarks.measure import method_from_spec, prompt_ids, unquantized_spec
from pyramidkv.core.chunked import PrefillChunks
from pyramidkv.generation.chunked import prefill_in_chunks
from pyramidkv.methods.base import Method
from pyramidkv.models.loading import check_model
from pyramidkv.runner.arguments import ArgumentParser
from pyramidkv.runner.results import atomic_write_json

PLAIN = "plain"  # the unpatched model's row
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}   # --clock
# Parts of kv_bytes_breakdown stored in the model's dtype (the others are packed codes, fp16 scales, int64 indices).
MODEL_DTYPE_PARTS = {"residual", "page_metadata", "directions", "magnitudes", "retained"}
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for t in (*cache.key_cache, *cache.value_cache))


@torch.no_grad()
def measure_once(model, ids, method: Optional[Method], new_tokens: int, device: str, tokenizer=None,
                 clock=time.perf_counter, chunk: Optional[int] = None) -> dict:
    """One prefill and `new_tokens` greedy decode steps, patched with `method` (None: the unpatched model);
    returns the timings (read from `clock`) and the KV bytes (the prefill of a reconstructing method, KVzip,
    includes its repeat passes, built with `tokenizer`)."""
    patch = None if method is None else compress(model, method)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    try:
        cache = DynamicCache() if patch is None else patch.new_cache(ids.tolist(), tokenizer)
        in_flight = [0]
        if patch is not None:   # the stored bytes + the computing layer's whole K/V, at each layer's prefill
            whole = cache.prefill

            def counted(layer_idx, queries, keys, values, *args, **kwargs):
                held = cache.kv_bytes() + (0 if cache.prompt is None else cache.prompt.waiting_bytes())
                in_flight[0] = max(in_flight[0], held + keys.numel() * keys.element_size() * 2)
                return whole(layer_idx, queries, keys, values, *args, **kwargs)
            cache.prefill = counted
        sync(device)
        t0 = clock()
        if chunk is None:
            out = model(ids, past_key_values=cache, use_cache=True)
        else:   # the prompt but its last token in chunks, then that token's step
            prefill_in_chunks(model, cache, ids, chunk)
            last = torch.tensor([[ids.shape[1] - 1]], device=ids.device)
            out = model(ids[:, -1:], past_key_values=cache, use_cache=True, position_ids=last, cache_position=last[0])
        sync(device)
        prefill = clock() - t0
        stored = (lambda: dynamic_cache_bytes(cache)) if patch is None else cache.kv_bytes
        kv_bytes = stored()
        breakdown = cache.kv_bytes_breakdown() if hasattr(cache, "kv_bytes_breakdown") else {"residual": kv_bytes}
        formula = None if method is None else kivi_formula_bytes_fp16(cache, method, model.config)
        peak = getattr(cache, "peak_prefill_kv_bytes", None)
        peak_prefill = kv_bytes if peak is None else peak
        peak_all = peak_prefill
        decode_times, read = [], []
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(new_tokens):
            sync(device)
            t0 = clock()
            out = model(token, past_key_values=cache, use_cache=True)
            sync(device)
            decode_times.append(clock() - t0)
            token = out.logits[:, -1:].argmax(-1)
            peak_all = max(peak_all, stored())  # outside the timed region
            read.append(cache.decode_read_bytes() if patch is not None else stored())
        decoding = getattr(cache, "decoding", None)
        if decoding is not None:  # the instants just before each decode-time re-selection
            peak_all = max(peak_all, decoding.peak_kv_bytes)
        final = stored()
        per_layer = {} if patch is None else \
            {f"kept_layer_{layer}": sum(cache.kept_counts(layer)[0]) for layer in range(len(cache.layers))}
    finally:
        if patch is not None:
            patch.remove()
    element = next(model.parameters()).element_size()
    in_model_dtype = sum(size for part, size in breakdown.items() if part in MODEL_DTYPE_PARTS)
    fp16 = kv_bytes - in_model_dtype + in_model_dtype * 2 // element
    result = {"prefill_s": prefill, "decode_s_per_token": statistics.median(decode_times),
              "decode_s_per_token_mean": statistics.fmean(decode_times),
              "read_bytes_per_step": statistics.fmean(read),
              "kv_bytes_after_prefill": kv_bytes, "peak_prefill_kv_bytes": peak_prefill,
              "peak_in_flight_kv_bytes": max(in_flight[0], peak_prefill),
              "kv_bytes_final": final, "peak_kv_bytes": peak_all,
              "kv_bytes_fp16": fp16, **{f"kv_bytes_{part}": size for part, size in breakdown.items()}, **per_layer}
    if formula is not None:
        result["formula_kv_bytes_fp16"] = formula
    if device.startswith("cuda"):   # weights, cache and activations: the most allocated during this prefill + decode
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def kivi_formula_bytes_fp16(cache, method: Method, config) -> Optional[int]:
    """KIVI's stored bytes from the kept counts and the settings alone (residual in fp16); None for other rows."""
    quantizer = method.quant_method
    if quantizer is None or quantizer.name != "kivi":
        return None
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    g, r, bits = quantizer.group_size, quantizer.residual_length, quantizer.nbits
    total = 0
    for layer in range(config.num_hidden_layers):
        for k in cache.kept_counts(layer)[0]:
            q = g * (max(0, k - r) // g)
            total += 2 * q * dim * bits // 8 + (dim * q // g + q * dim // g) * 2 * 2 + (k - q) * dim * 2 * 2
    return total


def measure_all(model, ids, methods: dict, new_tokens: int, repeats: int, device: str, tokenizer=None,
                clock=time.perf_counter) -> dict:
    """methods: row name -> Method (None: unpatched) or (Method, prefill chunk size). Round-robin over the methods `repeats` times (after one warm-up round), so a change in machine
    load hits every method alike; the median of each figure per method."""
    samples = {name: [] for name in methods}
    for round_idx in range(repeats + 1):
        for name, method in methods.items():
            method, chunk = method if isinstance(method, tuple) else (method, None)
            result = measure_once(model, ids, method, new_tokens if round_idx else 1, device, tokenizer, clock, chunk)
            if round_idx:
                samples[name].append(result)
    return {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in samples.items()}


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--attn_implementation", default="sdpa", choices=["eager", "sdpa", "flash_attention_2"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--context_length", type=int, default=4096)
    parser.add_argument("--max_capacity_prompts", type=int, default=256)
    parser.add_argument("--methods", nargs="+", default=["fullkv", "snapkv", "pyramidkv", "h2o", "streamingllm", "l2norm"],
                        help=f"method specs NAME[:setting=value,...], NAME one of {', '.join(METHODS)}")
    parser.add_argument("--gqa_layout", default="kv_head", choices=["kv_head", "query_head"])
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                        help="wall: elapsed time (perf_counter); cpu: CPU time of this thread (thread_time), with "
                             "--threads 1 the figure a shared machine's load moves least")
    parser.add_argument("--prefill_chunk_sizes", type=int, nargs="+", default=[],
                        help="also each method prefilled in chunks of each of these sizes (rows `SPEC chunk=N`; "
                             "methods it is not defined for are left out, the reason printed)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON on stdout")
    args = parser.parse_args(argv)
    for flag in ("context_length", "new_tokens", "repeats", "max_capacity_prompts"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.clock == "cpu" and args.device.startswith("cuda"):
        parser.error("--clock cpu counts this thread's CPU time, not the device's: use --clock wall on CUDA")
    specs = ["fullkv"] + [m for m in args.methods if m != "fullkv"]
    try:
        built = {spec: method_from_spec(spec, args.max_capacity_prompts, args.gqa_layout) for spec in specs}
        for size in args.prefill_chunk_sizes:
            for spec in [s for s in specs if s != "fullkv"]:
                try:
                    PrefillChunks(size).check(built[spec])
                except ValueError as refused:
                    print(f"left out: {spec} chunk={size}: {refused}")
                    continue
                built[f"{spec} chunk={size}"] = (built[spec], size)
        check_model(args.model_path, args.attn_implementation, args.device, args.dtype)
    except (ValueError, OSError, ImportError) as error:
        parser.error(str(error))
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model_path, args.attn_implementation, args.device, args.dtype)
    device = str(next(model.parameters()).device)
    ids = prompt_ids(tokenizer, args.context_length).to(device)
    built = {PLAIN: None, **built}
    rows = measure_all(model, ids, built, args.new_tokens, args.repeats, device, tokenizer, CLOCKS[args.clock])
    add_ratios(rows)
    print(f"\nn = {args.context_length} tokens, budget {args.max_capacity_prompts}, {args.attn_implementation}, "
          f"{device}, {args.gqa_layout}, {args.new_tokens} new tokens, median of {args.repeats} interleaved rounds, "
          f"{torch.get_num_threads()} threads, {args.clock} clock\n")
    print("| method | prefill s | x plain | decode ms/token | x plain | x fullkv | mean ms/token | KV MiB | x fullkv | "
          "peak prefill KV MiB | x fullkv | peak KV MiB (whole run) | x fullkv | peak prefill KV MiB, layer in "
          "flight counted | x fullkv |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['prefill_s']:.3f} | {r['prefill_ratio_plain']:.3f} | {1000 * r['decode_s_per_token']:.1f} | "
              f"{r['decode_ratio_plain']:.3f} | {r['decode_ratio']:.3f} | {1000 * r['decode_s_per_token_mean']:.1f} | "
              f"{r['kv_bytes_after_prefill'] / 2**20:.2f} | {r['kv_ratio']:.4f} | "
              f"{r['peak_prefill_kv_bytes'] / 2**20:.2f} | {r['peak_prefill_kv_ratio']:.4f} | {r['peak_kv_bytes'] / 2**20:.2f} | {r['peak_kv_ratio']:.4f} | "
              f"{r['peak_in_flight_kv_bytes'] / 2**20:.2f} | {r['peak_in_flight_ratio']:.4f} |")
    if any("page" in name or "quest" in name or "minicache" in name or "cross_layer" in name for name in rows):
        print("\n| method | held KV MiB | x fullkv | of which page metadata MiB | read MiB / decode step | x fullkv | "
              "MiniCache directions + magnitudes + retained + indices MiB |")
        print("|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            merged = sum(r.get(f"kv_bytes_{p}", 0) for p in ("directions", "magnitudes", "retained", "indices"))
            print(f"| {name} | {r['kv_bytes_after_prefill'] / 2**20:.2f} | {r['kv_ratio']:.4f} | "
                  f"{r.get('kv_bytes_page_metadata', 0) / 2**20:.3f} | {r['read_bytes_per_step'] / 2**20:.2f} | "
                  f"{r['read_ratio']:.4f} | {merged / 2**20:.2f} |")
    if any("quant_method" in name for name in rows):
        print("\n| method | KV x fullkv fp16 | formula | decode x unquantized | codes MiB | scales+zeros MiB | "
              "outliers+factors+positions MiB | residual MiB |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            if name == PLAIN:
                continue
            formula = r.get("formula_kv_ratio_fp16")
            unquantized = r.get("decode_ratio_unquantized")
            extra = sum(r.get(f"kv_bytes_{p}", 0) for p in ("outliers", "factors", "positions", "codebook"))
            print(f"| {name} | {r['kv_ratio_fp16']:.4f} | {'-' if formula is None else f'{formula:.4f}'} | "
                  f"{'-' if unquantized is None else f'{unquantized:.3f}'} | {r.get('kv_bytes_codes', 0) / 2**20:.2f} | "
                  f"{(r.get('kv_bytes_scales', 0) + r.get('kv_bytes_zeros', 0)) / 2**20:.2f} | {extra / 2**20:.2f} | "
                  f"{r['kv_bytes_residual'] / 2**20:.2f} |")
    if any("peak_gpu_bytes" in r for r in rows.values()):
        print("\n| method | peak GPU MiB (torch.cuda.max_memory_allocated, weights included) |")
        print("|---|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['peak_gpu_bytes'] / 2**20:.0f} |")
    ragged = {name: [r[k] for k in sorted((k for k in r if k.startswith("kept_layer_")), key=lambda k: int(k[11:]))]
              for name, r in rows.items() if name != PLAIN}
    ragged = {name: counts for name, counts in ragged.items() if len(set(counts)) > 1}
    if ragged:   # head_allocation global (kvzip): each layer keeps what its scores earn
        print("\n| method | kept tokens per layer (all heads), layer 0 first |")
        print("|---|---|")
        for name, counts in ragged.items():
            print(f"| {name} | {' '.join(str(int(c)) for c in counts)} |")
    report = {"arguments": vars(args), "device": device, "platform": platform.platform(),
              "dtype": str(next(model.parameters()).dtype), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "results": rows}
    if args.out:
        atomic_write_json(args.out, report)
    if args.json:
        print(json.dumps(report, indent=1))


def add_ratios(rows: dict) -> None:
    """Each figure of each row as a ratio to fullkv (`*_ratio`) and to plain transformers (`*_ratio_plain`);
    KV bytes also against fullkv in fp16, decode time also against the row's spec without its quantizer."""
    figures = {"prefill": "prefill_s", "decode": "decode_s_per_token", "decode_mean": "decode_s_per_token_mean",
               "kv": "kv_bytes_after_prefill", "peak_prefill_kv": "peak_prefill_kv_bytes", "peak_kv": "peak_kv_bytes",
               "read": "read_bytes_per_step", "peak_in_flight": "peak_in_flight_kv_bytes"}
    for name, r in rows.items():
        for label, key in figures.items():
            r[f"{label}_ratio"] = r[key] / rows["fullkv"][key]
            r[f"{label}_ratio_plain"] = r[key] / rows[PLAIN][key]
        r["kv_ratio_fp16"] = r["kv_bytes_fp16"] / rows["fullkv"]["kv_bytes_fp16"]
        if "formula_kv_bytes_fp16" in r:
            r["formula_kv_ratio_fp16"] = r["formula_kv_bytes_fp16"] / rows["fullkv"]["kv_bytes_fp16"]
        base = unquantized_spec(name)
        if base != name and base in rows:
            r["decode_ratio_unquantized"] = r["decode_s_per_token"] / rows[base]["decode_s_per_token"]


if __name__ == "__main__":
    main()
