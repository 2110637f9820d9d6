"""What the measuring scripts share (measure/benchmark_latency_memory.py, benchmark_paired_decode.py,
teacher_forced_nll.py, kvzip_prefill.py): a plain-text prompt of an exact length (or one user turn in the chat
template), and method specs with the script's budget."""

from __future__ import annotations

import torch

from pyramidkv.methods import METHODS, Method, parse_method_spec
from pyramidkv.methods.settings import AXES, resolve, split_spec

TEXT = ("Marta kept bees on the hill behind the old mill. Every spring she counted the hives, wrote the number "
        "in a blue notebook, and carried the notebook down to the village library. ")


def prompt_ids(tokenizer, n: int) -> torch.Tensor:
    """[1, n] token ids of TEXT repeated."""
    ids = tokenizer(TEXT * (n // 20 + 1), add_special_tokens=False).input_ids[:n]
    if len(ids) < n:
        raise ValueError(f"could not build a {n}-token prompt")
    return torch.tensor([ids])


def chat_prompt_ids(tokenizer, n: int) -> list[int]:
    """The token ids of one user turn of n tokens of TEXT in the tokenizer's chat template, generation prompt
    included (what KVzip's repeat passes reconstruct: the context between the template's prefix and suffix)."""
    text = tokenizer.decode(prompt_ids(tokenizer, n)[0])
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def method_from_spec(spec: str, budget: int, gqa_layout: str = "kv_head") -> Method:
    """NAME[:setting=value,...] -> the method, with the script's budget and GQA layout unless the spec sets them."""
    return parse_method_spec(spec, budget, gqa_layout=gqa_layout)


def unquantized_spec(spec: str) -> str:
    """The spec without its quantizer and the quantizer's settings: snapkv:quant_method=kivi,nbits=2 -> snapkv."""
    name, items = split_spec(spec)
    given = dict(items)
    if "quant_method" not in given or name not in METHODS:
        return spec
    cls = METHODS[name]
    chosen = {axis.field: (axis.registry.get(given[axis.field]) if axis.field in given else None) for axis in AXES}

    def of_the_quantizer(key: str) -> bool:
        axis, _ = resolve(cls, key, chosen)
        return key == "quant_method" or (axis is not None and axis.field == "quant_method")

    kept = [f"{k}={v}" for k, v in items if not of_the_quantizer(k)]
    return name + (":" + ",".join(kept) if kept else "")
