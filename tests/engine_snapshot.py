"""A fixed record of what the engine does, to prove a refactor changes nothing.

For a fixed set of configurations (every named method; snapkv with each allocator, merge rule and
quantizer; decode_budget; both GQA layouts; left-padded batches of 3) on the default model, record

  * right after the prefill (the first forward of `generate`): per layer and prompt, the kept positions and the stored K/V
    (dequantized where quantized) as read through the cache's public inspection API, kv_bytes per prompt;
  * after 16 greedy tokens: the tokens, the raw logits of every step, the held positions
    per layer, kv_bytes per prompt (and by part where quantized).

Floats are recorded as the SHA-256 of their bytes (bitwise equality) plus float64 summaries; integers
(positions, bytes, tokens) exactly. `python -m tests.engine_snapshot --write` records the reference
(tests/data/engine_snapshot.json); tests/test_engine_snapshot.py recomputes and compares.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
from pathlib import Path

import torch

REFERENCE = Path(__file__).parent / "data" / "engine_snapshot.json"
NEW_TOKENS = 16
KIVI_SMALL = dict(quant_method="kivi", nbits=2, group_size=8, residual_length=8)  # quantizes while decoding too

# name -> (method, settings, batch). batch: "one" (the long prompt) or "three" (long, middle, short).
CONFIGS: dict[str, tuple[str, dict, str]] = {
    **{m: (m, {} if m == "fullkv" else {"budget": 96}, "one") for m in (
        "fullkv", "streamingllm", "h2o", "snapkv", "pyramidkv", "l2norm", "adakv", "ada_pyramidkv", "headkv",
        "zigzagkv", "cam")},
    "snapkv+heads=adakv": ("snapkv", {"budget": 96, "head_allocation": "adakv"}, "one"),
    "snapkv+heads=headkv": ("snapkv", {"budget": 96, "head_allocation": "headkv"}, "one"),
    "snapkv+layers=pyramid": ("snapkv", {"budget": 96, "layer_allocation": "pyramid"}, "one"),
    "snapkv+layers=zigzag": ("snapkv", {"budget": 96, "layer_allocation": "zigzag"}, "one"),
    **{f"snapkv+merge={rule}": ("snapkv", {"budget": 96, "merge": rule}, "one")
       for rule in ("pivot", "weighted", "mergingpress", "cam")},
    "snapkv+kivi": ("snapkv", {"budget": 192, "quant_method": "kivi", "residual_length": 32}, "one"),
    "snapkv+kivi-small": ("snapkv", {"budget": 192, **KIVI_SMALL}, "one"),
    "snapkv+kvquant": ("snapkv", {"budget": 192, "quant_method": "kvquant"}, "one"),
    "snapkv+kvquant-nuq": ("snapkv", {"budget": 192, "quant_method": "kvquant", "datatype": "nuq"}, "one"),
    "snapkv+gear": ("snapkv", {"budget": 192, "quant_method": "gear"}, "one"),
    "adakv+kivi-small": ("adakv", {"budget": 192, **KIVI_SMALL}, "one"),
    "headkv+mergingpress+kivi-small": ("headkv", {"budget": 192, "merge": "mergingpress", **KIVI_SMALL}, "one"),
    "fullkv+kivi-small": ("fullkv", KIVI_SMALL, "one"),
    "snapkv+decode": ("snapkv", {"budget": 96, "decode_budget": 64, "decode_interval": 8}, "one"),
    "h2o+decode": ("h2o", {"budget": 96, "decode_budget": 64, "decode_interval": 8}, "one"),
    "streamingllm+decode": ("streamingllm", {"budget": 96, "decode_budget": 64, "decode_interval": 8}, "one"),
    "adakv+merge+decode": ("adakv", {"budget": 96, "merge": "mergingpress", "decode_budget": 64,
                                     "decode_interval": 8}, "one"),
    "snapkv+query_head": ("snapkv", {"budget": 96, "gqa_layout": "query_head"}, "one"),
    "h2o+query_head": ("h2o", {"budget": 96, "gqa_layout": "query_head"}, "one"),
    "batch:snapkv": ("snapkv", {"budget": 96}, "three"),
    "batch:adakv": ("adakv", {"budget": 96}, "three"),
    "batch:zigzagkv+merge=cam": ("zigzagkv", {"budget": 96, "merge": "cam"}, "three"),
    "batch:h2o+decode": ("h2o", {"budget": 96, "decode_budget": 64, "decode_interval": 8}, "three"),
    "batch:snapkv+kivi-small": ("snapkv", {"budget": 192, **KIVI_SMALL}, "three"),
    "batch:snapkv+kvquant": ("snapkv", {"budget": 192, "quant_method": "kvquant"}, "three"),
}
# Batch outputs of these configurations were batch-dependent before the engine redesign (fixed by design):
BATCH_DEPENDENT_BEFORE: set[str] = set()


def prompts(tokenizer) -> dict[str, list[list[int]]]:
    """Three chat prompts of different lengths (about 470, 300 and 80 tokens), as token ids."""
    story = ("Marta kept bees on the hill behind the old mill. Every spring she counted the hives and wrote the "
             "number in a blue notebook. The librarian, a patient man named Osei, kept a shelf of such notebooks: "
             "records of rainfall, of lambs born, of the day the river froze. ")
    fact = "The code word for the vault is {}. "

    def chat(body: str) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids

    long = chat(story * 4 + fact.format("amber falcon") + story * 4 + "What is the code word for the vault?")
    middle = chat(story * 3 + fact.format("silver otter") + story * 2 + "What is the code word?")
    short = chat(fact.format("green heron") + "What is the code word?")
    return {"one": [long], "three": [long, middle, short]}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:32]


def _summary(t: torch.Tensor) -> list[float]:
    x = t.detach().double()
    return [float(x.sum()), float(x.abs().sum())]


def _batch(token_lists: list[list[int]], pad_id: int):
    width = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(token_lists):
        ids[row, width - len(tokens):] = torch.tensor(tokens)
        mask[row, width - len(tokens):] = 1
    return ids, mask


def _kept_state(cache, batch: int) -> dict:
    layers = []
    for layer in range(cache.num_layers):
        per_prompt = []
        for b in range(batch):
            heads = cache.kept_kv(layer, b)
            positions = [p.tolist() for p, _, _ in heads]
            keys = torch.cat([k for _, k, _ in heads]) if heads else torch.zeros(0)
            values = torch.cat([v for _, _, v in heads]) if heads else torch.zeros(0)
            per_prompt.append({"positions": hashlib.sha256(json.dumps(positions).encode()).hexdigest()[:32],
                               "counts": [len(p) for p in positions],
                               "keys": _digest(keys), "values": _digest(values),
                               "keys_sum": _summary(keys), "values_sum": _summary(values)})
        layers.append(per_prompt)
    return {"layers": layers, "kv_bytes": [cache.kv_bytes(b) for b in range(batch)]}


def run_config(model, tokenizer, name: str) -> dict:
    from pyramidkv import make_method

    method_name, settings, which = CONFIGS[name]
    return record(model, tokenizer, make_method(method_name, **settings), prompts(tokenizer)[which])


def record(model, tokenizer, method, token_lists: list[list[int]], new_tokens: int = NEW_TOKENS) -> dict:
    """What `method` does with these prompts as one left-padded batch (see the module docstring)."""
    from pyramidkv import compress

    ids, mask = _batch(token_lists, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    result: dict = {}

    def after_prefill(module, args, output):  # the model's first forward in generate() is the prefill
        if "prefill" not in result:
            result["prefill"] = _kept_state(cache, len(token_lists))

    with compress(model, method) as patch, torch.no_grad():
        cache = patch.new_cache(token_lists, tokenizer)   # KVzip repeats each prompt
        hook = model.register_forward_hook(after_prefill)
        try:
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, num_beams=1,
                                 pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True,
                                 output_logits=True)
        finally:
            hook.remove()
    logits = torch.stack(out.logits, dim=1)  # [B, steps, V]
    batch = len(token_lists)
    result["tokens"] = out.sequences[:, ids.shape[1]:].tolist()
    result["logits"] = [[_digest(logits[b, s]) for s in range(logits.shape[1])] for b in range(batch)]
    result["logits_top"] = [[[round(float(v), 4) for v in logits[b, s].topk(3).values] for s in range(logits.shape[1])]
                            for b in range(batch)]
    held = []
    for layer in range(cache.num_layers):
        held.append([hashlib.sha256(json.dumps([p.tolist() for p in cache.held_positions(layer, b)]).encode())
                     .hexdigest()[:32] for b in range(batch)])
    result["held_positions"] = held
    result["kv_bytes_after"] = [cache.kv_bytes(b) for b in range(batch)]
    if method.quant_method is not None:
        result["kv_bytes_breakdown"] = [cache.kv_bytes_breakdown(b) for b in range(batch)]
    return result


def assert_batch_equals_alone(model, tokenizer, method, token_lists: list[list[int]], new_tokens: int) -> list[dict]:
    """A left-padded batch gives each prompt the predictions, kept sets, held tokens and bytes it gets alone.
    Returns the single-prompt records (for checks of their own)."""
    batch = record(model, tokenizer, method, token_lists, new_tokens)
    alones = []
    for b, prompt in enumerate(token_lists):
        alone = record(model, tokenizer, method, [prompt], new_tokens)
        assert batch["tokens"][b] == alone["tokens"][0], f"prompt {b}: predictions differ"
        for layer, (in_batch, by_itself) in enumerate(zip(batch["prefill"]["layers"], alone["prefill"]["layers"])):
            assert in_batch[b]["positions"] == by_itself[0]["positions"], f"prompt {b}, layer {layer}: kept sets"
            assert in_batch[b]["counts"] == by_itself[0]["counts"]
        assert [held[b] for held in batch["held_positions"]] == [held[0] for held in alone["held_positions"]]
        assert batch["prefill"]["kv_bytes"][b] == alone["prefill"]["kv_bytes"][0]
        assert batch["kv_bytes_after"][b] == alone["kv_bytes_after"][0]
        if "kv_bytes_breakdown" in alone:
            assert batch["kv_bytes_breakdown"][b] == alone["kv_bytes_breakdown"][0]
        alones.append(alone)
    return alones


def platform_key() -> str:
    """Where bitwise float equality can be expected: same torch build and CPU kernel capability."""
    return f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{platform.machine()}"


def load_default():
    from pyramidkv import load_model
    from pyramidkv.models.default_model import default_model_path

    return load_model(str(default_model_path()), attn_implementation="sdpa", device="cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the reference (tests/data/engine_snapshot.json)")
    parser.add_argument("--out", help="write the snapshot here instead")
    parser.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_default()
    names = args.only or list(CONFIGS)
    snapshot = {"platform": platform_key(), "configs": {n: run_config(model, tokenizer, n) for n in names}}
    target = REFERENCE if args.write else Path(args.out or "/tmp/engine_snapshot.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(snapshot, indent=None, separators=(",", ":")))
    print(f"wrote {len(names)} configurations to {target}")


if __name__ == "__main__":
    main()
