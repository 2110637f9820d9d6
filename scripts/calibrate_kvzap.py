"""Calibrate KVzap's per-layer predictor on any supported model (docs/methods.md, "KVzap"), on CPU, offline.

    python scripts/calibrate_kvzap.py --model_path M --model_type linear|mlp --out FILE [--texts 24] [--held_out 6]
        [--min_tokens 150] [--max_tokens 250] [--tokens_per_text 500] [--seed 0] [--alpha 1.0] [--epochs 15]

The authors' targets (kvpress kvzap/): a text t, the chat template with user = t + "\\n\\nRepeat the previous
context exactly." and assistant = t, one eager forward; per layer the full softmax A (every key), row i divided by
||h_i|| (h_i the query token's attention input), column j multiplied by ||W_O^(g) v_j|| (W_O^(g) query head g's
slice of o_proj), the rows of the assistant's copy and the columns of the user's copy kept, the max over the rows
and over the query group, the log: y [tokens, Hkv] per layer, X the user-copy tokens' attention inputs. Up to
`tokens_per_text` tokens of each text are sampled (seeded; the same tokens in every layer). Linear: ridge regression
per layer (alpha, intercept not penalised; closed form in float64 from accumulated sums). MLP: Linear(E, 512) ->
GELU -> Linear(512, Hkv) per layer, all layers fitted at once by AdamW (lr 5e-3, cosine over the epochs, gradient
norm clipped at 1, MSE, batch 512, 5% validation split).

Texts: passages of the Paul Graham essays (the needle haystack) and of LongBench multi_news contexts, each a
seeded span of min_tokens..max_tokens tokens (the authors: 750-1250; shorter here for CPU). The held-out texts come
from sources (essays, multi_news rows) no training text is drawn from. The artifact's record holds the model, the
data (files and digests, spans), the settings, the seed, the CPU time and the held-out metrics per layer (R^2, MSE,
Spearman rank correlation) and the kept share at a grid of thresholds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from pyramidkv.models.line import INTERFACE_LINE
from pyramidkv.runner.arguments import ArgumentParser, output_file
from pyramidkv.benchmarks.calibration import Clock, add_device, calibration_parser, provenance, require_positive

REPEAT = "\n\nRepeat the previous context exactly."
LONGBENCH_FILE = Path("/work/shared/longbench/data/multi_news.jsonl")
THRESHOLD_GRID = [float(t) for t in range(-12, 1)]


# --- targets ------------------------------------------------------------------------------------------------
def repeat_layout(tokenizer, text: str) -> tuple[list[int], tuple[int, int], tuple[int, int]]:
    """(token ids, user copy [start, stop), assistant copy [start, stop)) of the repeat prompt of `text` (stripped),
    the spans found from the tokenizer's character offsets as the authors do."""
    text = text.strip()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text + REPEAT},
                                              {"role": "assistant", "content": text}], tokenize=False)
    encoding = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    starts = torch.tensor([start for start, _ in encoding["offset_mapping"]])
    first = rendered.index(text)
    second = rendered.index(text, first + len(text))

    def token_at(char: int) -> int:
        return int(torch.nonzero(starts >= char)[0, 0])

    return (list(encoding["input_ids"]), (token_at(first), token_at(first + len(text))),
            (token_at(second), token_at(second + len(text))))


def attention_modules(model) -> list:
    from pyramidkv.models.glue import decoder

    return [layer.self_attn for layer in decoder(model).layers]


