"""Batched greedy generation with a compression method: what the runners and the quickstart call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pyramidkv.methods.base import Method
from pyramidkv.models.patch import compress


@dataclass
class Generation:
    text: str
    prompt_tokens: int          # real (unpadded) prompt length
    new_tokens: int
    kv_bytes_per_prompt: int    # stored K/V bytes for this prompt after generation, all layers


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    method: Method,
    max_new_tokens: int,
    stop_token_ids: Optional[Sequence[int]] = None,
    min_new_tokens: int = 0,
) -> list[Generation]:
    """Greedy-decode a batch of prompts (strings, or token-id lists) under `method`.

    Prompts are left-padded into one batch; each prompt's output equals what it
    gives alone, and so does its `kv_bytes_per_prompt` (tokens decoded for the batch
    after a prompt has stopped are not counted). Strings are tokenized without special
    tokens: the caller applies any chat template (e.g. tokenizer.apply_chat_template).
    Decoding stops at `stop_token_ids`, by default the model's end-of-sequence tokens
    (`default_stop_token_ids`); pass an empty list to always decode max_new_tokens.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompts) == 0:
        return []
    texts = [isinstance(p, str) for p in prompts]
    if any(texts) and not all(texts):
        raise ValueError(f"prompts mix text (prompt {texts.index(True)}) and token ids (prompt {texts.index(False)}); "
                         f"give all as strings or all as token-id lists")
    if all(texts):
        token_lists = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    else:
        token_lists = [list(p) for p in prompts]
        bad = [i for i, t in enumerate(token_lists) if any(isinstance(x, (str, bytes, float)) for x in t)]
        if bad:
            raise ValueError(f"prompt {bad[0]} is neither text nor a list of token ids: {prompts[bad[0]]!r:.60}")
    if any(len(t) == 0 for t in token_lists):
        raise ValueError("empty prompt")
    for tokens in token_lists:
        method.check_prompt(len(tokens))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(t) for t in token_lists)
    input_ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(token_lists):
        input_ids[row, width - len(tokens):] = torch.tensor(tokens)
        attention_mask[row, width - len(tokens):] = 1
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

    eos = default_stop_token_ids(model, tokenizer) if stop_token_ids is None else [int(t) for t in stop_token_ids]
    with compress(model, method) as patch:
        cache = patch.new_cache()
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
            max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, do_sample=False, temperature=None,
            top_p=None, top_k=None, num_beams=1, eos_token_id=eos or None, pad_token_id=pad_id,
        )
    results = []
    stops = set(eos)
    for row, tokens in enumerate(token_lists):
        new = output[row, width:].tolist()
        cut = next((i for i, tok in enumerate(new) if tok in stops), len(new))
        text = tokenizer.decode(new[:cut], skip_special_tokens=True)
        # Tokens this prompt fed back into the cache: all it generated (its stop token included)
        # except the last one, which is sampled but never attended to.
        generated = min(cut + 1, len(new))
        results.append(Generation(text, len(tokens), cut, cache.kv_bytes(row, tail_tokens=max(0, generated - 1))))
    return results


def default_stop_token_ids(model, tokenizer) -> list[int]:
    """The model's end-of-sequence ids: its generation config's eos_token_id (int or list), then the tokenizer's."""
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.append(configured)
    elif configured:
        ids.extend(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))
