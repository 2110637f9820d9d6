"""Make a DuoAttention head pattern for any supported model, on CPU, from offline essays (docs/methods.md, "DuoAttention").

    python scripts/calibrate_duo.py [--model_path M] --out DIR [--seed 0]
        [--num_steps 30] [--context_length_min 256] [--context_length_max 512] [--num_passkeys 2]
        [--passkey_words 6] [--sink_size 8] [--recent_size 32] [--lr 0.02] [--reg_weight 0.05]
    python scripts/calibrate_duo.py --on_the_fly [--model_path M] --out DIR [--num_samples 8]
        [--sample_tokens 1000] [--positions 500]

Default: the authors' gate optimisation (duo-attention `train.py`) at a CPU size. One gate alpha per KV head (1.0 at
the start); each step runs a synthetic multi-passkey sample twice, with full attention (no gradient) and with every
head's output alpha * full + (1 - alpha) * streaming (streaming: the first sink_size keys and the last recent_size);
loss = mean over the loss rows of the mean squared difference of the final hidden states + reg_weight * mean |alpha|;
AdamW (lr 0.02, no weight decay), the official learning-rate factor min(1, max((s + 1) / (T // 5), 0.1),
max((T - s) / (T // 5), 0.1)) (so T >= 5), alpha clamped to [0, 1] before each step. Loss rows (`--rows`): `official`
(default) the official labels, every token after the context (each question, its passkey and a separator), the
hidden states read at those tokens, unshifted; `answer` the positions that predict the passkey tokens (this script's
rule before 2026-11). Samples, the official layout (duo-attention `data.py`): "<|im_start|> This is a very long story
book: <book> ", the first `context_length` haystack tokens with each passkey needle (the official wording, random NATO
words) wrapped in "\n\n" at sorted random depths, 1-16 haystack tokens of padding (the official pads to a multiple
of 16 and, its test reading `... + len(prompt2) % 16`, adds 16 where none is needed), " </book>.\n\n", then per
passkey its question, the passkey and "\n\n". The haystack is cut so that a sample fits context_length_max (the
official cuts once by an estimate with a 300-token buffer). Sizes are scaled down from the official (1,000-32,000
tokens, 10 passkeys of 32 words, sink 128 + recent 256, 2,000 steps on 8 GPUs).

--on_the_fly: kvpress's head scores (DuoAttentionPress.compute_head_scores on the fly): per layer the mean query
before RoPE and the mean key over every position of a sample, both repeated at `positions` positions with RoPE
0 .. positions - 1, the last position's attention over them, score = the mean of its cumulative sum, averaged over
the query group and the samples (essay chunks here, BookSum chapters there).

Output: the official folder layout, DIR/full_attention_heads.tsv (L rows of Hkv tab-separated gates) and
DIR/config.json (the official training arguments, sink_size / recent_size the training sizes, plus our record under
"pyramidkv_calibration": model identity by content, data with digests, settings, seed, CPU seconds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch

from pyramidkv.runner.arguments import output_folder
from pyramidkv.benchmarks.calibration import Clock, calibration_parser, provenance, refused_before_loading

NATO = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett", "kilo", "lima",
        "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey",
        "xray", "yankee", "zulu")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
NEEDLE = "Remeber this sequence of words, it's the {} passkey to the vault: "   # the official wording, typo included
QUESTION = "Based on the content of the book, what is the {} passkey to the vault?\nPasskey: "
SEPARATOR = "\n\n"
BOOK_OPEN = "<|im_start|> This is a very long story book: <book> "   # official prompt1, read with special tokens
BOOK_CLOSE = " </book>.\n\n"                                          # official prompt2
PAD_MULTIPLE = 16
DEPTHS = np.linspace(0.05, 0.95, 1000)   # official min/max_needle_depth_ratio, depth_ratio_num_intervals
CONTEXT_INTERVALS = 5                    # official context_lengths_num_intervals 50, over a far wider span
ROWS = ("official", "answer")            # the loss rows: the official labels, or the positions predicting the answer


def parse_args(argv=None) -> argparse.Namespace:
    parser = calibration_parser("calibrate_duo.py", __doc__)
    parser.add_argument("--out", required=True, type=output_folder,
                        help="output folder (full_attention_heads.tsv + config.json), checked before the work")
    parser.add_argument("--on_the_fly", action="store_true", help="kvpress's on-the-fly head scores, no training")
    parser.add_argument("--seed", type=int, default=0)
    gate = parser.add_argument_group("gate optimisation")
    gate.add_argument("--num_steps", type=int, default=30)
    gate.add_argument("--context_length_min", type=int, default=256, help="haystack + needles, in tokens")
    gate.add_argument("--context_length_max", type=int, default=512)
    gate.add_argument("--num_passkeys", type=int, default=2, help=f"1 .. {len(ORDINALS)}")
    gate.add_argument("--passkey_words", type=int, default=6, help="NATO words per passkey (official 32)")
    gate.add_argument("--sink_size", type=int, default=8, help="training sink (official 128)")
    gate.add_argument("--recent_size", type=int, default=32, help="training recent window (official 256)")
    gate.add_argument("--lr", type=float, default=0.02)
    gate.add_argument("--reg_weight", type=float, default=0.05)
    gate.add_argument("--rows", choices=ROWS, default=ROWS[0],
                      help="loss rows: official = every question, passkey and separator token (the official labels, "
                           "unshifted); answer = the positions predicting the passkey tokens")
    fly = parser.add_argument_group("--on_the_fly")
    fly.add_argument("--num_samples", type=int, default=8)
    fly.add_argument("--sample_tokens", type=int, default=1000)
    fly.add_argument("--positions", type=int, default=500)
    args = parser.parse_args(argv)
    positive = ["num_steps", "context_length_min", "passkey_words", "recent_size", "num_samples", "sample_tokens",
                "positions"]
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.sink_size < 0 or args.seed < 0:
        parser.error(f"--sink_size and --seed must be >= 0, got {args.sink_size} and {args.seed}")
    if not 1 <= args.num_passkeys <= len(ORDINALS):
        parser.error(f"--num_passkeys must be in 1..{len(ORDINALS)}, got {args.num_passkeys}")
    if args.num_steps < 5:
        parser.error(f"--num_steps must be >= 5 (the official schedule divides by num_steps // 5), got "
                     f"{args.num_steps}")
    if args.context_length_max < args.context_length_min:
        parser.error(f"--context_length_max {args.context_length_max} is below --context_length_min "
                     f"{args.context_length_min}")
    if not (args.lr > 0 and args.reg_weight >= 0):
        parser.error(f"--lr must be > 0 and --reg_weight >= 0, got {args.lr} and {args.reg_weight}")
    return args


def haystack(tokenizer, folder, tokens: int) -> tuple[list[int], list[dict]]:
    """The first `tokens` tokens of the essays in name order (repeated when short), and each file read with its
    sha256."""
    from pyramidkv.benchmarks.prompting import essay_dir

    folder = Path(folder) if folder is not None else essay_dir()
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise ValueError(f"--haystack_dir {folder}: no .txt files")
    ids, sources = [], []
    for path in files:
        raw = path.read_bytes()
        sources.append({"file": path.name, "sha256": hashlib.sha256(raw).hexdigest()[:16]})
        ids += tokenizer(raw.decode("utf-8", errors="replace"), add_special_tokens=False).input_ids
        if len(ids) >= tokens:
            break
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens], sources


def fixed_tokens(tokenizer, num_passkeys: int, words: int) -> int:
    """The most tokens a sample holds besides its haystack: the book markers, every needle with its separators,
    every question with its passkey and separator (passkeys of the longest-encoding NATO word), the padding."""
    encode = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    key = max(encode(" ".join([word] * words)) for word in NATO)
    each = encode(NEEDLE.format(ORDINALS[0])) + 3 * encode(SEPARATOR) + 2 * key + encode(QUESTION.format(ORDINALS[0]))
    ordinal = max(encode(o) for o in ORDINALS[:num_passkeys]) - encode(ORDINALS[0])
    book = len(tokenizer(BOOK_OPEN, add_special_tokens=True).input_ids) + encode(BOOK_CLOSE)
    return book + num_passkeys * (each + 2 * max(ordinal, 0)) + PAD_MULTIPLE


def passkey_sample(rng: np.random.Generator, tokenizer, text: list[int], context_length: int, limit: int,
                   num_passkeys: int, words: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The official multi-passkey sample (module docstring), at most `limit` tokens: (ids [n], qa [n] bool: the
    official labels, every token after the context; answer [n] bool: the passkey tokens among them)."""
    encode = lambda s, special=False: tokenizer(s, add_special_tokens=special).input_ids  # noqa: E731
    keys = [encode(" ".join(rng.choice(NATO, words))) for _ in range(num_passkeys)]
    separator = encode(SEPARATOR)
    qa, answer = [], []
    for i, key in enumerate(keys):
        question = encode(QUESTION.format(ORDINALS[i]))
        qa += question + key + separator
        answer += [False] * len(question) + [True] * len(key) + [False] * len(separator)
    needles = [separator + encode(NEEDLE.format(ORDINALS[i])) + key + separator for i, key in enumerate(keys)]
    book_open, book_close = encode(BOOK_OPEN, True), encode(BOOK_CLOSE)
    room = limit - len(book_open) - len(book_close) - len(qa) - sum(map(len, needles)) - PAD_MULTIPLE
    if room < 1:
        raise ValueError(f"a sample of {num_passkeys} passkeys of {words} words does not fit {limit} tokens")
    hay = text[:min(context_length, room)]
    context, last = list(book_open), 0
    for depth, needle in zip(sorted(rng.choice(DEPTHS, num_passkeys, replace=False)), needles):
        cut = int(len(hay) * depth)
        context += hay[last:cut] + needle
        last = cut
    context += hay[last:]
    pad = PAD_MULTIPLE - (len(context) + len(qa) + len(book_close)) % PAD_MULTIPLE   # 1 .. 16, as the official
    context += text[room - pad:room] + book_close
    ids = context + qa
    return (torch.tensor(ids), torch.tensor([False] * len(context) + [True] * len(qa)),
            torch.tensor([False] * len(context) + answer))


