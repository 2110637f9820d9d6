"""--kl_vs_fullkv in the runners: refused where it cannot measure, and the reference answer as it follows the
prompt."""

import pytest
from transformers import AutoTokenizer

from pyramidkv.benchmarks.ruler.run import main as ruler
from pyramidkv.runner.divergence import reference_text


@pytest.mark.parametrize("flags, message", [
    (["--shared_context", "multi_request"], "leave out --shared_context"),
    (["--question_as_decode"], "leave out --question_as_decode"),
    (["--eval_batch_size", "2"], "--eval_batch_size must be 1, got 2"),
    (["--questions_per_context", "2", "--tasks", "niah_multikey_1"], "asks several questions"),
])
def test_what_it_cannot_measure_is_refused_in_one_line(tiny_model_dir, tmp_path, capsys, flags, message):
    tasks = [] if "--tasks" in flags else ["--tasks", "niah_single_1"]
    with pytest.raises(SystemExit) as exit_:
        ruler(["--model_path", tiny_model_dir, "--method", "snapkv", "--max_capacity_prompts", "32", *tasks,
               "--context_lengths", "512", "--num_samples", "1", "--save_dir", str(tmp_path), "--kl_vs_fullkv",
               *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err


def test_the_reference_follows_the_prompt_as_an_answer_would(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ends_in_word = tokenizer("The special magic number is", add_special_tokens=False).input_ids
    ends_in_newline = tokenizer("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    assert reference_text(tokenizer, ends_in_word, "1234567") == " 1234567"
    assert reference_text(tokenizer, ends_in_newline, "The best thing") == "The best thing"
    assert reference_text(tokenizer, ends_in_word, " 42") == " 42"


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_fullkv_reference_files_get_the_permissions_open_gives(tmp_path, umask):
    """The leaderboard's fullkv reference (safetensors through a temporary name: 0600 both) gets 0666 less the
    umask, as results do (issue 40, item 11)."""
    import os
    import stat

    import torch

    from pyramidkv.runner.divergence import FullkvReference

    reference = FullkvReference(tmp_path / "fullkv_reference", {"model": "m"})
    old = os.umask(umask)
    try:
        reference.write([1, 2, 3], [4, 5], torch.zeros(2, 7))
    finally:
        os.umask(old)
    path = reference.path([1, 2, 3], [4, 5])
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert reference.read([1, 2, 3], [4, 5]).shape == (2, 7) and os.listdir(path.parent) == [path.name]
