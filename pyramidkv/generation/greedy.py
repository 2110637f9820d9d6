"""Batched greedy generation with a compression method: what the runners and the quickstart call.

Two protocols: the whole prompt is prefilled (compression sees the question, SnapKV's setting), or, with
`questions`, only the context is prefilled and the question is then appended to the compressed cache before the
answer is generated (Quest's protocol: the question is seen by decode-time selection only), in one forward where
the batch's questions share a length (`feed_together`): every decode-time unit decides as if its tokens came one
per decode step.
"""

from __future__ import annotations

import operator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from pyramidkv.core.chunked import PrefillChunks
from pyramidkv.generation.chunked import prefill_in_chunks
from pyramidkv.methods.base import Method
from pyramidkv.models.line import CACHE_ARGUMENT
from pyramidkv.models.patch import compress
from pyramidkv.sizing.blocks import BLOCK_SIZES, freeable_share


@dataclass
class Generation:
    text: str
    prompt_tokens: int          # real (unpadded) prompt length (context + question when fed as decode steps)
    new_tokens: int
    kv_bytes_per_prompt: int    # stored K/V bytes for this prompt after generation, all layers
    # Where the budget is an outcome (threshold eviction): per layer and stored head the tokens held when
    # the prompt stopped, and how many it had seen then (prompt + fed tokens); None otherwise.
    held_tokens: Optional[list[list[int]]] = None
    seen_tokens: Optional[int] = None
    # Every method: per block size (sizing/blocks.py BLOCK_SIZES) the share of the full cache's blocks that no head
    # of their layer holds a token in when the prompt stopped (what a paged engine could return to its pool).
    block_free: Optional[dict[int, float]] = None
    # With prefill_chunk_size: the chunks the prompt was prefilled in (1: it fit in one, the prefill was not
    # chunked) and the most K/V bytes held at once during them; None without the option.
    prefill_chunks: Optional[int] = None
    peak_prefill_kv_bytes: Optional[int] = None


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    method: Method,
    max_new_tokens: int,
    stop_token_ids: Optional[Sequence[int]] = None,
    min_new_tokens: int = 0,
    questions: Optional[Sequence[str] | Sequence[Sequence[int]]] = None,
    decode_threads: Optional[int] = None,
    prefill_chunk_size: Optional[int] = None,
) -> list[Generation]:
    """Greedy-decode a batch of prompts (a list of strings, or of token-id lists) under `method`.

    A bare string is refused (it would be one prompt per character: pass [text]); token ids must be integers
    in [0, the model's input embedding rows): a bad one is named by prompt index, position and value.

    Prompts are left-padded into one batch; each prompt's output equals what it
    gives alone, and so does its `kv_bytes_per_prompt` (tokens decoded for the batch
    after a prompt has stopped are not counted). Strings are tokenized without special
    tokens: the caller applies any chat template (e.g. tokenizer.apply_chat_template).
    Decoding stops at `stop_token_ids`, by default the model's end-of-sequence and end-of-turn tokens
    (`default_stop_token_ids`); pass an empty list to always decode max_new_tokens.

    questions: per prompt, a question (string or token ids) appended after the prompt (then only the context) is
    prefilled, before the answer is generated, as if fed token by token as decode steps (the length the batch's
    questions share in one forward, the rest one token per step); each prompt's question may have its own length.
    `split_prompt` cuts a complete prompt into (context, question) token ids.

    decode_threads: CPU threads for the decode steps (the prompt's forward keeps torch's setting, which is
    restored afterwards); None: torch's setting throughout. A decode step is a series of small matmuls
    (batch x hidden rows) bound by reading the weights; split over threads, each waits for the slowest
    thread, which on a CPU busy with other work costs milliseconds per matmul (measured on 2 shared cores:
    batch-4 steps at 2 threads 5-20x slower than at 1; docs/ruler.md, "Throughput").

    prefill_chunk_size: prefill each prompt (one at a time) in chunks of this many tokens, each layer compressed to
    its budget between chunks (core/chunked.py); None: the whole prompt in one forward.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if decode_threads is not None and decode_threads < 1:
        raise ValueError(f"decode_threads must be >= 1, got {decode_threads}")
    vocab_size = _vocab_size(model)
    token_lists = _token_lists(tokenizer, prompts, "prompt", vocab_size)
    if not token_lists:
        return []
    for tokens in token_lists:
        method.check_prompt(len(tokens))
    if prefill_chunk_size is not None:
        PrefillChunks(prefill_chunk_size).check(method)
        if questions is not None:
            raise ValueError("prefill_chunk_size prefills the whole prompt in chunks; questions fed as decode steps "
                             "are not chunked: leave out one of them")
        if len(token_lists) > 1:   # chunked prefill takes one prompt at a time; each prompt's output is its own
            return [g for tokens in token_lists for g in generate(
                model, tokenizer, [tokens], method, max_new_tokens, stop_token_ids, min_new_tokens,
                decode_threads=decode_threads, prefill_chunk_size=prefill_chunk_size)]
    if questions is not None:
        question_lists = _token_lists(tokenizer, questions, "question", vocab_size)
        if len(question_lists) != len(token_lists):
            raise ValueError(f"got {len(question_lists)} questions for {len(token_lists)} prompts")
        return _generate_after_questions(model, tokenizer, token_lists, question_lists, method, max_new_tokens,
                                         stop_token_ids, min_new_tokens, decode_threads)
    input_ids, attention_mask, width, pad_id = _left_padded(model, tokenizer, token_lists)
    eos = default_stop_token_ids(model, tokenizer) if stop_token_ids is None else [int(t) for t in stop_token_ids]
    chunked = None
    with compress(model, method) as patch, _prompt_then_decode(model, decode_threads):
        cache = patch.new_cache(token_lists, tokenizer)
        if prefill_chunk_size is not None:
            PrefillChunks(prefill_chunk_size).check(method, patch.shape)
            chunked = prefill_in_chunks(model, cache, input_ids, prefill_chunk_size)
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, **{CACHE_ARGUMENT: cache},
            max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, do_sample=False, temperature=None,
            top_p=None, top_k=None, num_beams=1, eos_token_id=eos or None, pad_token_id=pad_id,
            stopping_criteria=StoppingCriteriaList([stop := _BytesAtStop(cache, width, [0] * len(token_lists),
                                                                         set(eos), max_new_tokens)]),
        )
    results = []
    stops = set(eos)
    for row, tokens in enumerate(token_lists):
        new = output[row, width:].tolist()
        cut = next((i for i, tok in enumerate(new) if tok in stops), len(new))
        text = tokenizer.decode(new[:cut], skip_special_tokens=True)
        results.append(Generation(text, len(tokens), cut, cache.final_kv_bytes(row), *_held(cache, row, stop.held),
                                  stop.blocks.get(row) or blocks_free_now(cache, row),
                                  chunked and chunked.chunks, chunked and cache.peak_prefill_kv_bytes))
    return results


def _token_lists(tokenizer, texts, what: str, vocab_size: int) -> list[list[int]]:
    """Each text's token ids: all strings (tokenized without special tokens) or all token-id lists; none empty,
    every id an integer in [0, vocab_size). A bare string (not a list of them) is refused: iterated, it would
    make one prompt per character."""
    if isinstance(texts, (str, bytes)):
        raise ValueError(f"{what}s is one string ({texts!r:.40}), not a list of {what}s: pass [text] (or token-id "
                         f"lists)")
    if texts is None or isinstance(texts, dict) or not hasattr(texts, "__len__"):
        raise ValueError(f"{what}s must be a list of strings or of token-id lists, got {texts!r:.60}")
    is_text = [isinstance(t, str) for t in texts]
    if any(is_text) and not all(is_text):
        raise ValueError(f"{what}s mix text ({what} {is_text.index(True)}) and token ids ({what} "
                         f"{is_text.index(False)}); give all as strings or all as token-id lists")
    if all(is_text):
        token_lists = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    else:
        token_lists = [_token_ids(t, f"{what} {i}", vocab_size) for i, t in enumerate(texts)]
    empty = [i for i, t in enumerate(token_lists) if len(t) == 0]
    if empty:
        raise ValueError(f"{what} {empty[0]} is empty")
    return token_lists


def _token_ids(tokens, name: str, vocab_size: int) -> list[int]:
    """One token-id list (ints, numpy or 0-d torch integers) as ints, each checked against the vocabulary."""
    if isinstance(tokens, (bytes, dict)) or not hasattr(tokens, "__iter__"):
        raise ValueError(f"{name} is neither text nor a list of token ids: {tokens!r:.60}")
    ids = []
    for position, token in enumerate(tokens):
        try:
            if isinstance(token, bool):
                raise TypeError
            value = operator.index(token)
        except TypeError:
            raise ValueError(f"{name} holds {token!r:.40} at position {position}, not a token id (an integer in "
                             f"[0, {vocab_size}))") from None
        if not 0 <= value < vocab_size:
            raise ValueError(f"{name} holds token id {value} at position {position}, outside the model's "
                             f"vocabulary [0, {vocab_size})")
        ids.append(value)
    return ids


def _vocab_size(model) -> int:
    """The rows of the model's input embedding: the ids it can read."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    return int(rows) if rows is not None else int(model.config.vocab_size)


