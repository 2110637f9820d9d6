"""Compressed caches on disk (pyramidkv/generation/cache_file.py): a saved and loaded cache is the cache it was, bit for
bit (every tensor's storage bytes, unused capacity included, shared storages shared again, every object referenced as
often as before), and continues greedy decoding with exactly the logits and tokens of the original; bad files and
paths, another model, method or dtype are refused with one line.

Against the original cache itself, walked here attribute by attribute (not through the file format's own walk)."""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import pyramidkv
from pyramidkv import compress, make_method
from pyramidkv.core.cache import STORES, store_kind
from pyramidkv.core.snapshot import SHARED
from pyramidkv.generation.cache_file import read_record
from tests.methods.test_matrix import CASES as MATRIX_CASES, TokenIds, tiny  # noqa: F401 (tiny: a fixture)
from tests.methods.test_matrix import build as matrix_build, label as matrix_label

# One method per store kind and per decode-time compressor; a kind added to STORES without a case here fails below.
CASES = {
    "full_precision": dict(name="snapkv", budget=40, window_size=8),
    "quantized": dict(name="snapkv", budget=40, window_size=8, quant_method="kivi", nbits=2, group_size=8,
                      residual_length=8),
    "thin_keys": dict(name="think", budget=40, window_size=8),
    "paged": dict(name="quest", budget=40, page_size=4),
    "paired": dict(name="minicache"),
    "decode_budget": dict(name="h2o", budget=32, decode_budget=32, decode_interval=2),
    "threshold": dict(name="kvzap", window_size=8, threshold=0.0),
}
PROMPT, PAD, DECODED = 64, 5, 4


def _method(case, tables):
    settings = dict(CASES[case])
    if settings["name"] == "kvzap":
        settings["kvzap_path"] = tables["kvzap_path"]
    return make_method(settings.pop("name"), **settings)


def _batch():
    """Two prompts, the second left-padded by PAD."""
    ids = torch.randint(3, 200, (2, PROMPT), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0
    return ids, mask


def _generate(model, method, ids, mask, new, cache=None):
    with compress(model, method):
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                              do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=2)


