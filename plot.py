"""
Pictures from the files the project writes (matplotlib, no display needed).

  python plot.py runs/A [runs/B ...] [-o runs.png]   where the capacity went (units per block at every
                                                     topology update), test top-1 and train loss per
                                                     epoch, img/s and peak memory of each run
  python plot.py bench.json [-o bench.png]           speedup over masked (ideal FLOP ratio dashed) and
                                                     peak memory against density, per model
"""
import json
import os
import sys
from dataclasses import dataclass
from typing import Annotated, Optional

import matplotlib
import tyro

matplotlib.use("Agg")  # files only: works on a server with no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

import bench  # noqa: E402
import runlog  # noqa: E402
import train  # noqa: E402

KINDS = ("heads", "mlp")


@dataclass
class Args:
    paths: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="PATH")]
    """run folders (each with a log.jsonl), or one bench.json"""
    out: Annotated[Optional[str], tyro.conf.arg(aliases=("-o",))] = None
    """PNG to write (None: runs.png in the first run folder, or bench.png next to the bench file)"""


class PlotError(ValueError):
    pass


# ---- reading -----------------------------------------------------------------------------------

def load_run(path):
    """A run folder's records, with what the plots need to label it."""
    if not os.path.isdir(path):
        raise PlotError(f"{path} is not a folder")
    if not os.path.isfile(os.path.join(path, "log.jsonl")):
        raise PlotError(f"{path} has no log.jsonl: not a run folder of train.py")
    recs = runlog.read_log(path)
    start = next((r for r in recs if r["type"] == "start"), None)
    if start is None:
        raise PlotError(f"{path}/log.jsonl has no start record: written by an older train.py, or not by train.py")
    a = start["args"]
    label = f"{a['method']} d={a['dense_frac']} s={a['seed']}" if a["method"] != "dense" else f"dense s={a['seed']}"
    return {"path": path, "label": label, "method": a["method"], "start": start, "records": recs,
            "epochs": runlog.epoch_records(recs)}