@torch.no_grad()
def targets(model, ids: list[int], user: tuple[int, int], copy: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One eager forward of `ids`: (X [L, u, E] the user-copy tokens' attention inputs, y [L, u, Hkv] their log
    targets), float32, u = user[1] - user[0]. The attention weights are the model's own (output_attentions)."""
    from pyramidkv.models.glue import decoder

    xs, ys = [], []

    def hook(module, args, kwargs, output):
        hidden = kwargs["hidden_states"][0]                                   # [n, E]
        weights = output[1][0]                                                # [Hq, n, n]
        heads, dim = weights.shape[0], module.head_dim
        kv_heads = heads // module.num_key_value_groups                        # (5.x modules lack num_key_value_heads)
        values = module.v_proj(hidden).view(-1, kv_heads, dim)               # [n, Hkv, D]
        values = values.repeat_interleave(heads // kv_heads, dim=1)           # [n, Hq, D]
        w_o = module.o_proj.weight.view(-1, heads, dim)                       # [E, Hq, D]
        column = torch.einsum("ehd,nhd->hne", w_o, values).norm(dim=-1)       # [Hq, n]: ||W_O^(g) v_j||
        row = hidden.norm(dim=-1)                                             # [n]: ||h_i||
        rows = weights[:, copy[0]:copy[1], user[0]:user[1]] / row[copy[0]:copy[1], None]
        best = rows.amax(dim=1) * column[:, user[0]:user[1]]                  # [Hq, u]
        best = best.view(kv_heads, heads // kv_heads, -1).amax(dim=1)         # [Hkv, u]
        xs.append(hidden[user[0]:user[1]].float())
        ys.append(best.float().log().T)
        return (output[0], None, *output[2:])                                 # the weights are not kept

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in attention_modules(model)]
    # 4.44.2's sdpa modules fall back to eager for output_attentions; 5.x's sdpa returns no weights: eager for this
    # forward there.
    implementation = model.config._attn_implementation
    if INTERFACE_LINE:
        model.set_attn_implementation("eager")
    try:
        decoder(model)(torch.tensor([ids], device=model.device), output_attentions=True, use_cache=False)   # no logits
    finally:
        if INTERFACE_LINE:
            model.set_attn_implementation(implementation)
        for handle in handles:
            handle.remove()
    return torch.stack(xs), torch.stack(ys)


# --- fits ---------------------------------------------------------------------------------------------------
class RidgeSums:
    """Per layer the sums a ridge regression with intercept needs (float64): count, sum x, sum y, X^T X, X^T y."""

    def __init__(self):
        self.count, self.sx, self.sy, self.xx, self.xy = 0, 0.0, 0.0, 0.0, 0.0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x [L, m, E], y [L, m, H]."""
        x, y = x.double(), y.double()
        self.count += x.shape[1]
        self.sx = self.sx + x.sum(dim=1)
        self.sy = self.sy + y.sum(dim=1)
        self.xx = self.xx + x.transpose(1, 2) @ x
        self.xy = self.xy + x.transpose(1, 2) @ y

    def solve(self, alpha: float) -> dict[str, torch.Tensor]:
        """weight [L, H, E], bias [L, H] float32 minimising ||y - x W^T - b||^2 + alpha ||W||^2 per layer."""
        mx, my = self.sx / self.count, self.sy / self.count                         # [L, E], [L, H]
        xx = self.xx - self.count * mx[:, :, None] * mx[:, None, :]
        xy = self.xy - self.count * mx[:, :, None] * my[:, None, :]
        eye = torch.eye(xx.shape[-1], dtype=xx.dtype)
        weight = torch.linalg.solve(xx + alpha * eye, xy)                           # [L, E, H]
        bias = my - (mx[:, None, :] @ weight)[:, 0]
        return {"weight": weight.transpose(1, 2).float().contiguous(), "bias": bias.float()}


def fit_mlp(x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int, lr: float = 5e-3, batch: int = 512,
            valid_share: float = 0.05) -> tuple[dict[str, torch.Tensor], list[float]]:
    """x [N, L, E], y [N, L, H] -> (w1 [L, 512, E], b1, w2 [L, H, 512], b2; validation MSE per epoch): every layer's
    MLP at once, AdamW (lr, cosine annealing over the epochs), gradient norm clipped at 1, MSE, `valid_share` of the
    samples held for validation, batches of `batch`, shuffled; seeded."""
    from pyramidkv.methods.kvzap import MLP_WIDTH

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n, layers, width_in = x.shape
    heads = y.shape[-1]
    layers_in = [torch.nn.Linear(width_in, MLP_WIDTH) for _ in range(layers)]   # torch's default init, seeded
    layers_out = [torch.nn.Linear(MLP_WIDTH, heads) for _ in range(layers)]
    w1, b1 = (torch.nn.Parameter(torch.stack([getattr(m, k).detach() for m in layers_in])) for k in ("weight", "bias"))
    w2, b2 = (torch.nn.Parameter(torch.stack([getattr(m, k).detach() for m in layers_out])) for k in ("weight", "bias"))
    params = [w1, b1, w2, b2]

    def forward(xb):                                                   # [b, L, E] -> [b, L, H]
        inner = torch.nn.functional.gelu(torch.einsum("ble,lwe->blw", xb, w1) + b1)
        return torch.einsum("blw,lhw->blh", inner, w2) + b2

    order = torch.randperm(n, generator=generator)
    valid = order[: max(1, round(valid_share * n))] if n > 1 else order[:0]
    train = order[len(valid):]
    optimizer = torch.optim.AdamW(params, lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    losses = []
    for _ in range(epochs):
        shuffled = train[torch.randperm(len(train), generator=generator)]
        for start in range(0, len(shuffled), batch):
            rows = shuffled[start:start + batch]
            loss = torch.nn.functional.mse_loss(forward(x[rows]), y[rows])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
        schedule.step()
        with torch.no_grad():
            losses.append(float(torch.nn.functional.mse_loss(forward(x[valid]), y[valid])) if len(valid) else
                          float("nan"))
    return {"w1": w1.detach().contiguous(), "b1": b1.detach().contiguous(), "w2": w2.detach().contiguous(),
            "b2": b2.detach().contiguous()}, losses


# --- metrics ------------------------------------------------------------------------------------------------
def ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1 of a 1-d tensor (ties by position)."""
    out = torch.empty_like(values, dtype=torch.float64)
    out[values.argsort(stable=True)] = torch.arange(len(values), dtype=torch.float64)
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two equal-length 1-d tensors."""
    ra, rb = ranks(a.flatten()), ranks(b.flatten())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def held_out_metrics(tensors: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> dict:
    """Per layer R^2, MSE and Spearman of the predictor on x [L, m, E] against y [L, m, H]; the kept share of the
    predicted scores at each threshold of THRESHOLD_GRID (all layers and heads)."""
    from pyramidkv.methods.kvzap import predict

    predicted = torch.stack([predict(tensors, layer, x[layer]) for layer in range(x.shape[0])]).double()
    y = y.double()
    mse = ((predicted - y) ** 2).mean(dim=(1, 2))
    r2 = 1 - ((predicted - y) ** 2).sum(dim=(1, 2)) / ((y - y.mean(dim=(1, 2), keepdim=True)) ** 2).sum(dim=(1, 2))
    rho = [spearman(predicted[layer], y[layer]) for layer in range(y.shape[0])]
    return {"tokens": int(y.shape[1]), "r2": [round(float(v), 4) for v in r2], "mse": [round(float(v), 4) for v in mse],
            "spearman": [round(v, 4) for v in rho], "spearman_mean": round(sum(rho) / len(rho), 4),
            "r2_mean": round(float(r2.mean()), 4),
            "kept_share": {f"{t:g}": round(float((predicted >= t).double().mean()), 4) for t in THRESHOLD_GRID}}


# --- data ---------------------------------------------------------------------------------------------------
def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def sources(haystack_dir, longbench_file) -> tuple[list[tuple[str, str]], list[dict]]:
    """([(source name, text)], [{file, sha256}]): every essay (.txt) of the folder and every multi_news context."""
    texts, files = [], []
    folder = Path(haystack_dir)
    if not folder.is_dir() or not any(folder.glob("*.txt")):   # else other sources alone would make the artifact
        raise ValueError(f"--haystack_dir {folder}: {'no .txt files' if folder.is_dir() else 'no such folder'}; give "
                         f"a folder of .txt files")
    for path in sorted(folder.glob("*.txt")):
        texts.append((path.name, path.read_text(encoding="utf-8")))
        files.append({"file": path.name, "sha256": digest(path)})
    if longbench_file is not None and Path(longbench_file).is_file():
        for i, line in enumerate(Path(longbench_file).read_text(encoding="utf-8").splitlines()):
            context = json.loads(line)["context"].replace("NEWLINE_CHAR", "\n")
            texts.append((f"{Path(longbench_file).name}#{i}", context))
        files.append({"file": Path(longbench_file).name, "sha256": digest(longbench_file)})
    return texts, files


def passages(tokenizer, named: list[tuple[str, str]], count: int, held_out: int, min_tokens: int, max_tokens: int,
             seed: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out) passages, each {source, start, tokens, text}: a seeded permutation of the sources, the
    first `held_out` long enough for held-out texts, the next `count` for training; from each a span of
    min_tokens..max_tokens tokens at a seeded offset, decoded to text."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(named), generator=generator).tolist()
    chosen = []
    for index in order:
        if len(chosen) == held_out + count:
            break
        name, text = named[index]
        ids = tokenizer(text, add_special_tokens=False).input_ids
        length = int(torch.randint(min_tokens, max_tokens + 1, (1,), generator=generator))
        if len(ids) < length:
            continue
        start = int(torch.randint(0, len(ids) - length + 1, (1,), generator=generator))
        chosen.append({"source": name, "start": start, "tokens": length,
                       "text": tokenizer.decode(ids[start:start + length]).strip()})
    if len(chosen) < held_out + count:
        raise ValueError(f"only {len(chosen)} sources hold {max_tokens} tokens; ask for fewer --texts / --held_out")
    return chosen[held_out:], chosen[:held_out]


# --- calibration --------------------------------------------------------------------------------------------
def calibrate(model, tokenizer, train: list[dict], held: list[dict], model_type: str, tokens_per_text: int, seed: int,
              alpha: float = 1.0, epochs: int = 15) -> tuple[dict[str, torch.Tensor], dict]:
    """(predictor tensors, {"held_out": metrics, "validation_mse": per epoch (mlp)}) fitted on the training
    passages' targets (up to tokens_per_text sampled tokens each, seeded) and measured on every user-copy token
    of the held-out passages."""
    generator = torch.Generator().manual_seed(seed)
    sums, xs, ys = RidgeSums(), [], []
    bar = tqdm(total=len(train) + len(held), desc="passages (targets: two forward passes each)", unit="passage",
               dynamic_ncols=True)
    for passage in train:
        x, y = targets(model, *repeat_layout(tokenizer, passage["text"]))
        bar.update(1)
        pick = torch.randperm(x.shape[1], generator=generator)[:tokens_per_text]
        if model_type == "linear":
            sums.add(x[:, pick], y[:, pick])
        else:
            xs.append(x[:, pick].transpose(0, 1))
            ys.append(y[:, pick].transpose(0, 1))
    info = {}
    if model_type == "linear":
        tensors = sums.solve(alpha)
    else:
        tensors, info["validation_mse"] = fit_mlp(torch.cat(xs), torch.cat(ys), epochs, seed)
        info["validation_mse"] = [round(v, 4) for v in info["validation_mse"]]
    if held:
        pairs = []
        for passage in held:
            pairs.append(targets(model, *repeat_layout(tokenizer, passage["text"])))
            bar.update(1)
        info["held_out"] = held_out_metrics(tensors, torch.cat([p[0] for p in pairs], dim=1),
                                            torch.cat([p[1] for p in pairs], dim=1))
    bar.close()
    return tensors, info


def parse_args(argv=None) -> tuple[argparse.Namespace, ArgumentParser]:
    parser = calibration_parser(Path(__file__).name, __doc__)
    parser.add_argument("--model_type", choices=("linear", "mlp"), required=True)
    parser.add_argument("--out", required=True, type=output_file, help="the .safetensors file written")
    parser.add_argument("--texts", type=int, default=24, help="training passages (the authors: 4.5K)")
    parser.add_argument("--held_out", type=int, default=6, help="held-out passages, from other sources")
    parser.add_argument("--min_tokens", type=int, default=150, help="shortest passage (the authors: 750)")
    parser.add_argument("--max_tokens", type=int, default=250, help="longest passage (the authors: 1250)")
    parser.add_argument("--tokens_per_text", type=int, default=500, help="tokens sampled per training passage")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=1.0, help="ridge penalty (linear)")
    parser.add_argument("--epochs", type=int, default=15, help="MLP epochs (the authors: 15)")
    parser.add_argument("--longbench_file", default=str(LONGBENCH_FILE),
                        help="a LongBench jsonl whose contexts add sources (none: essays only)")
    add_device(parser, dtype=False)
    args = parser.parse_args(argv)
    require_positive(parser, args, ("texts", "min_tokens", "tokens_per_text", "epochs"))
    if args.held_out < 0:
        parser.error(f"--held_out must be >= 0, got {args.held_out}")
    if args.max_tokens < args.min_tokens:
        parser.error(f"--max_tokens {args.max_tokens} is below --min_tokens {args.min_tokens}")
    if not args.alpha >= 0:
        parser.error(f"--alpha must be >= 0, got {args.alpha}")
    if not args.out.endswith(".safetensors"):
        parser.error(f"--out must name a .safetensors file, got {args.out!r}")
    return args, parser


def main(argv=None) -> Path:
    args, parser = parse_args(argv)
    from pyramidkv.benchmarks.prompting import essay_dir
    from pyramidkv.methods.calibrated import model_record, save_artifact
    from pyramidkv.models.loading import check_model, load_model

    from transformers import AutoTokenizer

    try:   # every check before the weights load, the passages drawn included
        resolved, config, _, _ = check_model(args.model_path, "eager", args.device, "float32", args.model_class)
        named, files = sources(args.haystack_dir or essay_dir(), args.longbench_file)
        train, held = passages(AutoTokenizer.from_pretrained(resolved), named, args.texts, args.held_out,
                               args.min_tokens, args.max_tokens, args.seed)
    except (ValueError, OSError, ImportError) as e:
        parser.error(str(e))
    clock = Clock()
    model, tokenizer = load_model(args.model_path, attn_implementation="eager", device=args.device, dtype="float32",
                                  model_class=args.model_class)
    tensors, info = calibrate(model, tokenizer, train, held, args.model_type, args.tokens_per_text, args.seed,
                              args.alpha, args.epochs)
    made_on = {**model_record(str(resolved), config), "name": args.model_path}   # digest of the resolved folder
    record = {"kind": f"kvzap-{args.model_type}", "model": made_on,
              "data": {"files": files, "train": [{k: p[k] for k in ("source", "start", "tokens")} for p in train],
                       "held_out": [{k: p[k] for k in ("source", "start", "tokens")} for p in held]},
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "model_path")},
              "seed": args.seed, **provenance(clock, argv), **info}
    path = save_artifact(args.out, tensors, record)
    metrics = info.get("held_out", {})
    print(f"kvzap-{args.model_type}: {len(train)} passages, {record['cpu_seconds']} CPU s "
          f"({record['wall_seconds']} s) -> {path}; held-out Spearman {metrics.get('spearman_mean')}, "
          f"R^2 {metrics.get('r2_mean')}")
    return path


if __name__ == "__main__":
    main()