def split_prompt(tokenizer, prompt: str, question_start: int) -> tuple[list[int], list[int]]:
    """The token ids of `prompt` (tokenized whole, without special tokens) cut where the question begins:
    (context ids, question ids), the question being every token that starts at character question_start or
    later, so the two parts together are exactly the whole prompt's tokens."""
    encoded = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded.input_ids, encoded.offset_mapping
    cut = next((i for i, (start, _) in enumerate(offsets) if start >= question_start), len(ids))
    return list(ids[:cut]), list(ids[cut:])


class _FeedQuestions(LogitsProcessor):
    """Forces each row's question tokens as its first "generated" tokens (so they are fed as decode steps),
    then suppresses the stop tokens for the row's first min_new_tokens answer tokens."""

    def __init__(self, width: int, questions: list[list[int]], stops: list[int], min_new_tokens: int):
        self.width, self.questions, self.stops, self.min_new_tokens = width, questions, stops, min_new_tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.width
        for row, question in enumerate(self.questions):
            if step < len(question):
                forced = scores.new_full(scores.shape[1:], float("-inf"))
                forced[question[step]] = 0.0
                scores[row] = forced
            elif step - len(question) < self.min_new_tokens and self.stops:
                scores[row, self.stops] = float("-inf")
        return scores