def loss_rows(qa: torch.Tensor, answer: torch.Tensor, rows: str) -> torch.Tensor:
    """The positions whose final hidden states the loss compares: every labelled token (official), or the positions
    predicting an answer token (position t predicts token t + 1)."""
    return qa.nonzero().squeeze(1) if rows == "official" else answer[1:].nonzero().squeeze(1)


class GatedAttention:
    """Every attention module of the model computes full attention (`gated` False) or each head's
    alpha * full + (1 - alpha) * streaming (sinks + recent window), alpha per KV head [L, Hkv]."""

    def __init__(self, model, sink: int, recent: int):
        from pyramidkv.models.glue import decoder
        from pyramidkv.models.patch import MODEL_GLUE

        config = model.config
        self.glue = MODEL_GLUE[config.model_type]
        form = self.glue.attention_form(config, "sdpa")
        if form.capped or form.sliding:
            raise ValueError(f"{config.model_type}: the gated attention here computes plain global attention (no "
                             f"logit soft-cap, no sliding layers)")
        self.scale, self.sink, self.recent, self.gated = form.scale, sink, recent, False
        self.layers = decoder(model).layers
        heads = config.num_key_value_heads or config.num_attention_heads
        self.alpha = torch.nn.Parameter(torch.ones(len(self.layers), heads))
        self.group = config.num_attention_heads // heads
        self.originals = [layer.self_attn.forward for layer in self.layers]
        for index, layer in enumerate(self.layers):
            layer.self_attn.forward = self._forward(layer.self_attn, index)

    def remove(self) -> None:
        for layer, forward in zip(self.layers, self.originals):
            layer.self_attn.forward = forward

    def _forward(self, module, index: int):
        def forward(hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                    output_attentions=False, use_cache=False, cache_position=None, position_embeddings=None, **_):
            q, k, v = self.glue.project_qkv(module, hidden_states, position_ids, position_embeddings)
            k, v = (t.repeat_interleave(self.group, dim=1) for t in (k, v))
            scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            if self.gated:
                n = q.shape[2]
                i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
                band = (j <= i) & ((j < self.sink) | (i - j < self.recent))
                stream = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scale)
                alpha = self.alpha[index].repeat_interleave(self.group)[None, :, None, None]
                out = alpha * out + (1 - alpha) * stream
            out = out.transpose(1, 2).reshape(*hidden_states.shape[:2], -1)
            return module.o_proj(out), None, past_key_value
        return forward