def _continued(out, mask):
    """(input ids, attention mask) continuing a generate's output: its sequences (the last token not yet fed)."""
    seq = out.sequences
    return seq, torch.cat([mask, torch.ones(2, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)


def _raw(storage) -> torch.Tensor:
    """A storage's bytes, all of them, as a uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _same_state(a, b, pairs: dict, path="cache"):
    """Walk two states side by side: the same structure, objects paired one to one (identity kept), tensors with the
    same dtype, shape, stride and offset over storages with the same bytes (unused capacity included)."""
    if id(a) in pairs:
        assert pairs[id(a)] is b, f"{path}: an object referenced twice is two objects after loading"
        return
    if a is None or isinstance(a, (bool, int, float, str)):
        assert type(a) is type(b) and (a == b or a != a), f"{path}: {a!r} != {b!r}"
        return
    pairs[id(a)] = b
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
        sa, sb = a.untyped_storage(), b.untyped_storage()
        assert torch.equal(_raw(sa).cpu(), _raw(sb).cpu()), f"{path}: storage bytes differ"
        pairs.setdefault(("storage", sa.data_ptr(), str(a.device)), sb.data_ptr())
        assert pairs[("storage", sa.data_ptr(), str(a.device))] == sb.data_ptr(), f"{path}: storage sharing differs"
    elif isinstance(a, (list, tuple, set, frozenset)):
        assert len(a) == len(b), path
        if isinstance(a, (set, frozenset)):
            assert a == b, path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_state(x, y, pairs, f"{path}[{i}]")
    elif isinstance(a, (dict, OrderedDict)):
        assert list(a) == list(b), path
        for key in a:
            _same_state(a[key], b[key], pairs, f"{path}[{key!r}]")
    elif isinstance(a, (torch.dtype, torch.device, type)):
        assert a == b, path
    else:
        for key, value in vars(a).items():
            _same_state(value, vars(b)[key], pairs, f"{path}.{key}")


def test_every_store_kind_has_a_case(sharp_llama):
    _, _, tables = sharp_llama
    kinds = {store_kind(_method(case, tables)) for case in CASES}
    assert kinds == set(STORES)


@pytest.mark.parametrize("stage", ["prefill", "decoded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_is_bit_exact_and_decodes_on(sharp_llama, tmp_path, case, stage):
    model, _, tables = sharp_llama
    method = _method(case, tables)
    ids, mask = _batch()
    out = _generate(model, method, ids, mask, 1 if stage == "prefill" else DECODED)
    cache = out.past_key_values
    path = pyramidkv.save_cache(cache, tmp_path / "cache.safetensors", model)
    assert os.listdir(tmp_path) == ["cache.safetensors"]
    bare = pyramidkv.save_cache(cache, tmp_path / "bare.safetensors")   # without the model: its dtype still recorded
    assert read_record(bare)[0]["model"]["dtype"] == "float32"
    pyramidkv.load_cache(bare, model)
    loaded = pyramidkv.load_cache(path, model)

    assert loaded is not cache and loaded.method == method
    shared = {id(getattr(cache, name)): getattr(loaded, name) for name in SHARED if getattr(cache, name) is not None}
    pairs = dict(shared)   # what the model and the method provide: the loaded cache's own, wherever referenced
    _same_state({k: v for k, v in vars(cache).items() if k not in SHARED},
                {k: v for k, v in vars(loaded).items() if k not in SHARED}, pairs)
    assert loaded.get_seq_length() == cache.get_seq_length() == PROMPT + (0 if stage == "prefill" else DECODED - 1)
    for layer in range(len(cache.layers)):
        for b in range(2):
            for got, want in ((loaded.stored_kv(layer, b), cache.stored_kv(layer, b)),
                              (loaded.kept_kv(layer, b), cache.kept_kv(layer, b))):
                assert len(got) == len(want)
                for g, w in zip(got, want):
                    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(g, w))
    assert [loaded.kv_bytes(b) for b in range(2)] == [cache.kv_bytes(b) for b in range(2)]
    assert loaded.kv_bytes_breakdown() == cache.kv_bytes_breakdown()

    seq, seq_mask = _continued(out, mask)
    before = _generate(model, method, seq, seq_mask, 5, cache)     # the original, decoded on
    after = _generate(model, method, seq, seq_mask, 5, loaded)
    assert torch.equal(after.sequences, before.sequences)
    assert all(torch.equal(a, b) for a, b in zip(after.logits, before.logits))
    assert loaded.get_seq_length() == seq.shape[1] + 4


@pytest.fixture(scope="module")
def saved(sharp_llama, tmp_path_factory):
    """(path, model, method) of a quantized snapkv cache of the batch after a few decode steps, saved once."""
    model, _, tables = sharp_llama
    method = _method("quantized", tables)
    ids, mask = _batch()
    path = tmp_path_factory.mktemp("saved") / "cache.safetensors"
    pyramidkv.save_cache(_generate(model, method, ids, mask, DECODED).past_key_values, path, model)
    return path, model, method


def _rewritten(path, out, edit):
    """`path` written again to `out` with its record edited by `edit` (dict -> None) and the record's sha256 right."""
    import hashlib

    with safe_open(str(path), "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        metadata = f.metadata()
    record = json.loads(metadata["pyramidkv-cache"])
    edit(record)
    text = json.dumps(record)
    save_file(tensors, str(out), {"pyramidkv-cache": text, "record_sha256": hashlib.sha256(text.encode()).hexdigest()})
    return out


def _bad_file(kind, path, tmp_path):
    data = path.read_bytes()
    out = tmp_path / "bad.safetensors"
    if kind == "missing":
        return tmp_path / "none.safetensors"
    if kind == "truncated":
        out.write_bytes(data[:-10])
    elif kind == "record byte":
        (length,) = struct.unpack("<Q", data[:8])
        at = data.index(b'prompt_len', 8) + 2   # a letter of a key inside the record JSON: the JSON stays valid
        assert at < 8 + length
        out.write_bytes(data[:at] + b"X" + data[at + 1:])
    elif kind == "tensor byte":
        out.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif kind == "version":
        _rewritten(path, out, lambda record: record.update(version=1))   # made before the attention form
    elif kind == "kind":
        _rewritten(path, out, lambda record: record.update(kind="something-else"))
    return out


@pytest.mark.parametrize("kind, said", [
    ("missing", "does not exist"),
    ("truncated", "is torn"),
    ("record byte", "was edited: its record"),
    ("tensor byte", "was edited: its tensor bytes"),
    ("version", "has format version 1; this pyramidkv reads version 2 \\(compress the context again"),
    ("kind", "not a 'pyramidkv-cache' one"),
])
def test_bad_files_are_refused_with_one_line(saved, tmp_path, kind, said):
    path, model, _ = saved
    with pytest.raises(ValueError, match=said) as refusal:
        pyramidkv.load_cache(_bad_file(kind, path, tmp_path), model)
    assert "\n" not in str(refusal.value)
    pyramidkv.load_cache(path, model)   # the file itself still loads


def test_another_model_or_method_is_refused(saved, random_llama):
    path, model, method = saved
    other, _, _ = random_llama   # same shape, other weights, in memory: no folder digest
    with pytest.raises(ValueError, match="a model with other weights"):
        pyramidkv.load_cache(path, other)
    with pytest.raises(ValueError, match="holds a cache of 'snapkv:.*not of 'snapkv:budget=41"):
        pyramidkv.load_cache(path, model, method=make_method("snapkv", budget=41))
    assert pyramidkv.load_cache(path, model, method=method).method == method


def test_another_dtype_of_the_same_width_is_refused_naming_both(sharp_llama, tmp_path):
    """A cache made on the model in bfloat16, loaded on the same weights in float16 (2 bytes each, so the shape
    check's dtype_bytes agrees): refused by the dtype check, in one line naming both dtypes; the bfloat16 model
    itself loads it."""
    import copy

    model, _, tables = sharp_llama
    made_on = copy.deepcopy(model).to(torch.bfloat16)
    ids, mask = _batch()
    path = pyramidkv.save_cache(_generate(made_on, _method("full_precision", tables), ids, mask, 2).past_key_values,
                                tmp_path / "c.safetensors", made_on)
    with pytest.raises(ValueError, match="dtype bfloat16.*this model has dtype float16") as refusal:
        pyramidkv.load_cache(path, copy.deepcopy(model).to(torch.float16))
    assert "\n" not in str(refusal.value)
    pyramidkv.load_cache(path, made_on)


def test_a_cache_saved_without_the_model_is_refused_on_another_dtype(sharp_llama, tmp_path):
    """Saved without model=, the record holds the dtype of the cache's keys and values (a bfloat16 model's cache is
    refused on the float16 model, one line naming both); a file of before that, which has no dtype, by the one
    16-bit dtype its tensors hold."""
    import copy

    model, _, tables = sharp_llama
    made_on = copy.deepcopy(model).to(torch.bfloat16)
    ids, mask = _batch()
    path = pyramidkv.save_cache(_generate(made_on, _method("full_precision", tables), ids, mask, 2).past_key_values,
                                tmp_path / "c.safetensors")
    assert read_record(path)[0]["model"]["dtype"] == "bfloat16"
    older = _rewritten(path, tmp_path / "older.safetensors", lambda record: record["model"].update(dtype=None))
    for saved in (path, older):
        with pytest.raises(ValueError, match="dtype bfloat16.*this model has dtype float16") as refusal:
            pyramidkv.load_cache(saved, copy.deepcopy(model).to(torch.float16))
        assert "\n" not in str(refusal.value)
        pyramidkv.load_cache(saved, made_on)


def test_a_save_never_replaces_another_configurations_cache(sharp_llama, tmp_path):
    """Issue 40, item 3: a file holding the cache of another method, model or context is refused in one line naming
    both configurations and left as it was; the same configuration's file (a rerun, decoded further) is replaced."""
    import copy

    model, _, tables = sharp_llama
    ids, mask = _batch()
    method = _method("full_precision", tables)
    path = tmp_path / "c.safetensors"
    pyramidkv.save_cache(_generate(model, method, ids, mask, 1).past_key_values, path, model, context=ids)
    kept = path.read_bytes()
    other_ids = ids.clone()
    other_ids[0, -1] += 1
    other_model = copy.deepcopy(model)
    with torch.no_grad():
        next(other_model.parameters()).add_(1.0)
    others = [(model, make_method("h2o", budget=40, window_size=8), ids), (other_model, method, ids),
              (model, method, other_ids)]
    for on, how, context in others:
        cache = _generate(on, how, context, mask, 1).past_key_values
        with pytest.raises(ValueError, match="it holds the cache of another configuration") as refusal:
            pyramidkv.save_cache(cache, path, on, context=context)
        assert "\n" not in str(refusal.value) and path.read_bytes() == kept
    pyramidkv.save_cache(_generate(model, method, ids, mask, 3).past_key_values, path, model, context=ids)
    assert read_record(path)[0]["positions"]["held"] == PROMPT + 2


def test_a_cache_is_checked_against_the_context_it_is_used_for(saved, sharp_llama, tmp_path):
    """Issue 40, item 5: load_cache(context=) refuses a file whose context has the same lengths and other tokens
    (another generator seed's), and one saved without a context digest; its own context (given per prompt without
    the padding, or as the padded ids) loads."""
    model, _, tables = sharp_llama
    ids, mask = _batch()
    rows = [ids[0].tolist(), ids[1, PAD:].tolist()]
    path = pyramidkv.save_cache(_generate(model, _method("full_precision", tables), ids, mask, 2).past_key_values,
                                tmp_path / "c.safetensors", model, context=rows)
    for context in (rows, ids):
        pyramidkv.load_cache(path, model, context=context)
    other = [rows[0], rows[1][:-1] + [rows[1][-1] + 1]]
    for file, context, said in [(path, other, "holds another context of the same length"),
                                (path, [rows[0], rows[1][1:]], r"\(prompt 1\) has 58 tokens; the cache holds .* 59"),
                                (saved[0], rows, "records no digest of its context")]:
        with pytest.raises(ValueError, match=said) as refusal:
            pyramidkv.load_cache(file, model, context=context)
        assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("written, said", [
    ("snapkv:budget=48,window_size=8", "its layer budgets are"),
    ("quest:budget=40,page_size=4", "its store_class is"),
    ("snapkv:budget=40,window_size=8,decode_budget=40", "its decode-time compressor is"),
])
def test_a_record_rewritten_as_another_method_is_refused_by_the_state(sharp_llama, tmp_path, written, said):
    """Issue 40, item 5: a snapkv:budget=40 file whose record names another method (its sha256 recomputed, so the
    record check passes) is refused when the state lacks the layout that method gives: another budget (the layer
    budgets and kept counts), another store kind, another decode-time compressor."""
    model, _, tables = sharp_llama
    ids, mask = _batch()
    path = pyramidkv.save_cache(_generate(model, _method("full_precision", tables), ids, mask, 2).past_key_values,
                                tmp_path / "c.safetensors", model)
    out = _rewritten(path, tmp_path / "r.safetensors", lambda record: record.update(method=written))
    with pytest.raises(ValueError, match=f"is recorded as '{written}', but its state is not that method's: {said}") \
            as refusal:
        pyramidkv.load_cache(out, model)
    assert "\n" not in str(refusal.value)


def test_another_checkpoint_is_refused_by_its_content(tiny_model_dir, sharp_model_dir, tmp_path):
    """Saved without the model: the record's content digest of the model's folder tells another checkpoint apart."""
    from transformers import LlamaForCausalLM

    made_on, other = (LlamaForCausalLM.from_pretrained(d).eval() for d in (tiny_model_dir, sharp_model_dir))
    method = make_method("snapkv", budget=40, window_size=8)
    ids, mask = _batch()
    path = pyramidkv.save_cache(_generate(made_on, method, ids, mask, 2).past_key_values, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="has content .*another checkpoint"):
        pyramidkv.load_cache(path, other)
    pyramidkv.load_cache(path, made_on)


def test_bad_save_paths_and_state_are_refused_and_leave_nothing(sharp_llama, tmp_path):
    model, _, tables = sharp_llama
    ids, mask = _batch()
    cache = _generate(model, _method("full_precision", tables), ids, mask, 2).past_key_values
    for path, said in [(tmp_path / "no" / "c.safetensors", "does not exist"), (tmp_path, "is a directory")]:
        with pytest.raises(ValueError, match=said) as refusal:
            pyramidkv.save_cache(cache, path)
        assert "\n" not in str(refusal.value)
    cache.note = [1, object()]
    with pytest.raises(ValueError, match=r"cache\.note\[1\] is a builtins\.object"):
        pyramidkv.save_cache(cache, tmp_path / "c.safetensors")
    del cache.note
    if os.geteuid() != 0:   # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            pyramidkv.save_cache(cache, locked / "c.safetensors")
        assert os.listdir(locked) == []
    assert os.listdir(tmp_path) == ([] if os.geteuid() == 0 else ["locked"])


def test_devices_that_do_not_exist_here_become_the_models(saved, tmp_path):
    """A file saved from cuda:99 (its storages and the torch.device values of its state) loads onto the model's
    device; device= puts everything there."""
    path, model, _ = saved

    def elsewhere(record):
        for storage in record["storages"]:
            storage["device"] = "cuda:99"
        for entry in record["objects"]:
            if entry["$"] == "device":
                entry["name"] = "cuda:99"

    moved = _rewritten(path, tmp_path / "moved.safetensors", elsewhere)
    for cache in (pyramidkv.load_cache(moved, model), pyramidkv.load_cache(path, model, device="cpu")):
        pairs = {}
        _same_state(vars(cache), vars(cache), pairs)
        tensors = [obj for obj in pairs.values() if isinstance(obj, torch.Tensor)]
        devices = [obj for obj in pairs.values() if isinstance(obj, torch.device)]
        assert tensors and all(t.device == torch.device("cpu") for t in tensors)
        assert devices and all(d == torch.device("cpu") for d in devices)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(saved, tmp_path, monkeypatch):
    path, model, _ = saved
    target = tmp_path / "cache.safetensors"
    target.write_bytes(b"old")

    def torn(tensors, name, metadata):   # the disk fills halfway through
        with open(name, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pyramidkv.generation.cache_file.save_file", torn)
    with pytest.raises(ValueError, match="cannot save the cache to .*No space left on device") as refusal:
        pyramidkv.save_cache(pyramidkv.load_cache(path, model), target)
    assert "\n" not in str(refusal.value)
    assert os.listdir(tmp_path) == ["cache.safetensors"] and target.read_bytes() == b"old"


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_saved_cache_gets_the_permissions_open_gives(saved, tmp_path, umask):
    """Written through a temporary file and safetensors (0600 both), the cache file still gets 0666 less the umask,
    as a file open() makes (issue 40, item 11)."""
    import stat

    path, model, _ = saved
    cache = pyramidkv.load_cache(path, model)
    old = os.umask(umask)
    try:
        pyramidkv.save_cache(cache, tmp_path / "c.safetensors", model)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "c.safetensors").stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("case", MATRIX_CASES, ids=matrix_label)
def test_every_case_of_the_registry_matrix_saves_and_loads_as_its_method(tiny, case, tmp_path):
    """Every combination of the registry matrix's pairwise cover (tests/methods/test_matrix.py), a batch with a
    left-padded prompt decoded a few steps: saved with its context, it loads back (with its context) as the method
    it was made by, with the same tokens held; the layout check refuses none of them."""
    model, prompt, tables = tiny
    method = matrix_build(case, tables)    # CASES are the valid combinations (REFUSED holds the refused)
    ids = torch.tensor([prompt, [5] * 6 + prompt[6:]])
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with compress(model, method) as patch:
        cache = patch.new_cache([prompt, prompt[6:]], TokenIds()) if method.reconstructs else None
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=0, past_key_values=cache)
    path = pyramidkv.save_cache(out.past_key_values, tmp_path / "c.safetensors", model, context=ids)
    loaded = pyramidkv.load_cache(path, model, context=[prompt, prompt[6:]])
    assert loaded.method == method
    assert [loaded.held_counts(i) for i in range(len(loaded.layers)) if loaded.layers[i] is not None] == \
        [out.past_key_values.held_counts(i) for i in range(len(loaded.layers)) if loaded.layers[i] is not None]
