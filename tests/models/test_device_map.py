"""A model spread over devices by accelerate (load_model's device_map, the runners' --device_map), on the CPU.

The CPU has one device, so what these tests can show is the path: the model loaded through
from_pretrained(device_map=...) and accelerate's dispatch with its hooks attached (one on an attention module
mapped alone, whose forward accelerate wraps), patched and generating the same greedy tokens as the plain load,
with the map recorded in run_meta.json. The split over a GPU and the CPU is scripts/device_map_check.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import dispatch_model

from pyramidkv import compress, load_model, make_method
from pyramidkv.generation import generate
from pyramidkv.quantization.kernels import Scratch

# label -> (method, settings)
METHODS = {"fullkv": ("fullkv", {}), "snapkv": ("snapkv", dict(budget=48, window_size=8)),
           "kivi": ("snapkv", dict(budget=48, window_size=8, quant_method="kivi", nbits=4, group_size=16,
                                   residual_length=16))}


def every_module_on_cpu(model) -> dict[str, str]:
    """A map naming each decoder layer, the embedding, the final norm and lm_head, all on the CPU; layer 0's
    attention mapped on its own, so accelerate hooks that module too."""
    layers = {f"model.layers.{i}": "cpu" for i in range(model.config.num_hidden_layers)}
    return {"model.embed_tokens": "cpu", "model.layers.0.self_attn": "cpu", **layers, "model.norm": "cpu",
            "lm_head": "cpu"}


def prompts(tokenizer) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(10, len(tokenizer) - 10, (n,), generator=generator).tolist() for n in (160, 120)]


@pytest.fixture(scope="module")
def loads(tiny_model_dir):
    """(plain model, tokenizer, model loaded with an all-CPU map, model dispatched with hooks forced)."""
    plain, tokenizer = load_model(tiny_model_dir, device="cpu")
    device_map = every_module_on_cpu(plain)
    mapped, _ = load_model(tiny_model_dir, device_map=device_map)
    hooked, _ = load_model(tiny_model_dir, device="cpu")
    dispatch_model(hooked, device_map, force_hooks=True, skip_keys="past_key_values")
    return plain, tokenizer, mapped, hooked


@pytest.mark.parametrize("name", list(METHODS))
def test_a_device_mapped_model_generates_the_plain_models_tokens(loads, name):
    """fullkv, snapkv and KIVI give the plain load's greedy tokens on the model loaded with a device map and on
    the one dispatched with accelerate's hooks (the attention module accelerate wraps is the one patched:
    left unpatched, its layer would call the compressed cache's update and fail)."""
    plain, tokenizer, mapped, hooked = loads
    assert mapped.hf_device_map == every_module_on_cpu(plain)
    attention = hooked.model.layers[0].self_attn
    assert hasattr(attention, "_hf_hook")
    method = make_method(METHODS[name][0], **METHODS[name][1])
    batch = prompts(tokenizer)
    expected = generate(plain, tokenizer, batch, method, max_new_tokens=8, stop_token_ids=[])
    calls = []
    hook = attention._hf_hook
    hook.pre_forward = lambda module, *args, pre=hook.pre_forward, **kwargs: calls.append(1) or pre(module, *args,
                                                                                                     **kwargs)
    try:
        for model in (mapped, hooked):
            got = generate(model, tokenizer, batch, method, max_new_tokens=8, stop_token_ids=[])
            assert [(g.text, g.kv_bytes_per_prompt) for g in got] == [(g.text, g.kv_bytes_per_prompt)
                                                                       for g in expected]
    finally:
        del hook.pre_forward
    assert len(calls) == 8    # the hook that brings the module's inputs to its device ran at every step
    # leaving compress() gives accelerate its wrapped forward back
    wrapped = attention.forward
    with compress(hooked, method):
        pass
    assert attention.forward == wrapped and "_old_forward" in attention.__dict__


def test_scratch_buffers_are_per_device():
    """A buffer taken for one device is not replaced by a request for another (each device's layers keep theirs)."""
    scratch = Scratch()
    first = scratch.take("levels", (4, 8), torch.float32, torch.device("cpu"))
    meta = scratch.take("levels", (4, 8), torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and scratch.take("levels", (4, 8), torch.float32, torch.device("cpu")) is first
    assert scratch.devices() == {torch.device("cpu"), torch.device("meta")}


def test_device_map_flag_is_checked_and_recorded(tiny_model_dir, tmp_path, capsys):
    """--device_map: a JSON file's map is recorded in run_meta.json (with where accelerate placed each module);
    given with --device, or naming no module of the model, it is refused in one line before weights load."""
    from pyramidkv.benchmarks.ruler import run as RU

    plain, _ = load_model(tiny_model_dir, device="cpu")
    path = tmp_path / "map.json"
    path.write_text(json.dumps(every_module_on_cpu(plain)))
    common = ["--model_path", tiny_model_dir, "--method", "snapkv", "--max_capacity_prompts", "64", "--num_threads",
              "1", "--tasks", "niah_single_1", "--context_lengths", "512", "--num_samples", "1"]
    assert RU.main([*common, "--save_dir", str(tmp_path / "out"), "--device_map", str(path)]) == 0
    meta = json.loads(next(Path(tmp_path / "out").rglob("run_meta.json")).read_text())
    assert meta["arguments"]["device_map"] == every_module_on_cpu(plain)
    assert meta["fingerprint"]["arguments"]["device_map"] == every_module_on_cpu(plain)
    assert meta["device_map_placed"] == every_module_on_cpu(plain)
    for extra, says in ((["--device", "cpu", "--device_map", "auto"], "leave device at 'auto'"),
                        (["--device_map", '{"model.layer.0": "cpu", "": "cpu"}'], "'model.layer.0', which is no"),
                        (["--device_map", "everywhere"], "'everywhere' is neither a strategy")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            RU.main([*common, "--save_dir", str(tmp_path / "refused"), *extra])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err, err


def test_a_minicache_pair_across_two_devices_is_refused(loads):
    """Layers 0 and 1 share MiniCache's storage: computing on two devices (layer 1's hook says meta here) is
    refused in one line naming both; on one device the patch applies."""
    from pyramidkv.models.patch import layer_devices

    _, _, _, hooked = loads
    method = make_method("minicache", cross_layer_start=0)
    with compress(hooked, method):
        pass
    hook = hooked.model.layers[1]._hf_hook
    kept, hook.execution_device = hook.execution_device, torch.device("meta")
    try:
        assert layer_devices(hooked) == ["cpu", "meta"]
        with pytest.raises(ValueError, match=r"^minicache: layers 0 and 1 share one storage but compute on cpu and "
                                             r"meta; set cross_layer_start"):
            compress(hooked, method)
    finally:
        hook.execution_device = kept
