"""The default model's conversion (pyramidkv/models/default_model.py): the checkpoint it leaves is readable as any
folder save_pretrained writes under the umask, not private to its maker."""

from __future__ import annotations

import copy
import os
import stat

import pytest


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_converted_checkpoint_gets_the_permissions_open_and_mkdir_give(tiny_model_dir, tmp_path, monkeypatch,
                                                                           umask):
    """The conversion writes into a mkdtemp folder (0700) through save_pretrained (weights 0600), then renames it:
    the folder gets 0777 and every file 0666 less the umask (issue 40, item 11). The GGUF read is replaced by a tiny
    model and tokenizer: what is checked is what the conversion leaves."""
    import transformers

    from pyramidkv.models import default_model
    from tests.conftest import tiny_llama

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    model = copy.deepcopy(tiny_llama(vocab=len(tokenizer)))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    gguf = tmp_path / default_model.GGUF_FILE_NAME
    gguf.write_bytes(b"")
    old = os.umask(umask)
    try:
        out = default_model.convert_gguf_to_hf(gguf, tmp_path / "cache" / "smollm2")
    finally:
        os.umask(old)
    mode = lambda path: stat.S_IMODE(path.stat().st_mode)  # noqa: E731
    assert mode(out) == 0o777 & ~umask
    files = sorted(out.iterdir())
    assert "model.safetensors" in [p.name for p in files]
    assert {p.name: mode(p) for p in files} == {p.name: 0o666 & ~umask for p in files}
    assert os.listdir(out.parent) == [out.name]   # no temporary folder left