def lr_factor(step: int, steps: int) -> float:
    """The official schedule: linear warm-up and decay over steps // 5 steps each, floored at 0.1."""
    fifth = steps // 5
    return min(1.0, max((step + 1) / fifth, 0.1), max((steps - step) / fifth, 0.1))


def gate_loss(gates: GatedAttention, body, ids: torch.Tensor, rows: torch.Tensor,
              reg_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, distill) of one sample ids [n]: the mean over `rows` of the mean squared difference of the final hidden
    states, full attention against gated, + reg_weight * mean |alpha|."""
    with torch.no_grad():
        gates.gated = False
        full = body(input_ids=ids[None], use_cache=False).last_hidden_state[0, rows]
    gates.gated = True
    pred = body(input_ids=ids[None], use_cache=False).last_hidden_state[0, rows]
    distill = (full.float() - pred.float()).pow(2).mean(-1).mean()
    return distill + reg_weight * gates.alpha.abs().mean(), distill


def optimise_gates(model, tokenizer, args, text: list[int], log=print) -> np.ndarray:
    """[L, Hkv] gates after args.num_steps steps (the last step's values, unclamped, as the official code saves)."""
    from pyramidkv.models.glue import decoder

    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    lengths = np.linspace(args.context_length_min, args.context_length_max, CONTEXT_INTERVALS).round().astype(int)
    for p in model.parameters():
        p.requires_grad_(False)
    gates = GatedAttention(model, args.sink_size, args.recent_size)
    optimizer = torch.optim.AdamW([gates.alpha], lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args.num_steps))
    body = decoder(model)
    try:
        for step in range(args.num_steps):
            ids, qa, answer = passkey_sample(rng, tokenizer, text, int(rng.choice(lengths)), args.context_length_max,
                                             args.num_passkeys, args.passkey_words)
            with torch.no_grad():
                gates.alpha.clamp_(0, 1)
            loss, distill = gate_loss(gates, body, ids, loss_rows(qa, answer, args.rows), args.reg_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            log(f"step {step + 1}/{args.num_steps}: {len(ids)} tokens, distill {distill.item():.4g}, "
                f"mean alpha {gates.alpha.mean().item():.3f}")
    finally:
        gates.remove()
    return gates.alpha.detach().double().numpy()


def on_the_fly_scores(model, tokenizer, args, text: list[int]) -> np.ndarray:
    """[L, Hkv] kvpress's on-the-fly head scores over args.num_samples essay chunks of args.sample_tokens tokens."""
    from pyramidkv.models.glue import decoder
    from pyramidkv.models.patch import MODEL_GLUE

    config = model.config
    glue = MODEL_GLUE[config.model_type]
    if not hasattr(glue, "project"):
        raise ValueError(f"{config.model_type}: --on_the_fly needs the queries before RoPE (a rotate-half family)")
    scale = glue.attention_form(config, "sdpa").scale or \
        1.0 / math.sqrt(config.hidden_size // config.num_attention_heads)
    rotation = glue.key_rotation(model)
    layers = decoder(model).layers
    heads = config.num_key_value_heads or config.num_attention_heads
    group = config.num_attention_heads // heads
    positions = torch.arange(args.positions)
    scores = torch.zeros(len(layers), heads, dtype=torch.float64)
    means: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def grab(index):
        def hook(module, hook_args, kwargs):
            hidden = kwargs.get("hidden_states", hook_args[0] if hook_args else None)
            q, k, _ = glue.project(module, hidden)
            means[index] = q[0].float().mean(1), k[0].float().mean(1)     # [Hq, D], [Hkv, D]
        return hook

    hooks = [layer.self_attn.register_forward_pre_hook(grab(i), with_kwargs=True) for i, layer in enumerate(layers)]
    rng = np.random.default_rng(args.seed)
    try:
        for _ in range(args.num_samples):
            start = int(rng.integers(0, len(text) - args.sample_tokens + 1))
            with torch.no_grad():
                model(input_ids=torch.tensor(text[start:start + args.sample_tokens])[None], use_cache=False)
            for index, (q, k) in means.items():
                q = rotation.rotate(q[:, None].expand(-1, len(positions), -1), positions)[:, -1]   # [Hq, D]
                k = rotation.rotate(k[:, None].expand(-1, len(positions), -1), positions)          # [Hkv, P, D]
                k = k.repeat_interleave(group, dim=0)
                attention = torch.softmax(torch.einsum("hd,hpd->hp", q, k) * scale, dim=-1)
                score = attention.cumsum(-1).mean(-1).double()                                  # [Hq]
                scores[index] += score.view(heads, group).mean(-1) / args.num_samples
    finally:
        for hook in hooks:
            hook.remove()
    return scores.numpy()


def write_pattern(out: Path, gates: np.ndarray, config: dict) -> None:
    """The official layout: out/full_attention_heads.tsv (L rows of Hkv tab-separated) and out/config.json, whose
    pyramidkv record gets the sha256 of the pattern's text (`pattern_sha256`, checked when it is read)."""
    from pyramidkv.methods.calibrated import RECORD_KEY, text_digest
    from pyramidkv.runner.results import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    text = "".join("\t".join(f"{x:.8g}" for x in row) + "\n" for row in gates)
    config = {**config, RECORD_KEY: {**config[RECORD_KEY], "pattern_sha256": text_digest(text)}}
    atomic_write_text(out / "full_attention_heads.tsv", text)
    atomic_write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")


def main(argv=None) -> Path:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from pyramidkv.methods.calibrated import FORMAT, RECORD_KEY, VERSION, model_record
    from pyramidkv.models.loading import check_model, load_model

    with refused_before_loading("calibrate_duo.py", (ValueError, OSError, ImportError)):
        path, config, _, _ = check_model(args.model_path, "sdpa", "cpu", "float32", args.model_class)
        tokenizer = AutoTokenizer.from_pretrained(path)
        need = args.sample_tokens if args.on_the_fly else args.context_length_max
        text, sources = haystack(tokenizer, args.haystack_dir, max(4 * need, 4096))
        fixed = fixed_tokens(tokenizer, args.num_passkeys, args.passkey_words)
        if not args.on_the_fly and args.context_length_max <= fixed:
            raise ValueError(f"--context_length_max {args.context_length_max} leaves no haystack: the book markers, "
                             f"{args.num_passkeys} needles and questions of {args.passkey_words} words and the "
                             f"padding take up to {fixed} tokens")
    model, tokenizer = load_model(args.model_path, attn_implementation="sdpa", device="cpu", dtype="float32",
                                  model_class=args.model_class)
    clock = Clock()
    if args.on_the_fly:
        gates = on_the_fly_scores(model, tokenizer, args, text)
        settings = {key: getattr(args, key) for key in ("num_samples", "sample_tokens", "positions")}
    else:
        gates = optimise_gates(model, tokenizer, args, text)
        settings = {key: getattr(args, key) for key in ("num_steps", "context_length_min", "context_length_max",
                                                        "num_passkeys", "passkey_words", "sink_size", "recent_size",
                                                        "lr", "reg_weight", "rows")}
    record = {"format": FORMAT, "version": VERSION, "kind": "duo", "model": model_record(str(path), config),
              "recipe": "on_the_fly" if args.on_the_fly else "gate_optimisation",
              "data": {"haystack": str(args.haystack_dir or "essay_dir()"), "files": sources,
                       "tokens": len(text)},
              "settings": settings, "seed": args.seed, **provenance(clock, argv)}
    official = {"model_name": args.model_path, "dataset_name": "paul_graham_essays", "sink_size": args.sink_size,
                "recent_size": args.recent_size, "seed": args.seed, "output_dir": args.out}
    if not args.on_the_fly:
        official |= {"batch_size": 1, "num_steps": args.num_steps, "lr": args.lr, "reg_weight": args.reg_weight,
                     "min_needle_depth_ratio": 0.05, "max_needle_depth_ratio": 0.95,
                     "context_length_min": args.context_length_min, "context_length_max": args.context_length_max,
                     "context_lengths_num_intervals": CONTEXT_INTERVALS, "depth_ratio_num_intervals": len(DEPTHS),
                     "gradient_accumulation_steps": 1, "num_passkeys": args.num_passkeys,
                     "dataset_format": "multiple_passkey"}
    out = Path(args.out)
    write_pattern(out, gates, {**official, RECORD_KEY: record})
    print(f"{record['recipe']}: {gates.shape[0]} layers x {gates.shape[1]} KV heads, {record['cpu_seconds']} CPU s "
          f"({record['wall_seconds']} s wall) -> {out}")
    return out


if __name__ == "__main__":
    main()
