"""docs/leaderboard.md and its figure, made from the leaderboard CSV's rows alone (table.read_csv).

An entry's summary averages its cells over the single-question tasks (RULER's and the needle); the shared-context
protocol is reported in its own columns (turn 1, later turns). A failed or pending cell is never averaged in: the
entry shows its state, and the figure marks it.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import Optional

from pyramidkv.leaderboard.intervals import LEVEL, RESAMPLES, SEED, differences, holds_zero, paired_interval

def entries(rows: list[dict]) -> list[dict]:
    """One summary per entry (spec), in the CSV's order."""
    out: dict[str, dict] = {}
    for row in rows:
        entry = out.setdefault(row["spec"], {"spec": row["spec"], "base": row["base"], "method": row["method"],
                                             "treatment": row["treatment"], "ratio": row["ratio"], "cells": []})
        entry["cells"].append(row)
    for entry in out.values():
        cells = entry.pop("cells")
        single = [c for c in cells if c["part"] != "shared_context"]
        done = [c for c in single if c["status"] == "done"]
        states = {c["status"] for c in cells}
        entry["status"] = next((s for s in ("failed", "pending", "n/a") if s in states), "done")
        entry["errors"] = sorted({c["error"] for c in cells if c["error"]})
        entry["tasks"] = {c["task"]: c["score"] for c in single}
        entry["score"] = _mean([c["score"] for c in done]) if len(done) == len(single) else None
        entry["sample_scores"] = {c["task"]: json.loads(c["sample_scores"]) for c in done if c["sample_scores"]}
        for field in ("kl", "agreement", "kv_bytes_x_fullkv", "block_free_16", "block_free_32", "prefill_ms",
                      "decode_ms_per_token"):
            entry[field] = _mean([c[field] for c in done])
        entry["kept"] = _mean([c["kept"] for c in done]) if entry["treatment"] in ("fixed", "outcome") else \
            entry["ratio"]
        shared = next((c for c in cells if c["part"] == "shared_context"), None)
        entry["shared"] = None if shared is None else (shared["status"], shared["score_turn_1"],
                                                      shared["score_later_turns"])
        entry["samples"] = sorted({int(c["samples"]) for c in cells if c["samples"] is not None})
        entry["seconds"] = math.fsum({c["part"]: c["unit_seconds"] for c in cells if c["unit_seconds"]}.values())
    compare(list(out.values()))
    return list(out.values())


def compare(summary: list[dict]) -> None:
    """Each entry's paired intervals (intervals.py): `vs_fullkv` against fullkv, and `vs_next` against the entry
    scored next below it at the same ratio (`next`: its base spec); None where the samples are not paired."""
    full = next((e for e in summary if e["spec"] == "fullkv"), None)
    for entry in summary:
        entry["vs_fullkv"] = entry["vs_next"] = entry["next"] = None
        if full is not None and entry is not full and entry["sample_scores"] and full["sample_scores"]:
            entry["vs_fullkv"] = paired_interval(differences(entry["sample_scores"], full["sample_scores"]))
    ranked: dict[float, list[dict]] = {}
    for entry in summary:
        if entry["ratio"] is not None and entry["score"] is not None:
            ranked.setdefault(entry["ratio"], []).append(entry)
    for group in ranked.values():
        group.sort(key=lambda e: -e["score"])      # stable: equal scores keep the CSV's order
        for upper, lower in zip(group, group[1:]):
            if upper["sample_scores"] and lower["sample_scores"]:
                upper["next"] = lower["base"]   # the same ratio: the method names it
                upper["vs_next"] = paired_interval(differences(upper["sample_scores"], lower["sample_scores"]))


def _interval(interval) -> str:
    """'-12.3 [-20.0, -4.0]', with ' ≈' where the interval holds 0 (the samples cannot tell the two apart)."""
    if interval is None:
        return "-"
    mean, low, high = interval
    return f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]" + (" ≈" if holds_zero(interval) else "")


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return math.fsum(values) / len(values) if values else None


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _kl(value) -> str:
    return "-" if value is None else f"{value:.2e}"


def _next(entry: dict) -> str:
    return "-" if entry["vs_next"] is None else f"{_interval(entry['vs_next'])} vs {entry['next']}"