class _AnswerDone(StoppingCriteria):
    """A row is done once its answer (the tokens after its question) holds a stop token or max_new_tokens."""

    def __init__(self, width: int, questions: list[list[int]], stops: set[int], max_new_tokens: int):
        self.width, self.questions, self.stops, self.max_new_tokens = width, questions, stops, max_new_tokens

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done = []
        for row, question in enumerate(self.questions):
            answer = input_ids[row, self.width + len(question):].tolist()
            done.append(len(answer) >= self.max_new_tokens or any(t in self.stops for t in answer))
        return torch.tensor(done, device=input_ids.device)


def feed_together(model, cache, sequence: torch.Tensor, mask: torch.Tensor, forced: list[list[int]],
                  prompt_threads: Optional[int] = None) -> tuple[torch.Tensor, list[list[int]]]:
    """Appends to a prefilled cache, in ONE forward, what every row would otherwise feed one token per decode step:
    the last token of `sequence` [B, T] (not in the cache yet) and the first forced tokens all rows have, but the last
    of them (left for generate() to feed and predict from). mask: [B, <= T] the prompt's (left padding); the new
    tokens are real. The cache's units decide as if the tokens came one per step (core/cache.py `_piece`).
    prompt_threads: CPU threads for that forward (None: torch's setting; `_prompt_then_decode` yields the prompt's).
    -> (the sequence grown by those forced tokens, its last token not in the cache; each row's forced tokens left)."""
    common = min(len(f) for f in forced)
    if common == 0:
        return sequence, forced
    decode_threads = torch.get_num_threads()   # _prompt_then_decode's: a forward of many tokens takes the prompt's
    grown = torch.cat([sequence, torch.tensor([f[:common] for f in forced], device=sequence.device)], dim=1)
    width = grown.shape[1] - 1                       # the cache will hold every token but the last
    full = torch.cat([mask, mask.new_ones(mask.shape[0], width - mask.shape[1])], dim=1)
    positions = (full.long().cumsum(-1) - 1)[:, sequence.shape[1] - 1:]
    if prompt_threads is not None:
        torch.set_num_threads(prompt_threads)
    try:
        with torch.no_grad():
            model(input_ids=grown[:, sequence.shape[1] - 1:width], attention_mask=full, position_ids=positions,
                  **{CACHE_ARGUMENT: cache}, use_cache=True)
    finally:
        torch.set_num_threads(decode_threads)
    return grown, [f[common:] for f in forced]