def epoch_positions(epochs):
    """Where each epoch record sits on the epoch axis: a partial epoch (a fractional --epochs, a run
    cut by --max-steps or a signal) at its fraction, by the steps of a whole one."""
    spe = next((r["step"] // r["epoch"] for r in epochs if r["type"] == "epoch"), None)
    return [r["step"] / spe if spe else r["epoch"] for r in epochs]


def allocation(records):
    """(steps, {kind: [[units of block i at that step] per step]}) from the start record and every
    topology update: the data behind the allocation map."""
    start = next(r for r in records if r["type"] == "start")
    points = [(0, start["counts"])] + [(r["step"], r["counts"]) for r in records
                                       if r["type"] == "update" and set(KINDS) <= set(r["counts"])]
    return [s for s, _ in points], {k: [c[k] for _, c in points] for k in KINDS}


def load_bench(path):
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PlotError(f"{path} is not a readable JSON file ({type(e).__name__})") from None
    if not isinstance(res, dict) or not isinstance(res.get("rows"), list) or not res["rows"] or "machine" not in res:
        raise PlotError(f"{path} is not a bench.py result (it needs 'machine' and a non-empty list of 'rows')")
    return res


# ---- drawing -----------------------------------------------------------------------------------

def draw_allocation(fig, axes, run):
    steps, counts = allocation(run["records"])
    dense = run["start"]["dense"]
    for ax, kind in zip(axes, KINDS):
        grid = [list(col) for col in zip(*counts[kind])]  # (blocks, updates)
        top = max(max(row) for row in grid) or 1
        # colours span 0 .. the largest count (at low density the dense width would leave them all dark)
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=top, interpolation="nearest")
        if len(steps) <= 40 and len(grid) <= 24:  # small enough to print every count
            for b, row in enumerate(grid):
                for j, v in enumerate(row):
                    ax.text(j, b, str(v), ha="center", va="center", fontsize=6, color="white" if v < 0.6 * top else "black")
        ax.set_xticks(range(len(steps)))
        ax.set_xticklabels([str(s) for s in steps], rotation=90, fontsize=6)
        ax.set_yticks(range(len(grid)))
        ax.set_xlabel("step (topology updates)")
        ax.set_ylabel("block")
        ax.set_title(f"{run['label']}: {'heads' if kind == 'heads' else 'MLP channels'} per block", fontsize=9)
        bar = fig.colorbar(im, ax=ax, ticks=MaxNLocator(integer=True))  # unit counts: no 0.25 of a head
        bar.set_label(f"units per block (dense width {dense[kind]})", fontsize=8)


def draw_runs(runs, out):
    mapped = [r for r in runs if r["method"] in train.UNIT_METHODS]
    rows = len(mapped) + 2
    fig, ax = plt.subplots(rows, 2, figsize=(12, 3.2 * rows), squeeze=False)
    for i, run in enumerate(mapped):
        draw_allocation(fig, ax[i], run)
    top, loss = ax[len(mapped)]
    for run in runs:
        ep = run["epochs"]
        x = epoch_positions(ep)
        top.plot(x, [r["test_top1"] for r in ep], marker="o", label=run["label"])
        loss.plot(x, [r["train_loss"] for r in ep], marker="o", label=run["label"])
    for a, name in ((top, "test top-1"), (loss, "train loss")):
        a.set_xlabel("epoch")
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.set_ylabel(name)
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    speed, mem = ax[len(mapped) + 1]
    labels = [r["label"] for r in runs]
    for a, key, name in ((speed, "img_per_s", "img/s (mean over epochs)"), (mem, "peak_mem_mb", "peak memory MB")):
        vals = [max((e[key] for e in r["epochs"]), default=0) if key == "peak_mem_mb" else
                (sum(e[key] for e in r["epochs"]) / len(r["epochs"]) if r["epochs"] else 0) for r in runs]
        bars = a.bar(range(len(runs)), vals, color=[f"C{i}" for i in range(len(runs))])
        a.bar_label(bars, fmt="%.0f", fontsize=7)
        a.set_xticks(range(len(runs)))
        a.set_xticklabels(labels, rotation=20, ha="right", fontsize=7)
        a.set_ylabel(name)
    if runs and runs[0]["epochs"]:
        mem.set_title(f"memory: {runs[0]['epochs'][-1]['mem']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def draw_bench(res, out):
    models = sorted({r["model"] for r in res["rows"]})
    fig, ax = plt.subplots(len(models), 2, figsize=(11, 3.8 * len(models)), squeeze=False)
    device = res["machine"].get("device", "?")
    for (sp, mem), model in zip(ax, models):
        rows = [r for r in res["rows"] if r["model"] == model]
        # bench.label: a barter run's start and end splits (bench.py --runs) are two series
        methods = [m for m in dict.fromkeys(bench.label(r) for r in rows)]
        for i, m in enumerate(methods):
            mine = sorted((r for r in rows if bench.label(r) == m), key=lambda r: r["density"])
            d = [r["density"] for r in mine]
            if all("peak_mem_mb" in r for r in mine):  # absent after bench.py --no-memory
                mem.plot(d, [r["peak_mem_mb"] for r in mine], marker="o", color=f"C{i}", label=m)
            if m not in ("masked", "dense"):
                sp.plot(d, [r["speedup_vs_masked"] for r in mine], marker="o", color=f"C{i}", label=f"{m} (measured)")
                sp.plot(d, [r["ideal_speedup"] for r in mine], linestyle="--", marker="x", color=f"C{i}", label=f"{m} ideal (FLOPs)")
        sp.axhline(1.0, color="gray", linewidth=1)
        sp.set_title(f"{model} on {device}: speedup over masked per step", fontsize=9)
        measured = any("peak_mem_mb" in r for r in rows)
        mem.set_title(f"{model} on {device}: peak memory" + ("" if measured else " (not measured)"), fontsize=9)
        for a, name in ((sp, "speedup vs masked (x)"), (mem, "peak memory MB")):
            a.set_xlabel("density")
            a.set_ylabel(name)
            a.grid(alpha=0.3)
            if a.get_legend_handles_labels()[0]:  # nothing drawn without memory numbers
                a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main(a):
    if not a.paths:
        raise PlotError("give run folders, or one bench.json")
    if len(a.paths) == 1 and os.path.isfile(a.paths[0]):
        out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.paths[0])), "bench.png")
        draw_bench(load_bench(a.paths[0]), out)
    else:
        runs = [load_run(p) for p in a.paths]
        out = a.out or os.path.join(a.paths[0], "runs.png")
        draw_runs(runs, out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
