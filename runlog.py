"""
What a run of train.py writes and how it is read back: the records of its log.jsonl (a "start" record
with its arguments, one per topology update, one per epoch, a "summary" at the end) and the lines it
prints from them. study.py and plot.py read runs through these.
"""
import json
import os


def read_log(out):
    """The records of a run's log.jsonl (a torn last line, from a kill mid-write, is dropped)."""
    recs = []
    with open(os.path.join(out, "log.jsonl")) as f:
        for line in f:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return recs


def epoch_records(recs):
    """The records of a log that end an epoch and carry its evaluation: whole epochs and a partial last
    one (a fractional --epochs, --max-steps or a signal), every part of a resumed run in order."""
    return [r for r in recs if r["type"] in ("epoch", "partial-epoch")]


def summarize(out, total, counts=None):
    """One record for the whole run, from its log (so a resumed run counts every part)."""
    ep = epoch_records(read_log(out))
    seconds = sum(r["seconds"] for r in ep)
    images = sum(r["seconds"] * r["img_per_s"] for r in ep)
    top1 = [r["test_top1"] for r in ep]
    rec = {"type": "summary", "step": ep[-1]["step"], "total_steps": total, "final_top1": top1[-1],
           "best_top1": max(top1), "train_seconds": seconds, "img_per_s": images / seconds,
           "peak_mem_mb": max(r["peak_mem_mb"] for r in ep), "mem": ep[-1]["mem"], "density": ep[-1]["density"]}
    if "test_top1_ema" in ep[-1]:
        rec["final_top1_ema"], rec["best_top1_ema"] = ep[-1]["test_top1_ema"], max(r["test_top1_ema"] for r in ep)
    if counts:
        rec["counts"] = counts
    return rec


def show_summary(s, out):
    done = "done" if s["step"] >= s["total_steps"] else "stopped early (--max-steps)"
    mem = f"{s['peak_mem_mb']:.0f} MB {'CUDA allocator' if s['mem'].startswith('cuda') else 'process RSS'}"
    lines = [f"{done}: step {s['step']}/{s['total_steps']}, test top-1 {s['final_top1']:.4f} (best {s['best_top1']:.4f}), "
             f"{s['train_seconds']:.0f} s of training at {s['img_per_s']:.0f} img/s, peak {mem}, density {s['density']:.4f}"]
    if "final_top1_ema" in s:
        lines.append(f"average of the weights (--ema-decay): test top-1 {s['final_top1_ema']:.4f} (best {s['best_top1_ema']:.4f})")
    if "counts" in s:
        lines.append("final units per block: " + " | ".join(f"{k} " + " ".join(map(str, c)) for k, c in s["counts"].items()))
    lines.append(f"picture of this run: python plot.py {out}")
    return "\n".join(lines)


def show_counts(rec, prev):
    """'heads 1 1 0 2(+1) | mlp 77 80(-3) ...' - units per block, with the change since `prev`."""
    parts = []
    for kind, c in rec["counts"].items():
        if kind == "weights":
            continue
        old = prev.get(kind, c)
        parts.append(kind + " " + " ".join(f"{n}({n - o:+d})" if n != o else str(n) for n, o in zip(c, old)))
    moved = ", ".join(f"{v} {k}" for k, v in rec["moved"].items())
    if rec.get("traded"):
        moved += ", channels traded for a head" if rec["traded"] > 0 else ", a head traded for channels"
    return f"step {rec['step']}: moved {moved}" + (" | " + " | ".join(parts) if parts else "")