def _generate_after_questions(model, tokenizer, contexts: list[list[int]], questions: list[list[int]], method: Method,
                              max_new_tokens: int, stop_token_ids, min_new_tokens: int,
                              decode_threads: Optional[int]) -> list[Generation]:
    input_ids, attention_mask, width, pad_id = _left_padded(model, tokenizer, contexts)
    eos = default_stop_token_ids(model, tokenizer) if stop_token_ids is None else [int(t) for t in stop_token_ids]
    with compress(model, method) as patch, _prompt_then_decode(model, decode_threads) as prompt_threads:
        cache = patch.new_cache(contexts, tokenizer)
        positions = attention_mask.long().cumsum(-1) - 1
        positions.masked_fill_(attention_mask == 0, 1)    # as generate() gives a left-padded prompt
        with torch.no_grad():   # the contexts, then the questions' common length in one forward
            model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **{CACHE_ARGUMENT: cache},
                  use_cache=True)
        first = torch.tensor([[q[0]] for q in questions], device=input_ids.device)
        sequence, forced = feed_together(model, cache, torch.cat([input_ids, first], dim=1), attention_mask,
                                         [q[1:] for q in questions], prompt_threads)
        fed = sequence.shape[1]
        mask = torch.cat([attention_mask, attention_mask.new_ones(len(contexts), fed - width)], dim=1)
        output = model.generate(
            input_ids=sequence, attention_mask=mask, **{CACHE_ARGUMENT: cache},
            max_new_tokens=max(len(f) for f in forced) + max_new_tokens,
            do_sample=False, temperature=None, top_p=None, top_k=None, num_beams=1, eos_token_id=None,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([_FeedQuestions(fed, forced, eos, min_new_tokens)]),
            stopping_criteria=StoppingCriteriaList([
                _AnswerDone(fed, forced, set(eos), max_new_tokens),
                stop := _BytesAtStop(cache, fed, [len(f) for f in forced], set(eos), max_new_tokens)]),
        )
    results = []
    for row, (context, question) in enumerate(zip(contexts, questions)):
        answer = output[row, width + len(question):].tolist()[:max_new_tokens]
        cut = next((i for i, tok in enumerate(answer) if tok in eos), len(answer))
        text = tokenizer.decode(answer[:cut], skip_special_tokens=True)
        results.append(Generation(text, len(context) + len(question), cut, cache.final_kv_bytes(row),
                                  *_held(cache, row, stop.held), stop.blocks.get(row) or blocks_free_now(cache, row)))
    return results


class _BytesAtStop(StoppingCriteria):
    """Records a prompt's cache bytes at the step its answer ends (a stop token, or max_new_tokens), while the
    batch may decode on: the cache then holds exactly what the prompt fed it (every question token and answer
    token but the last one sampled), as it would alone. Stops nothing itself."""

    def __init__(self, cache, width: int, question_lens: list[int], stops: set[int], max_new_tokens: int):
        self.cache, self.width, self.question_lens = cache, width, question_lens
        self.stops, self.max_new_tokens = stops, max_new_tokens
        self.held: dict[int, tuple[list[list[int]], int]] = {}   # per row that stopped: _held_now then
        self.blocks: dict[int, dict[int, float]] = {}              # per row that stopped: blocks_free_now then

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        for row, question in enumerate(self.question_lens):
            answer = input_ids[row, self.width + question:].tolist()
            if answer and (answer[-1] in self.stops or len(answer) >= self.max_new_tokens):
                self.cache.record_stop(row)
                if self.cache.method.sizing.outcome and row not in self.held:
                    self.held[row] = _held_now(self.cache, row)
                if row not in self.blocks:
                    self.blocks[row] = blocks_free_now(self.cache, row)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _held_now(cache, row: int) -> tuple[list[list[int]], int]:
    """(per layer and stored head the tokens prompt `row` holds, the tokens it has seen: prompt + appended)."""
    held = [cache.held_counts(layer)[row] for layer in range(cache.num_layers)]
    return held, cache.prompt.real_lens[row] + cache.layers[0].appended


def blocks_free_now(cache, row: int) -> dict[int, float]:
    """Per block size of BLOCK_SIZES, the share of the full cache's blocks (prompt + fed tokens, every layer) in
    which no head of the layer holds a token of prompt `row` now (sizing/blocks.py)."""
    held = [cache.held_positions(layer, row) for layer in range(cache.num_layers) if cache.layers[layer] is not None]
    seen = cache.prompt.real_lens[row] + next(s.appended for s in cache.layers if s is not None)
    return {size: round(freeable_share(held, seen, size), 6) for size in BLOCK_SIZES}