def figure(rows: list[dict]) -> str:
    """Against the fraction kept, on a log2 axis (32:1 to 1 kept evenly spread): the score (left, with the paired
    95 % interval of the difference from fullkv where measured), the KL from fullkv (middle) and the block-freeable
    share at 16 tokens (right, beside 1 - kept: the bytes freed): a line per method swept over ratios, a point per
    method placed at its measured share, fullkv's score as the ceiling; failed entries as red crosses on the axis.
    The SVG's text, with fixed metadata, so the same CSV gives the same bytes."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    matplotlib.rcParams.update({"svg.hashsalt": "pyramidkv-leaderboard", "svg.fonttype": "path"})
    summary = entries(rows)
    fig, (left, right, blocks) = plt.subplots(1, 3, figsize=(19, 5.2))
    lines: dict[str, list[dict]] = {}
    for entry in summary:
        lines.setdefault(entry["base"], []).append(entry)
    cmap = plt.get_cmap("tab20")
    for i, (base, group) in enumerate(lines.items()):
        color = cmap(i % 20)
        ok = [e for e in group if e["status"] == "done" and e["kept"] is not None]
        failed = [e for e in group if e["status"] == "failed"]
        if base == "fullkv":
            for e in ok:
                left.axhline(e["score"], color="black", linestyle="--", linewidth=1, label="fullkv (ceiling)")
            continue
        style = dict(color=color, marker="o", markersize=4, linewidth=1.2,
                     linestyle=":" if group[0]["treatment"] == "read" else "-")
        label = base + (" (fraction read)" if group[0]["treatment"] == "read" else "")
        ok.sort(key=lambda e: e["kept"])
        if ok:
            left.plot([e["kept"] for e in ok], [e["score"] if e["score"] is not None else math.nan for e in ok],
                      label=label, **style)
            right.plot([e["kept"] for e in ok], [e["kl"] if e["kl"] is not None else math.nan for e in ok], **style)
            paired = [e for e in ok if e["vs_fullkv"] is not None and e["score"] is not None]
            if paired:        # the paired interval of the difference from fullkv, drawn around the score
                left.errorbar([e["kept"] for e in paired], [e["score"] for e in paired], fmt="none", ecolor=color,
                              capsize=3, linewidth=0.8,
                              yerr=[[e["vs_fullkv"][0] - e["vs_fullkv"][1] for e in paired],
                                    [e["vs_fullkv"][2] - e["vs_fullkv"][0] for e in paired]])
            freed = [e for e in ok if e["block_free_16"] is not None]
            if freed:
                blocks.plot([e["kept"] for e in freed], [e["block_free_16"] for e in freed], **style)
        for e in failed:
            x = e["ratio"] if e["ratio"] is not None else 1.0
            left.plot([x], [0], marker="x", color="red", markersize=8, linestyle="none")
    left.plot([], [], marker="x", color="red", linestyle="none", label="failed cell")
    left.set(xlabel="fraction of the prompt kept (log scale; compression_ratio = 1 - it)",
             ylabel="mean score (0-100)", title="score vs fraction kept")
    right.set(xlabel="fraction of the prompt kept", ylabel="mean KL from fullkv (nats / token)",
              title="KL divergence from fullkv (teacher forced)")
    right.set_yscale("symlog", linthresh=1e-4)
    kept = [k / 256 for k in range(1, 257)]
    blocks.plot(kept, [1 - k for k in kept], color="black", linestyle="--", linewidth=1,
                label="1 - kept (bytes freed)")
    blocks.set(xlabel="fraction of the prompt kept", ylabel="share of 16-token blocks freeable",
               title="paged engine: blocks no head holds (block 16)", ylim=(-0.03, 1.03))
    left.set_ylim(-3, 103)
    for axis in (left, right, blocks):     # a log axis: 32:1 and 16:1 as far apart as 4:1 and 2:1
        axis.set_xscale("log", base=2)
        axis.set_xlim(1 / 48, 1.15)
        axis.set_xticks(TICKS, [str(Fraction(t)) for t in TICKS])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axis.grid(alpha=0.3)
    fig.legend(*left.get_legend_handles_labels(), loc="center right", fontsize=7, frameon=False)
    fig.subplots_adjust(right=0.85, wspace=0.25)
    out = io.StringIO()
    fig.savefig(out, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return out.getvalue()


def page(rows: list[dict], csv_name: str, figure_name: str, command: str) -> str:
    """The markdown page."""
    summary = entries(rows)
    first = rows[0] if rows else {}
    tasks = list(dict.fromkeys(r["task"] for r in rows if r["part"] != "shared_context"))
    samples = sorted({int(r["samples"]) for r in rows if r["samples"] is not None})
    seconds = math.fsum(e["seconds"] for e in summary)
    cells = len(rows)
    states = {s: sum(1 for r in rows if r["status"] == s) for s in ("done", "failed", "pending", "n/a")}
    commits = sorted({r["git_commit"] for r in rows if r["git_commit"]})
    versions = sorted({f"torch {r['torch']}, transformers {r['transformers']}" for r in rows if r["torch"]})
    out = [
        "# Leaderboard",
        "",
        "<!-- generated by `python -m pyramidkv.leaderboard --summarize` from the CSV below; do not edit -->",
        "",
        f"Model `{first.get('model')}`, {int(first['context_length']) if first.get('context_length') else '-'} "
        f"tokens per context, samples per cell: {', '.join(str(s) for s in samples) or '-'}; "
        f"{cells} cells ({states['done']} done, {states['failed']} failed, {states['pending']} pending"
        + (f", {states['n/a']} n/a" if states["n/a"] else "") + "); "
        f"wall time of the runs: {seconds / 3600:.2f} h ({seconds / max(len(summary), 1):.0f} s per entry on average).",
        f"Tasks: {', '.join(tasks)}; shared context: {'shared_context' in {r['part'] for r in rows} and 'yes' or 'no'}.",
        f"Versions: {'; '.join(versions) or '-'}; git commit: {', '.join(commits) or '-'}.",
        "",
        f"Regenerate: `{command}`. Every cell: [{csv_name}]({csv_name}).",
        "",
        f"![score and KL vs fraction kept]({figure_name})",
        "",
        "`kept`: the fraction of the prompt kept (kvpress's compression_ratio = 1 - kept); for methods that take no "
        "ratio, the measured share (bytes held x fullkv, or the achieved kept share of a threshold); quest's is the "
        "fraction of pages read per step, its cache holds every token. `score`: the mean over the single-question "
        "tasks; `KL`: mean KL divergence of the next-token distribution from fullkv's over the reference answers, "
        "teacher forced; `agree`: the greedy answer's common prefix with fullkv's; `bytes`: K/V bytes held x "
        "fullkv's; `shared`: the shared-context protocol's turn 1 / later turns (compress once, ask "
        f"{SHARED_QUESTIONS_TEXT}). `free@16`, `free@32`: the share of the full cache's blocks of 16 (32) tokens in "
        "which no head of a layer holds a token when the answer ended: what a paged engine could return to its pool "
        "without compacting (docs/serving.md). `vs fullkv`: the score's difference from fullkv's on the same "
        f"samples with its paired bootstrap {LEVEL:.0%} interval ({RESAMPLES} resamples within each task, numpy "
        f"default_rng({SEED}); leaderboard/intervals.py); `vs next`: the same against the entry scored next below at "
        "the same ratio (named); ≈ marks an interval that holds 0: the samples cannot tell the two apart. "
        "`-`: not measured (cells run before a column existed, or one sample per cell for the intervals). `n/a`: "
        "the method cannot do what its settings say on a prompt of this length (a budget below its window): its "
        "runner refuses the cell, never runs it with an emptied or skipped compression.",
        "",
        "| entry | kept | score | vs fullkv | " + " | ".join(tasks) + " | vs next | KL | agree | bytes | free@16 | "
        "free@32 | prefill ms | decode ms/token | shared | state |",
        "|---|---|---|---|" + "---|" * len(tasks) + "---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in summary:
        shared = "-" if e["shared"] is None else (
            f"{_fmt(e['shared'][1], 0)} / {_fmt(e['shared'][2], 0)}" if e["shared"][0] == "done" else e["shared"][0])
        state = e["status"] + (f": {e['errors'][0]}" if e["errors"] else "")
        out.append(f"| {e['spec'] if e['ratio'] is None else e['base'] + ' @ ' + format(e['ratio'], 'g')} | "
                   f"{_fmt(e['kept'], 2)} | {_fmt(e['score'])} | {_interval(e['vs_fullkv'])} | "
                   + " | ".join(_fmt(e["tasks"].get(t), 0) for t in tasks)
                   + f" | {_next(e)} | {_kl(e['kl'])} | {_fmt(e['agreement'], 2)} | {_fmt(e['kv_bytes_x_fullkv'], 2)} | "
                   f"{_fmt(e['block_free_16'], 2)} | {_fmt(e['block_free_32'], 2)} | {_fmt(e['prefill_ms'], 0)} | "
                   f"{_fmt(e['decode_ms_per_token'], 0)} | {shared} | {state.replace('|', '/')} |")
    return "\n".join(out) + "\n"


TICKS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)       # labelled as fractions: 1/32 ... 1
SHARED_QUESTIONS_TEXT = "4 questions of RULER's niah_multikey_1 per context"
