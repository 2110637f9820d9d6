"""The runner's batches: prompts of near length together (longest first), the rows still keyed and appended
per sample, so a run stopped between batches resumes with exactly the samples missing; --decode_threads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pyramidkv.benchmarks.ruler.run import main
from pyramidkv.runner.protocol import Sample, batches


def _sample(key: int, length: int, max_new_tokens: int = 8, group=None) -> Sample:
    return Sample(key, list(range(length)), max_new_tokens, batch_group=group)


def _keys(batched: list[list[Sample]]) -> list[list[int]]:
    return [[s.key for s in batch] for batch in batched]


def test_batches_hold_prompts_of_near_length_longest_first():
    samples = [_sample(0, 5), _sample(1, 30), _sample(2, 10), _sample(3, 25), _sample(4, 20)]
    # 30 and 25 together, then 20 and 10, then 5; within a batch the given order.
    assert _keys(batches(samples, 2, by_length=True)) == [[1, 3], [2, 4], [0]]
    assert _keys(batches(samples, 4, by_length=True)) == [[1, 2, 3, 4], [0]]
    # One at a time there is no padding to save; a benchmark that does not batch by length: the given order.
    assert _keys(batches(samples, 1, by_length=True)) == [[0], [1], [2], [3], [4]]
    assert _keys(batches(samples, 2)) == [[0, 1], [2, 3], [4]]
    # Equal lengths keep their order; another max_new_tokens or batch group is another batch.
    assert _keys(batches([_sample(0, 7), _sample(1, 7), _sample(2, 7)], 2, by_length=True)) == [[0, 1], [2]]
    mixed = [_sample(0, 9), _sample(1, 50, max_new_tokens=4), _sample(2, 40), _sample(3, 3, group="b"),
             _sample(4, 60, group="b")]
    assert _keys(batches(mixed, 2, by_length=True)) == [[0, 2], [1], [3, 4]]


def test_ruler_scores_take_the_rows_in_the_samples_order(tmp_path):
    """Rows written batch by batch score as if written in index order. 16 samples of 6 references with these
    hit counts score 53.12 summed in index order, 53.13 summed in the order of `written` (the float sum of
    sixths depends on the order)."""
    from pyramidkv.benchmarks.ruler.run import SampleSet, score_run
    from pyramidkv.methods import make_method

    hits = [4, 1, 5, 2, 4, 6, 2, 0, 5, 5, 0, 0, 4, 1, 6, 6]
    written = [8, 5, 0, 9, 14, 4, 7, 12, 1, 10, 15, 11, 3, 6, 13, 2]
    assert [hits[i] for i in written] == [5, 6, 4, 5, 6, 4, 0, 4, 1, 0, 6, 0, 2, 2, 1, 5]
    words = ["amber", "birch", "cedar", "delta", "ember", "flint"]
    sample_set = SampleSet("niah_single_1", 512, [{"index": i, "outputs": words} for i in range(16)], "")
    scores = []
    for order in (range(16), written):
        folder = tmp_path / ("written" if order is written else "indexed")
        folder.mkdir()
        (folder / sample_set.file_name).write_text("".join(
            json.dumps({"index": i, "pred": " ".join(words[:hits[i]]), "outputs": words}) + "\n" for i in order))
        scores.append(score_run(folder, [sample_set], "m", make_method("snapkv", budget=64))["scores"])
    assert scores[0] == scores[1] == {"niah_single_1@512": 53.12}


def _data_file(folder: Path, lengths: list[int]) -> Path:
    """A RULER-format file whose sample i has a prompt of about lengths[i] words."""
    path = folder / "niah_single_1_512.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for index, words in enumerate(lengths):
            text = "The grass is green. " * (words // 4) + f"What is the number {index}? Answer:"
            f.write(json.dumps({"index": index, "input": text, "outputs": [str(index)], "length": 512,
                                "max_new_tokens": 4}) + "\n")
    return path


def _args(model_dir: str, data: Path, save_dir: Path, *extra: str) -> list[str]:
    return ["--model_path", model_dir, "--method", "snapkv", "--max_capacity_prompts", "64", "--device", "cpu",
            "--num_threads", "1", "--data_file", str(data), "--save_dir", str(save_dir), "--eval_batch_size", "2",
            *extra]


def _rows(save_dir: Path, model_dir: str) -> list[dict]:
    path = save_dir / f"{Path(model_dir).name}_64" / "snapkv" / "niah_single_1_512.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_stopped_between_batches_resumes_with_exactly_the_missing_samples(tiny_model_dir, tmp_path,
                                                                                monkeypatch, capsys):
    """Batched longest first, the first batch holds samples 3 and 4, not 0 and 1; after a stop there the
    rerun decodes the other three, in the batches an uninterrupted run makes, so every prediction equals that
    run's and no sample is written twice."""
    import pyramidkv.generation

    data = _data_file(tmp_path / "data", [20, 40, 60, 80, 100])
    assert main(_args(tiny_model_dir, data, tmp_path / "whole")) == 0
    whole = _rows(tmp_path / "whole", tiny_model_dir)
    assert [r["index"] for r in whole] == [3, 4, 1, 2, 0]
    assert [r["prompt_tokens"] for r in sorted(whole, key=lambda r: r["index"])] == \
        sorted(r["prompt_tokens"] for r in whole)   # the file's lengths do increase with the index

    generate = pyramidkv.generation.generate
    calls = []

    def stop_at_the_second_batch(*args, **kwargs):
        calls.append(len(args[2]))
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if the run were killed after writing its first batch
        return generate(*args, **kwargs)

    monkeypatch.setattr(pyramidkv.generation, "generate", stop_at_the_second_batch)
    with pytest.raises(KeyboardInterrupt):
        main(_args(tiny_model_dir, data, tmp_path / "stopped"))
    assert [r["index"] for r in _rows(tmp_path / "stopped", tiny_model_dir)] == [3, 4]
    monkeypatch.setattr(pyramidkv.generation, "generate", generate)
    capsys.readouterr()
    assert main(_args(tiny_model_dir, data, tmp_path / "stopped")) == 0
    printed = capsys.readouterr().out
    assert "3 sample(s) in" in printed and "2 already done" in printed
    resumed = _rows(tmp_path / "stopped", tiny_model_dir)
    assert [r["index"] for r in resumed] == [3, 4, 1, 2, 0]
    assert resumed == whole


def test_decode_threads_reach_generate_and_are_checked(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import pyramidkv.generation

    generate = pyramidkv.generation.generate
    seen = []

    def record(*args, **kwargs):
        seen.append(kwargs["decode_threads"])
        return generate(*args, **kwargs)

    monkeypatch.setattr(pyramidkv.generation, "generate", record)
    data = _data_file(tmp_path / "data", [20, 40, 60])
    assert main(_args(tiny_model_dir, data, tmp_path / "one", "--decode_threads", "1")) == 0
    assert seen == [1, 1]
    assert main(_args(tiny_model_dir, data, tmp_path / "default")) == 0
    assert seen[2:] == [None, None]
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny_model_dir, data, tmp_path / "bad", "--decode_threads", "0"))
    assert exc.value.code == 2 and "--decode_threads must be >= 1, got 0" in capsys.readouterr().err
