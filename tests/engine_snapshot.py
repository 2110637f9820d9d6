"""A fixed record of what the engine does, to prove a refactor changes nothing.

For a fixed set of configurations (every named method; snapkv with each allocator, merge rule and
quantizer; decode_budget; both GQA layouts; left-padded batches of 3) on the default model, record

  * right after the prefill (the first forward of `generate`): per layer and prompt, the kept positions and the stored K/V
    (dequantized where quantized) as read through the cache's public inspection API, kv_bytes per prompt;
  * after 16 greedy tokens: the tokens, the top-3 logits of every step, the held positions
    per layer, kv_bytes per prompt (and by part where quantized);
  * every selection the method made (tests/near_ties.py: kind, layer, prompt, head, how many it kept by rank,
    the candidates and the kept positions), so that a run on another CPU can tell a near-tie from a change.

Integers (positions, counts, bytes, tokens) are recorded exactly, position sets as hex bit masks; floats as
float64 summaries (a sum and an absolute sum) and rounded top logits, compared with the tolerances of
tests/test_engine_snapshot.py: never bitwise, which holds only on the CPU kernels the record was made with.
`python -m tests.engine_snapshot --write` records the reference (tests/data/engine_snapshot.json);
tests/test_engine_snapshot.py recomputes and compares.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from pyramidkv.models.line import CACHE_ARGUMENT
from tests.near_ties import DecisionLog, Disagreement, NearTie, from_mask, near_ties, report, to_mask

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
            keys = torch.cat([k for _, k, _ in heads]) if heads else torch.zeros(0)
            values = torch.cat([v for _, _, v in heads]) if heads else torch.zeros(0)
            per_prompt.append({"positions": [to_mask(p.tolist()) for p, _, _ in heads],
                               "counts": [len(p) for p, _, _ in heads],
                               "keys_sum": _summary(keys), "values_sum": _summary(values)})
        layers.append(per_prompt)
    return {"layers": layers, "kv_bytes": [cache.kv_bytes(b) for b in range(batch)]}


def run_config(model, tokenizer, name: str) -> dict:
    from pyramidkv import make_method

    method_name, settings, which = CONFIGS[name]
    return record(model, tokenizer, make_method(method_name, **settings), prompts(tokenizer)[which])


def record(model, tokenizer, method, token_lists: list[list[int]], new_tokens: int = NEW_TOKENS) -> dict:
    """What `method` does with these prompts as one left-padded batch (see the module docstring). "logits" is
    the [B, steps, V] tensor itself, for comparisons in one process; the record file keeps "logits_top"."""
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
            out = model.generate(input_ids=ids, attention_mask=mask, **{CACHE_ARGUMENT: cache},
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, num_beams=1,
                                 pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True,
                                 output_logits=True)
        finally:
            hook.remove()
    logits = torch.stack(out.logits, dim=1)  # [B, steps, V]
    batch = len(token_lists)
    result["tokens"] = out.sequences[:, ids.shape[1]:].tolist()
    result["logits"] = logits
    result["logits_top"] = [[[round(float(v), 4) for v in logits[b, s].topk(3).values] for s in range(logits.shape[1])]
                            for b in range(batch)]
    result["held_positions"] = [[[to_mask(p.tolist()) for p in cache.held_positions(layer, b)] for b in range(batch)]
                                for layer in range(cache.num_layers)]
    result["kv_bytes_after"] = [cache.kv_bytes(b) for b in range(batch)]
    if method.quant_method is not None:
        result["kv_bytes_breakdown"] = [cache.kv_bytes_breakdown(b) for b in range(batch)]
    return result


def assert_same_run(got: dict, expected: dict, rtol: float = 1e-5, same_bytes: bool = True) -> None:
    """Two records of one prompt set by two code paths meant to compute the same: integers (tokens, kept and held
    positions, counts, and bytes unless `same_bytes` is False) equal, floats (stored K/V sums, logits) to `rtol`
    (another path may round otherwise)."""
    assert got["tokens"] == expected["tokens"]
    assert got["held_positions"] == expected["held_positions"]
    if same_bytes:
        assert got["kv_bytes_after"] == expected["kv_bytes_after"]
        assert got.get("kv_bytes_breakdown") == expected.get("kv_bytes_breakdown")
        assert got["prefill"]["kv_bytes"] == expected["prefill"]["kv_bytes"]
    for ours, theirs in zip(got["prefill"]["layers"], expected["prefill"]["layers"], strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert (a["positions"], a["counts"]) == (b["positions"], b["counts"])
            torch.testing.assert_close(torch.tensor(a["keys_sum"] + a["values_sum"], dtype=torch.float64),
                                       torch.tensor(b["keys_sum"] + b["values_sum"], dtype=torch.float64),
                                       rtol=rtol, atol=rtol)
    torch.testing.assert_close(got["logits"], expected["logits"], rtol=rtol, atol=rtol)


def differs_only_where(got: list[str], expected: list[str], ties: list[NearTie], kind: str, layer: int) -> bool:
    """Per head, kept positions (hex masks) equal, or differing only in positions a near-tie of that head at
    that layer leaves to rounding."""
    for head, (a, b) in enumerate(zip(got, expected)):
        if a == b:
            continue
        allowed = set().union(*(t.differing for t in ties if (t.decision.kind, t.decision.layer, t.decision.head)
                                == (kind, layer, head)))
        if not from_mask(a) ^ from_mask(b) <= allowed:
            return False
    return len(got) == len(expected)


def assert_batch_equals_alone(model, tokenizer, method, token_lists: list[list[int]], new_tokens: int,
                              request=None) -> list[dict]:
    """A left-padded batch gives each prompt the predictions, kept sets, held tokens and bytes it gets alone,
    up to near-ties (tests/near_ties.py): a selection that differs only where the two runs' scores are within
    float32 resolution of the cut is counted (reported through `request`), and what depends on it after it
    (the prompt's decoding) is not compared. Returns the single-prompt records (for checks of their own)."""
    with DecisionLog() as batch_log:
        batch = record(model, tokenizer, method, token_lists, new_tokens)
    alones = []
    for b, prompt in enumerate(token_lists):
        with DecisionLog() as alone_log:
            alone = record(model, tokenizer, method, [prompt], new_tokens)
        try:
            ties = near_ties(batch_log.of(b), alone_log.of(0))
        except Disagreement as error:
            raise AssertionError(f"prompt {b}: the batch decides otherwise than the prompt alone: {error}") from None
        for layer, (in_batch, by_itself) in enumerate(zip(batch["prefill"]["layers"], alone["prefill"]["layers"])):
            assert differs_only_where(in_batch[b]["positions"], by_itself[0]["positions"], ties, "prefill", layer), \
                f"prompt {b}, layer {layer}: kept sets"
            assert in_batch[b]["counts"] == by_itself[0]["counts"]
        assert batch["prefill"]["kv_bytes"][b] == alone["prefill"]["kv_bytes"][0]
        if ties:
            for tie in ties:
                if request is not None:
                    report(request, f"prompt {b}: {tie}")
            alones.append(alone)
            continue
        assert batch["tokens"][b] == alone["tokens"][0], f"prompt {b}: predictions differ"
        assert [held[b] for held in batch["held_positions"]] == [held[0] for held in alone["held_positions"]], \
            f"prompt {b}: held positions after decoding differ, with no selection that differs"
        assert batch["kv_bytes_after"][b] == alone["kv_bytes_after"][0]
        if "kv_bytes_breakdown" in alone:
            assert batch["kv_bytes_breakdown"][b] == alone["kv_bytes_breakdown"][0]
        alones.append(alone)
    return alones


def platform_key() -> str:
    """Where the record was made (for the reader: nothing is compared bitwise)."""
    return f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{platform.machine()}"


def snapshot_entry(model, tokenizer, name: str) -> tuple[dict, list]:
    """(the configuration's record as the file keeps it, its decisions as tests/near_ties.Decision objects)."""
    with DecisionLog() as log:
        entry = run_config(model, tokenizer, name)
    del entry["logits"]
    entry["decisions"] = [d.row() for d in log.decisions]
    return entry, log.decisions


def load_default():
    from pyramidkv import load_model
    from pyramidkv.models.default_model import default_model_path

    return load_model(str(default_model_path()), attn_implementation="sdpa", device="cpu")


def deviations(got: dict, expected: dict) -> dict:
    """The largest differences of two snapshot files' float quantities, over the configurations both hold:
    K/V sums (relative, kept sets with equal positions), top-3 logits (absolute, steps up to the first token that
    differs), and the counts of differing tokens, kept and held sets and decisions (for choosing the tolerances of
    tests/test_engine_snapshot.py: run the configurations under each kernel setting with --out, then --compare)."""
    worst = {"kv_sum_rel": 0.0, "logits_top_abs": 0.0, "tokens_differing": 0, "kept_sets_differing": 0,
             "held_sets_differing": 0, "decisions_differing": 0}
    for name in set(got["configs"]) & set(expected["configs"]):
        a, b = got["configs"][name], expected["configs"][name]
        for la, lb in zip(a["prefill"]["layers"], b["prefill"]["layers"]):
            for x, y in zip(la, lb):
                if x["positions"] != y["positions"]:
                    worst["kept_sets_differing"] += 1
                    continue
                for u, v in zip(x["keys_sum"] + x["values_sum"], y["keys_sum"] + y["values_sum"]):
                    worst["kv_sum_rel"] = max(worst["kv_sum_rel"], abs(u - v) / max(abs(v), 1e-3))
        for row, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
            for step, (u, v) in enumerate(zip(ta, tb)):
                if u != v:
                    worst["tokens_differing"] += 1
                    break
                worst["logits_top_abs"] = max(worst["logits_top_abs"], *(abs(p - q) for p, q in zip(
                    a["logits_top"][row][step], b["logits_top"][row][step])))
        worst["held_sets_differing"] += sum(x != y for la, lb in zip(a["held_positions"], b["held_positions"])
                                            for x, y in zip(la, lb))
        worst["decisions_differing"] += sum(x != y for x, y in zip(a["decisions"], b["decisions"]))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the reference (tests/data/engine_snapshot.json)")
    parser.add_argument("--out", help="write the snapshot here instead")
    parser.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print the largest differences of two "
                        "snapshot files and exit")
    args = parser.parse_args()
    if args.compare:
        first, second = (json.loads(Path(p).read_text(encoding="utf-8")) for p in args.compare)
        print(json.dumps(deviations(first, second), indent=1))
        return
    torch.set_num_threads(1)
    model, tokenizer = load_default()
    names = args.only or list(CONFIGS)
    snapshot = {"platform": platform_key(), "configs": {n: snapshot_entry(model, tokenizer, n)[0] for n in names}}
    target = REFERENCE if args.write else Path(args.out or "/tmp/engine_snapshot.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(snapshot, indent=None, separators=(",", ":")))
    print(f"wrote {len(names)} configurations to {target}")


if __name__ == "__main__":
    main()