def _held(cache, row: int, at_stop: dict) -> tuple[Optional[list[list[int]]], Optional[int]]:
    """What a Generation records of a budget that is an outcome (threshold eviction): held and seen tokens
    when the prompt stopped (now, if it has not); (None, None) for a method with a budget."""
    if not cache.method.sizing.outcome:
        return None, None
    return at_stop.get(row) or _held_now(cache, row)


@contextmanager
def _prompt_then_decode(model, decode_threads: Optional[int]):
    """Around one model.generate(): the prompt's forward computes logits at its last position only, the one
    generate reads (the whole prompt's [B, n, vocab] logits cost SmolLM2-135M a sixth of the prompt's FLOPs
    and 1.5 GB at B = 4, n = 2048); with decode_threads, every forward after the prompt's runs on that many
    threads. Yields the prompt's thread count (for a later forward of many tokens: `feed_together`)."""
    threads = torch.get_num_threads()

    def last_position(module, args):
        return (args[0][:, -1:], *args[1:]) if args else None

    def after_forward(module, args, output):
        if decode_threads is not None and torch.get_num_threads() != decode_threads:
            torch.set_num_threads(decode_threads)

    hooks = [model.get_output_embeddings().register_forward_pre_hook(last_position),
             model.register_forward_hook(after_forward)]
    try:
        yield threads
    finally:
        for hook in hooks:
            hook.remove()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _left_padded(model, tokenizer, token_lists: list[list[int]]):
    """(input_ids, attention_mask) [B, width] left-padded on the model's device, width, pad id."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(t) for t in token_lists)
    input_ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(token_lists):
        input_ids[row, width - len(tokens):] = torch.tensor(tokens)
        attention_mask[row, width - len(tokens):] = 1
    device = model.get_input_embeddings().weight.device
    if device.type == "meta":  # offloaded by accelerate: its hook brings the inputs to where it computes
        device = torch.device("cpu")
    return input_ids.to(device), attention_mask.to(device), width, pad_id


def default_stop_token_ids(model, tokenizer) -> list[int]:
    """`end_token_ids` of a loaded model (its generation config) and its tokenizer."""
    return end_token_ids(tokenizer, getattr(model, "generation_config", None))


def end_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The ids that end a reply, in this order, each once (docs/models.md, "Stop tokens"):

    1. the generation config's eos_token_id, an int or a list (Llama 3: <|end_of_text|> and <|eot_id|>;
       Qwen2.5: <|im_end|> and <|endoftext|>; Phi-3: <|endoftext|>, <|assistant|> and <|end|>);
    2. the tokenizer's eos token;
    3. the token the chat template writes after an assistant turn (`end_of_turn_token`: <|eot_id|>,
       <|im_end|>, <end_of_turn>, <|end|>, </s>), so that a chat model stops where its turn ends even where
       its generation config lists only the end of the text (gemma-2-it's lists <eos> alone).

    Derived from the model's own files: no table by model name."""
    ids: list[int] = []
    configured = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.append(configured)
    elif configured:
        ids.extend(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    turn_end = end_of_turn_token(tokenizer)
    if turn_end is not None:
        ids.append(int(tokenizer.convert_tokens_to_ids(turn_end)))
    return list(dict.fromkeys(ids))


_REPLY = "\u2063PYRAMIDKV-REPLY\u2063"


def end_of_turn_token(tokenizer) -> Optional[str]:
    """The special token the tokenizer's chat template writes right after an assistant reply (only whitespace
    between them), found by rendering a user turn and a placeholder reply. None without a chat template, when
    the template refuses that conversation or does not show the reply verbatim, or when no special token
    follows it."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": _REPLY}],
                                             tokenize=False)
    except Exception:  # jinja raises its own errors for conversations a template refuses
        return None
    if text.count(_REPLY) != 1:
        return None
    tail = text.split(_REPLY)[1]
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    specials |= set(tokenizer.all_special_tokens)
    found = [(tail.find(token), -len(token), token) for token in specials if token and token in tail]
    if not found:
        return None
    at, _, token = min(found)
    return token if not tail[:at].strip() else None
