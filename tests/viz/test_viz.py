"""pyramidkv.viz and examples/: figure data against independent references (the model's own eager
attention, HF's own DynamicCache keys, numpy), the notebook and example scripts executed."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from pyramidkv import load_model, make_method  # noqa: E402
from pyramidkv.viz import (  # noqa: E402
    describe_figure, plot_attention_map, plot_budget_maps, plot_kept_tokens, plot_needle_heatmap, plot_score_curve,
)
from tests.helpers import ROOT, load_script, prefill  # noqa: E402
from tests.prompts import passkey_prompt  # noqa: E402
from tests.reference import assert_same_selection, pyramid_counts, snapkv_scores_reduce_then_pool  # noqa: E402

EXAMPLES = ROOT / "examples"
PASS_KEY = 73691
PROMPT = passkey_prompt(PASS_KEY, 12)
BUDGET = 64


@pytest.fixture(scope="module")
def eager(smollm2_path):
    return load_model(smollm2_path, attn_implementation="eager", device="cpu")


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def prompt_ids(tokenizer, prompt=PROMPT) -> torch.Tensor:
    return torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])


def needle_positions(tokenizer, prompt=PROMPT, key=PASS_KEY) -> list[int]:
    """Independent of the viz code: the token positions whose decoded text holds the key's digits
    inside the two "... {key}." sentences (tokens re-decoded one by one, characters counted)."""
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    starts = [m.start() for m in re.finditer(str(key), prompt)]
    positions, pos = [], 0
    for i, t in enumerate(ids):
        piece = tokenizer.decode([t])
        if any(pos < s + len(str(key)) and pos + len(piece) > s for s in starts):
            positions.append(i)
        pos += len(piece)
    return positions


def load_example(name: str):
    return load_script(f"example_{name}", EXAMPLES / f"{name}.py")


# ---- figure data vs independent references --------------------------------------------------------
def test_kept_token_map_equals_cache_kept_positions(eager):
    model, tokenizer = eager
    method = make_method("snapkv", budget=BUDGET)
    fig, maps = plot_kept_tokens(model, tokenizer, PROMPT, [method], highlight=str(PASS_KEY))
    image = np.asarray(fig.axes[0].images[0].get_array())  # what is drawn: rows = layer x head
    cache = prefill(model, prompt_ids(tokenizer), method)
    heads = model.config.num_key_value_heads
    assert image.shape == (model.config.num_hidden_layers * heads, len(prompt_ids(tokenizer)[0]))
    for layer in range(model.config.num_hidden_layers):
        for head, expected in enumerate(cache.kept_positions(layer, 0)):
            assert np.array_equal(np.flatnonzero(image[layer * heads + head]), expected.numpy()), (layer, head)
    assert maps["snapkv"].highlight == needle_positions(tokenizer)
    info = describe_figure(fig)
    assert info["panels"] == 1 and info["finite"] and "needle" in info["markers"]


def test_kept_token_map_compares_methods_and_fullkv_is_full(eager):
    model, tokenizer = eager
    methods = {"fullkv": make_method("fullkv"), "streamingllm": make_method("streamingllm", budget=BUDGET)}
    fig, maps = plot_kept_tokens(model, tokenizer, PROMPT, methods, highlight=str(PASS_KEY))
    assert describe_figure(fig)["panels"] == 2
    assert maps["fullkv"].kept.all()  # documented: fullkv's map is the full prompt
    n = maps["fullkv"].kept.shape[-1]
    expected = sorted(set(range(4)) | set(range(n - (BUDGET - 4), n)))  # sinks + recent, by definition
    assert all(np.flatnonzero(row).tolist() == expected for row in maps["streamingllm"].rows())
    assert np.all(maps["streamingllm"].needle_survival() == 0)


@pytest.mark.parametrize("layer,heads", [(0, [0, 4, 8]), (12, None)])
def test_attention_map_equals_model_eager_attention(eager, layer, heads):
    model, tokenizer = eager
    ids = prompt_ids(tokenizer)
    with torch.no_grad():
        reference = model(ids, output_attentions=True, use_cache=False).attentions[layer][0].numpy()
    fig, data = plot_attention_map(model, tokenizer, PROMPT, layer, heads=heads, highlight=str(PASS_KEY))
    chosen = list(range(model.config.num_attention_heads)) if heads is None else heads
    assert data.weights.shape == (len(chosen),) + reference.shape[1:]
    np.testing.assert_allclose(data.weights, reference[chosen], rtol=0, atol=1e-6)
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(panels) == len(chosen)
    for ax, h in zip(panels, chosen):
        drawn = ax.images[0].get_array()
        visible = reference[h] > 1e-4
        np.testing.assert_allclose(np.ma.getdata(drawn)[visible], reference[h][visible], atol=1e-6)
        assert np.ma.getmaskarray(drawn)[np.triu_indices(reference.shape[-1], 1)].all()  # causal zeros blank
    assert data.window_start == ids.shape[1] - 32
    assert set(describe_figure(fig)["markers"]) == {"needle", "observation_window"}


def test_score_curve_matches_numpy_snapkv_and_cache(eager):
    model, tokenizer = eager
    method = make_method("snapkv", budget=BUDGET)
    ids = prompt_ids(tokenizer)
    n, w, layer = ids.shape[1], method.window_size, 12
    with torch.no_grad():
        attn = model(ids, output_attentions=True, use_cache=False).attentions[layer][0].double().numpy()
    reference = snapkv_scores_reduce_then_pool(attn, model.config.num_key_value_heads, "mean", w, 7, "max")
    for head in range(model.config.num_key_value_heads):
        fig, curve = plot_score_curve(model, tokenizer, PROMPT, method, layer, head, highlight=str(PASS_KEY))
        np.testing.assert_allclose(curve.scores[: n - w], reference[head], rtol=1e-4, atol=1e-6)
        assert_same_selection(set(curve.kept[curve.kept < n - w].tolist()), reference[head], BUDGET - w)
        cutoff_line = [ln for ln in fig.axes[0].lines if ln.get_gid() == "cutoff"]
        assert len(cutoff_line) == 1 and cutoff_line[0].get_ydata()[0] == pytest.approx(curve.cutoff)
        assert curve.cutoff == pytest.approx(np.sort(reference[head])[::-1][BUDGET - w - 1], rel=1e-4)
        plt.close(fig)


def test_budget_maps_sum_to_the_method_total(eager):
    model, tokenizer = eager
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    methods = {name: make_method(name, budget=BUDGET) for name in ("snapkv", "pyramidkv", "l2norm")}
    fig, maps = plot_budget_maps(model, tokenizer, PROMPT, methods)
    n = len(prompt_ids(tokenizer)[0])
    assert maps["snapkv"].total == L * H * BUDGET
    expected_layers = [32 + c for c in pyramid_counts(BUDGET - 32, L, 20.0)]
    assert maps["pyramidkv"].per_layer.tolist() == [H * b for b in expected_layers]
    assert maps["pyramidkv"].total == L * H * BUDGET
    assert maps["l2norm"].per_layer.tolist() == [H * n] * 2 + [H * BUDGET] * (L - 2)  # 2 skipped layers
    lines = fig.axes[0].lines
    assert [ln.get_ydata().tolist() for ln in lines] == [m.per_layer.tolist() for m in maps.values()]
    assert not any(m.ragged for m in maps.values())
    assert describe_figure(fig) == {"panels": 1, "finite": True, "markers": []}


def test_budget_maps_of_adaptive_allocations(eager):
    """AdaKV and HeadKV give heads different counts (a layer x head panel each); every allocation keeps
    exactly the uniform total; AdaKV per layer, ZigZagKV across layers."""
    model, tokenizer = eager
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    methods = {name: make_method(name, budget=BUDGET) for name in ("adakv", "headkv", "zigzagkv")}
    fig, maps = plot_budget_maps(model, tokenizer, PROMPT, methods)
    for name, m in maps.items():
        assert m.total == L * H * BUDGET, name
    assert maps["adakv"].per_layer.tolist() == [H * BUDGET] * L          # AdaKV moves budget across heads only
    assert maps["adakv"].ragged and maps["headkv"].ragged and not maps["zigzagkv"].ragged
    assert len(set(maps["zigzagkv"].per_layer.tolist())) > 1             # ZigZagKV moves it across layers
    assert describe_figure(fig)["panels"] == 3 and describe_figure(fig)["finite"]  # layer curves + 2 head panels


# ---- bad input ------------------------------------------------------------------------------------
def test_bad_inputs_name_the_value_and_what_is_allowed(eager, smollm2):
    model, tokenizer = eager
    snapkv = make_method("snapkv", budget=BUDGET)
    with pytest.raises(IndexError, match=r"layer 30 is out of range: the model has 30 layers \(0\.\.29\)"):
        plot_attention_map(model, tokenizer, PROMPT, 30)
    with pytest.raises(IndexError, match=r"head 9 is out of range: the model has 9 heads \(0\.\.8\)"):
        plot_attention_map(model, tokenizer, PROMPT, 0, heads=[9])
    with pytest.raises(IndexError, match=r"head 3 is out of range: the model has 3 heads \(0\.\.2\)"):
        plot_score_curve(model, tokenizer, PROMPT, snapkv, 0, head=3)
    with pytest.raises(IndexError, match="layer -31 is out of range"):
        plot_score_curve(model, tokenizer, PROMPT, snapkv, -31)
    with pytest.raises(ValueError, match="empty prompt"):
        plot_kept_tokens(model, tokenizer, "", [snapkv])
    with pytest.raises(ValueError, match="empty prompt"):
        plot_attention_map(model, tokenizer, [], 0)
    with pytest.raises(ValueError, match="fullkv keeps every token and has no scores"):
        plot_score_curve(model, tokenizer, PROMPT, make_method("fullkv"), 0)
    with pytest.raises(ValueError, match="highlight '99999' does not occur in the prompt"):
        plot_kept_tokens(model, tokenizer, PROMPT, [snapkv], highlight="99999")
    with pytest.raises(ValueError, match=r"label_span \(0, 9999\) must satisfy"):
        plot_attention_map(model, tokenizer, PROMPT, 0, label_span=(0, 9999))
    with pytest.raises(ValueError, match="load it with load_model\\(..., attn_implementation='eager'\\)"):
        plot_attention_map(*smollm2, PROMPT, 0)
    with pytest.raises(TypeError, match="expected pyramidkv Methods"):
        plot_kept_tokens(model, tokenizer, PROMPT, ["snapkv"])


def test_register_method_refuses_duplicates_and_non_frozen():
    from pyramidkv.methods import METHODS, Method, register_method

    with pytest.raises(ValueError, match="a method named 'snapkv' is already registered"):
        register_method(type(make_method("snapkv", budget=64)))

    class Undecorated(Method):  # no @dataclass: its settings would silently not be fields
        name = "undecorated_test_method"

    with pytest.raises(TypeError, match=r"Undecorated must be declared with @dataclass\(frozen=True\)"):
        register_method(Undecorated)

    @dataclasses.dataclass(frozen=True)
    class BadName(Method):
        name = "Bad Name"

    with pytest.raises(ValueError, match="name must be a lowercase identifier, got 'Bad Name'"):
        register_method(BadName)
    with pytest.raises(TypeError, match="register_method takes a subclass of pyramidkv Method"):
        register_method(dict)
    assert "undecorated_test_method" not in METHODS and "Bad Name" not in METHODS


# ---- needle heatmap from the same module ------------------------------------------------------------
def test_needle_heatmap_is_exposed_from_viz(tmp_path):
    run = tmp_path / "smollm2-135m_128" / "snapkv"
    run.mkdir(parents=True)
    rows = [{"context_length": c, "depth_percent": d, "rouge1_f": c / 1000 * d / 100, "recall": 1.0,
             "harness_rouge1_x10": 5.0, "harness_word_recall": 0.5} for c in (1000, 2000) for d in (0, 50, 100)]
    (run / "needle.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    fig, data = plot_needle_heatmap(run)
    expected = np.array([[c / 1000 * d / 100 for c in (1000, 2000)] for d in (0, 50, 100)])
    np.testing.assert_allclose(np.asarray(fig.axes[0].images[0].get_array()), expected)
    np.testing.assert_allclose(data.grid, expected)
    with pytest.raises(ValueError, match="unknown metric 'rouge'"):
        plot_needle_heatmap(run, metric="rouge")


# ---- examples -----------------------------------------------------------------------------------
def example_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return env


def test_custom_method_example_matches_numpy_reference(tmp_path, smollm2):
    out = tmp_path / "kept.json"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "custom_method.py"), "--out", str(out)], cwd=tmp_path,
                          env=example_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| `mean_key_distance` |" in proc.stdout  # the registry listing includes the new method
    result = json.loads(out.read_text())
    assert len(result["batch_answers"]) == 2
    # Reference: post-RoPE keys from HF's own DynamicCache of the unpatched model, scored in numpy.
    model, _ = smollm2
    ids = torch.tensor([result["prompt_ids"]])
    with torch.no_grad():
        cache = model(ids, past_key_values=DynamicCache(), use_cache=True).past_key_values
    n = ids.shape[1]
    assert len(result["allocations"]) == 8  # 3 layer x 4 head allocations, less headkv and global x pyramid, zigzag
    ragged = 0
    for label, run in result["allocations"].items():
        w = run["window_size"]
        total = 0
        for layer, heads in enumerate(run["kept"]):
            keys = cache.key_cache[layer][0].double().numpy()  # [Hkv, n, D]
            scores = np.linalg.norm(keys - keys.mean(axis=1, keepdims=True), axis=-1)
            for head, kept in enumerate(heads):
                assert kept[-w:] == list(range(n - w, n)), (label, layer, head)
                # each head keeps the best of the custom score, however many its allocation gave it
                assert_same_selection(set(kept[:-w]), scores[head, : n - w], len(kept) - w)
                total += len(kept)
            ragged += len({len(kept) for kept in heads}) > 1
        # every allocation keeps exactly the uniform total (heads x the layer budgets it reports; one budget over
        # every layer reports a layer's mean, so its total is the uniform heads x layers x budget)
        uniform = len(run["kept"][0]) * len(run["kept"]) * result["budget"]
        assert total == (uniform if "global" in label else len(run["kept"][0]) * sum(run["layer_budgets"])), label
    assert ragged > 0  # head allocations really gave heads different counts


def test_batch_generate_example():
    outputs = load_example("batch_generate").main(["--budget", "64", "--max_new_tokens", "6"])
    full, snap = outputs["fullkv"], outputs["snapkv"]
    assert full[0].text.startswith("73691") and full[1].text.startswith("40422")
    assert [o.prompt_tokens for o in full] == [o.prompt_tokens for o in snap]
    assert snap[0].kv_bytes_per_prompt < full[0].kv_bytes_per_prompt  # long prompts compressed
    assert snap[2].text == full[2].text and snap[2].kv_bytes_per_prompt == full[2].kv_bytes_per_prompt  # short: whole


def test_sweep_and_plot_example(tmp_path):
    result = load_example("sweep_and_plot").main(["--out", str(tmp_path), "--methods", "snapkv", "streamingllm",
                                                  "--budgets", "48", "96", "--num_fillers", "6"])
    rows = result["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == [("fullkv", None), ("snapkv", 48), ("snapkv", 96),
                                                          ("streamingllm", 48), ("streamingllm", 96)]
    assert rows[0]["accuracy"] == 1.0 and rows[0]["kv_fraction"] == 1.0
    assert all(r["kv_fraction"] < 1 for r in rows[1:])
    table = (tmp_path / "sweep.md").read_text().splitlines()
    assert len(table) == 2 + len(rows) and (tmp_path / "sweep.png").stat().st_size > 0
    ax = result["figure"].axes[0]
    assert describe_figure(result["figure"]) == {"panels": 1, "finite": True, "markers": []}
    assert [ln.get_ydata().tolist() for ln in ax.lines[1:]] == [[r["accuracy"] for r in rows[1:3]],
                                                                [r["accuracy"] for r in rows[3:5]]]


def test_see_what_it_keeps_example_writes_the_readme_figures(tmp_path):
    figures = load_example("see_what_it_keeps").main(["--figures_dir", str(tmp_path)])
    # budget map: the per-layer panel + one layer x head panel per allocation whose heads keep different
    # counts (adakv under uniform, pyramid and zigzag layers, headkv, and global)
    expected_panels = {"kept_tokens": 4, "attention_map": 3, "score_curve": 1, "budget_map": 6}
    for name, (fig, _) in figures.items():
        info = describe_figure(fig)
        assert info["panels"] == expected_panels[name] and info["finite"], (name, info)
        if name != "budget_map":
            assert "needle" in info["markers"], name
        assert (tmp_path / f"viz_{name}_smollm2-135m.png").stat().st_size > 0
    readme = (ROOT / "README.md").read_text()
    for name in ("kept_tokens", "attention_map"):
        assert f"docs/figures/viz_{name}_smollm2-135m.png" in readme


# ---- the notebook -----------------------------------------------------------------------------------
NOTEBOOK = EXAMPLES / "attention_maps.ipynb"


def test_notebook_is_committed_with_outputs_cleared():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_notebook_runs_top_to_bottom_with_checked_figures(smollm2_path):
    import nbformat

    from tests.notebook_runner import cell_stdout, execute_notebook

    from transformers import AutoTokenizer

    nb = execute_notebook(nbformat.read(NOTEBOOK, as_version=4), EXAMPLES)
    line = next(ln for ln in cell_stdout(nb).splitlines() if ln.startswith("FIGURE_CHECKS "))
    checks = json.loads(line.removeprefix("FIGURE_CHECKS "))
    figures = checks["figures"]
    expected_panels = {"attention_layer12": 9, "attention_layer12_needle": 3, "snapkv_scores_layer12": 1,
                       "kept_tokens": 4, "budget_map": 6}  # 1 + a head panel per ragged allocation (5)
    assert {k: v["panels"] for k, v in figures.items()} == expected_panels
    assert all(v["finite"] for v in figures.values())
    for name in ("attention_layer12", "attention_layer12_needle", "snapkv_scores_layer12", "kept_tokens"):
        assert "needle" in figures[name]["markers"], name
    assert "cutoff" in figures["snapkv_scores_layer12"]["markers"]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    # The notebook's prompt is examples/passkey.py's; the same text as tests/prompts.py's.
    assert checks["needle"] == needle_positions(tokenizer, passkey_prompt(PASS_KEY, 12))
    assert checks["prompt_tokens"] == len(tokenizer(passkey_prompt(PASS_KEY, 12), add_special_tokens=False).input_ids)
    assert set(checks["answers"]) == {"fullkv", "snapkv", "pyramidkv", "h2o", "streamingllm"}
    assert checks["answers"]["fullkv"].startswith(str(PASS_KEY))


def test_notebook_with_a_wrong_method_name_fails_with_the_notebooks_error():
    import nbformat
    from nbclient.exceptions import CellExecutionError

    from tests.notebook_runner import execute_notebook

    nb = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "METHOD_NAMES = [" in c.source)
    cell.source = cell.source.replace('"snapkv",', '"snapkvv",', 1)
    assert '"snapkvv"' in cell.source
    with pytest.raises(CellExecutionError, match="unknown method 'snapkvv'; choose one of"):
        execute_notebook(nb, EXAMPLES)
