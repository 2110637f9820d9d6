"""An installed (non-editable) pyramidkv works without the source checkout: every module imports, the
packaged data is found, and the needle heatmap is drawn from a results folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_installed_package_imports_every_module_and_draws_the_needle_heatmap(tmp_path, smollm2_path):
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT / "pyramidkv", source / "pyramidkv", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", source)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(target), str(source)], check=True, capture_output=True)
    assert not (target / "pyramidkv" / "__editable__").exists() and (target / "pyramidkv" / "__init__.py").is_file()

    run_dir = tmp_path / "results" / "smollm2-135m_128" / "snapkv"
    run_dir.mkdir(parents=True)
    rows = [{"context_length": n, "depth_percent": d, "rouge1_f": (n + d) / 2000, "recall": 1.0,
             "harness_rouge1_x10": 5.0, "harness_word_recall": 0.5} for n in (500, 1000) for d in (0, 50, 100)]
    (run_dir / "needle.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "heatmap.png"

    # -S: no site-packages processing, so the checkout's editable install is not active; the installed copy
    # comes first on the path, then the environment's other packages (torch, transformers, ...).
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(target)!r}, {sysconfig.get_paths()["purelib"]!r}]
        import importlib, pkgutil
        import pyramidkv
        assert pyramidkv.__file__.startswith({str(target)!r}), pyramidkv.__file__
        names = [m.name for m in pkgutil.walk_packages(pyramidkv.__path__, "pyramidkv.")
                 if not m.name.endswith("__main__")]
        for name in names:
            importlib.import_module(name)
        from pyramidkv.allocation.head_tables import default_head_scores_path
        assert str(default_head_scores_path({smollm2_path!r})).startswith({str(target)!r})   # by content: models.json
        from pyramidkv.allocation.base import ModelShape
        from pyramidkv.methods.calibrated import model_artifact
        for kind in ("kvzap-linear", "qfilter", "kvzip-head"):   # packaged calibration files
            model_artifact(kind, None, ModelShape(30, 9, 3, {smollm2_path!r}))
        import pyramidkv.native as native                              # the packaged C sources build
        for source in (*native.SOURCES, native.HEADER):
            assert source.is_file() and source.is_relative_to({str(target)!r}), source
        assert native.status() == "on", native.status()
        from pyramidkv.viz.needle import plot_run
        print(len(names), plot_run({str(run_dir)!r}, {str(out)!r}, annotate=True))
    """)
    done = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr
    count, written = done.stdout.split()
    assert int(count) > 60 and Path(written) == out and out.stat().st_size > 10_000
