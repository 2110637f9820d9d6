"""A model split over a GPU and the CPU, generating under compression: where each layer's cache lives and
whether the tokens are right. Needs CUDA; under 2 minutes on either model.

    python scripts/device_map_check.py                 # the default model (SmolLM2-135M, 30 layers)
    python scripts/device_map_check.py --model_path tiny   # a 4-layer random Llama with its tokenizer

Two placements of one map (the embedding, lm_head and the first half of the layers on the CPU; the rest and the
final norm on cuda:0), float32:

  split      accelerate's dispatch_model with main_device="cpu": the CPU half computes on the CPU, so the
             cache spans two devices;
  offload    load_model(device_map=...) (from_pretrained): under accelerate's rule the CPU half is offloaded
             (weights in CPU memory, computed on cuda:0), so every layer's cache is on cuda:0.

For each: the unpatched model's greedy tokens equal fullkv's under compress() (same placement: bit-identical);
snapkv, KIVI and KVQuant (keys before RoPE: the rotation tables per device) equal their tokens on the model
all on the CPU; every layer's store holds its K/V on the device its layer computes on (printed), and the
quantized attention's scratch buffers are on the devices of the layers using them. Last line: PASS or FAIL.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from pyramidkv import DEFAULT_MODEL_NAME, compress, load_model, make_method
from pyramidkv.models.patch import layer_devices
from pyramidkv.runner.arguments import ArgumentParser

METHODS = {"fullkv": ("fullkv", {}), "snapkv": ("snapkv", dict(budget=128)),
           "kivi": ("snapkv", dict(budget=128, quant_method="kivi", nbits=4, group_size=16)),
           "kvquant": ("snapkv", dict(budget=128, quant_method="kvquant", nbits=4, group_size=16))}


def tiny_model(folder: str) -> str:
    """A 4-layer random Llama (GQA 4 / 2 heads) saved with the default model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pyramidkv import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def split_map(num_layers: int, gpu: str) -> dict[str, str]:
    """The embedding on the CPU, where dispatch_model's main device keeps the inputs: transformers 4.44.2 builds the
    causal mask on the embeddings' device from generate()'s cache_position, which stays on the main device (an
    embedding on cuda:0 with main device cpu fails there, seen on an H100, before any compression runs); lm_head
    with it (tied to it in SmolLM2: one weight, one device)."""
    half = num_layers // 2
    # model.rotary_emb named too: left out, from_pretrained's offload kept its inv_freq on cuda:0 while the position
    # ids stayed on the CPU (seen on an H100; the split placement passed there with this map otherwise).
    return {"model.embed_tokens": "cpu", "lm_head": "cpu", "model.norm": gpu, "model.rotary_emb": gpu,
            **{f"model.layers.{i}": "cpu" if i < half else gpu for i in range(num_layers)}}


def run(model, ids, mask, method, new_tokens: int, pad_id: int):
    """(greedy tokens [B, new], per layer the device its store's keys are on, the scratch devices or None);
    method None: the unpatched model."""
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad_id)
    if method is None:
        return model.generate(**settings)[:, ids.shape[1]:].cpu(), None, None
    with compress(model, method) as patch:
        cache = patch.new_cache()
        out = model.generate(past_key_values=cache, **settings)[:, ids.shape[1]:].cpu()
    devices = [str(cache.stored_kv(layer, 0)[0][1].device) for layer in range(len(cache.layers))]
    scratch = None if cache.scratch is None else sorted(str(d) for d in cache.scratch.devices())
    return out, devices, scratch


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME, help=f"'tiny', {DEFAULT_MODEL_NAME!r} or a folder")
    parser.add_argument("--prompt_tokens", type=int, default=400)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--gpu", default="cuda:0", help="the GPU half's device (cpu: a dry run of this script)")
    args = parser.parse_args(argv)
    if args.gpu != "cpu" and not torch.cuda.is_available():
        parser.error(f"--gpu {args.gpu}: no CUDA device; this check splits the model over a GPU and the CPU")
    if args.prompt_tokens < 200 or args.new_tokens < 1:
        parser.error(f"--prompt_tokens {args.prompt_tokens} / --new_tokens {args.new_tokens}: at least 200 and 1")
    from accelerate import dispatch_model

    started = time.perf_counter()
    path = tiny_model(tempfile.mkdtemp()) if args.model_path == "tiny" else args.model_path
    reference, tokenizer = load_model(path, device="cpu", dtype="float32")
    num_layers = reference.config.num_hidden_layers
    device_map = split_map(num_layers, args.gpu)
    pad = tokenizer.pad_token_id
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, len(tokenizer) - 100, (2, args.prompt_tokens), generator=generator)
    ids[1, :100] = tokenizer.pad_token_id
    mask = (torch.arange(args.prompt_tokens)[None, :] >= torch.tensor([[0], [100]])).long()
    expected = {name: run(reference, ids, mask, make_method(m, **s), args.new_tokens, pad)[0]
                for name, (m, s) in METHODS.items()}

    split, _ = load_model(path, device="cpu", dtype="float32")
    dispatch_model(split, device_map, main_device="cpu", skip_keys="past_key_values", force_hooks=True)
    offload, _ = load_model(path, device_map=device_map, dtype="float32")
    failures = []
    for placement, model in (("split", split), ("offload", offload)):
        computes = layer_devices(model)
        print(f"{placement}: layers compute on {compact(computes)}")
        unpatched = run(model, ids, mask, None, args.new_tokens, pad)[0]
        for name, (m, s) in METHODS.items():
            tokens, devices, scratch = run(model, ids, mask, make_method(m, **s), args.new_tokens, pad)
            checks = {"stores on their layers' devices": devices == computes,
                      "tokens = all-CPU " + name: torch.equal(tokens, expected[name])}
            if name == "fullkv":
                checks["tokens = unpatched"] = torch.equal(tokens, unpatched)
            if scratch is not None:
                checks["scratch per device"] = set(scratch) <= set(computes)
            bad = [what for what, ok in checks.items() if not ok]
            failures += [f"{placement} {name}: {what}" for what in bad]
            print(f"  {name:8s} stores on {compact(devices)}" + (f"; scratch on {scratch}" if scratch else "") +
                  f"; {'ok' if not bad else 'FAILED: ' + ', '.join(bad)}")
    seconds = time.perf_counter() - started
    print(f"{'PASS' if not failures else 'FAIL'}: {args.model_path} ({num_layers} layers), "
          f"{len(METHODS)} methods x 2 placements in {seconds:.0f} s" + (f"; {'; '.join(failures)}" if failures else ""))
    return 0 if not failures else 1


def compact(devices: list[str]) -> str:
    """['cuda:0', 'cuda:0', 'cpu'] -> 'cuda:0 x2, cpu x1' (runs in layer order)."""
    runs: list[list] = []
    for device in devices:
        if runs and runs[-1][0] == device:
            runs[-1][1] += 1
        else:
            runs.append([device, 1])
    return ", ".join(f"{device} x{count}" for device, count in runs)


if __name__ == "__main__":
    sys.exit(main())
