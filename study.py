"""
Accuracy study: methods x densities x seeds, every run through train.main with one set of shared
arguments, then one markdown table. `python study.py` runs the README's protocol (Fashion-MNIST,
tiny-28). Finished runs are skipped and interrupted ones resumed from their checkpoint, so a study
that is stopped (Ctrl-C, a reboot) continues where it was when started again with the same command.

Writes, under --out: one folder per run (train.py's log.jsonl and checkpoint.pt), results.md (the
tables), curves.json (every run's per-epoch records) and equal_time.json (the epochs chosen for the
equal wall-clock runs, fixed once measured so that a resumed study reuses them).
"""
import itertools
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import statistics
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from tqdm import tqdm

import runlog
import train
from train import Args as TrainArgs


def protocol():
    """The README's study: Fashion-MNIST (offline from the Debian package), the 28 px preset and a short
    schedule, so that the whole grid runs in about an hour on a 2-core CPU; no augmentation, which in 3
    epochs only slows learning down."""
    return train.Args(model="tiny-28", data="fashion-mnist", epochs=3, warmup_epochs=1, lr=3e-3, augment=False,
                      update_every=50)


@dataclass
class Args:
    methods: tuple[str, ...] = ("dense", "static", "masked", "rigl", "barter")
    """methods to run (dense once per seed, at density 1)"""
    densities: tuple[float, ...] = (0.1, 0.3, 0.5)
    """densities for every method but dense"""
    seeds: tuple[int, ...] = (0, 1, 2)
    """seeds; every number in the tables is a mean over them with the min-max beside it"""
    equal_time: Optional[tuple[str, ...]] = None
    """methods also run for as long as `masked` trained at the same density (the epochs that fit in its time, to a hundredth, same recipe); by default barter if masked runs, else none (a bare --equal-time names none)"""
    out: str = "runs/study"
    """folder for the runs and the tables"""
    jobs: int = 1
    """runs at once, each with cores/jobs threads; above 1 the runs share the machine, so their times are contended"""
    train: TrainArgs = field(default_factory=protocol)
    """arguments shared by every run (--train.epochs 5 ...); method, density, seed and out-dir are set per run"""

    def __post_init__(self):
        if self.equal_time is None:  # derived from --methods: masked's time is what the equal-time runs get
            self.equal_time = ("barter",) if "masked" in self.methods else ()


def run_name(method, density, seed, suffix=""):
    return (f"dense-s{seed}" if method == "dense" else f"{method}-d{density}-s{seed}") + suffix


def finished(out):
    """The summary record of a completed run, or None. It carries the run's evaluations as `clock`:
    (training seconds so far, test top-1) after each epoch, the clock counted as the summary counts it."""
    try:
        recs = runlog.read_log(out)
    except FileNotFoundError:
        return None
    done = [r for r in recs if r["type"] == "summary" and r["step"] >= r["total_steps"]]
    if not done:
        return None
    ep = runlog.epoch_records(recs)
    return {**done[-1], "clock": list(zip(itertools.accumulate(r["seconds"] for r in ep), (r["test_top1"] for r in ep)))}


def execute(args, threads=None, log_file=None):
    """One run through train.main, resumed from its checkpoint if it has one. Returns an error or None;
    raises KeyboardInterrupt if a signal stopped the run (train.py then saves a checkpoint and returns
    without the summary record that ends every finished or --max-steps run)."""
    if threads:
        torch.set_num_threads(threads)
    ckpt = os.path.join(args.out_dir, "checkpoint.pt")
    if os.path.exists(ckpt):
        args = replace(args, resume=ckpt)
    try:
        if log_file is None:
            train.main(args)
        else:
            with open(log_file, "a") as f, redirect_stdout(f), redirect_stderr(f):
                train.main(args)
    except (Exception, SystemExit) as e:  # one broken run must not end the study
        return f"{type(e).__name__}: {e}"
    if runlog.read_log(args.out_dir)[-1]["type"] != "summary":
        raise KeyboardInterrupt
    return None


def child(conn, *args):
    """A run in its own process (--jobs > 1): its error, None, or "interrupted", sent back on conn."""
    try:
        result = execute(*args)
    except KeyboardInterrupt:
        result = "interrupted"
    try:
        conn.send(result)
    except BrokenPipeError:  # the study was killed under it (a SIGTERM to its whole process group, as
        pass  # `timeout` sends, kills a study.main without study.py's handler): the run has saved, nobody to tell


def run_all(a, runs, desc):
    """Run every (name, train.Args) not finished yet; returns {name: error} for those that failed.
    Ctrl-C or SIGTERM: no new run starts, the running ones save a checkpoint and stop, and
    KeyboardInterrupt is raised; the same command later resumes them."""
    todo = [(n, r) for n, r in runs if finished(r.out_dir) is None]
    bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc=desc, unit="run", disable=None)
    done, t0 = itertools.count(len(runs) - len(todo) + 1), time.perf_counter()

    def ended(name):
        bar.update(1)
        if bar.disable:  # no terminal (nohup, a log file): the bar would not show, so one line per run
            m = (time.perf_counter() - t0) / 60
            print(f"[{desc}] {next(done)}/{len(runs)} runs done ({name} ended, {m:.0f} min since start)", flush=True)

    try:
        if a.jobs > 1:
            return run_parallel(a, todo, ended)
        errors = {}
        for name, r in todo:
            bar.set_postfix_str(name)
            if err := execute(r):
                errors[name] = err
            ended(name)
        return errors
    finally:
        bar.close()


def run_parallel(a, todo, ended):
    """--jobs > 1: one fresh process per run, started only when a slot is free (a pool would have
    queued runs that start even after an interruption); not daemonic, since --data folder runs start
    DataLoader workers. ended(name) is called as each run ends. Returns {name: error} for the runs that failed."""
    errors = {}
    logs = os.path.join(a.out, "logs")
    os.makedirs(logs, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // a.jobs)
    ctx = mp.get_context("spawn")
    running = {}  # {process sentinel: (name, process, connection)}
    try:
        while todo or running:
            while todo and len(running) < a.jobs:
                name, r = todo.pop(0)
                rx, tx = ctx.Pipe(duplex=False)
                p = ctx.Process(target=child, args=(tx, r, threads, os.path.join(logs, name + ".txt")))
                p.start()
                tx.close()
                running[p.sentinel] = (name, p, rx)
            for s in mp.connection.wait(list(running)):
                name, p, rx = running.pop(s)
                p.join()
                try:
                    result = rx.recv()
                except EOFError:  # it died before it could answer (killed, out of memory)
                    result = f"the run's process exited with code {p.exitcode}"
                if result == "interrupted":
                    raise KeyboardInterrupt
                if result:
                    errors[name] = result
                ended(name)
    finally:  # on an interruption (or any error) the runs still going save a checkpoint and stop
        if running:  # (after a normal end there are none, and the process's signal handlers stay untouched)
            # a second Ctrl-C / SIGTERM while they save must not end this process first: its pipes
            # would close under the runs (BrokenPipeError) and "saved a checkpoint" be printed too early
            ignored = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
            for _, p, _ in running.values():
                p.terminate()  # SIGTERM: train.py finishes the step, saves and returns
            for _, p, _ in running.values():
                p.join()
            for s, h in ignored.items():
                signal.signal(s, h)
    return errors


def grid(a):
    for seed in a.seeds:
        for m in a.methods:
            for d in ([1.0] if m == "dense" else a.densities):
                name = run_name(m, d, seed)
                yield name, replace(a.train, method=m, dense_frac=d, seed=seed, out_dir=os.path.join(a.out, name), resume=None)


def equal_time_runs(a, results):
    """For each method in --equal-time and density: epochs = epochs * masked's time / its time, rounded down
    to a hundredth of an epoch, times as means over seeds, decided once and kept in equal_time.json."""
    path = os.path.join(a.out, "equal_time.json")
    chosen = json.load(open(path)) if os.path.exists(path) else {}
    runs = []
    for m in a.equal_time:
        for d in a.densities:
            key = f"{m}-d{d}"
            if key not in chosen:
                ref, own = results.get(("masked", d)), results.get((m, d))
                if not ref or not own or len(ref) < len(a.seeds) or len(own) < len(a.seeds):
                    continue  # not measured yet (or a run failed)
                ratio = statistics.mean(r["train_seconds"] for r in ref) / statistics.mean(r["train_seconds"] for r in own)
                # to a hundredth of an epoch, rounded down: at its own mean pace the run gets masked's mean
                # time and no more; whole epochs overrun when rounded to the nearest and waste most of an
                # epoch when rounded down (docs/ablations.md, "Study protocol")
                chosen[key] = max(a.train.epochs, math.floor(100 * a.train.epochs * ratio) / 100)
            for seed in a.seeds:
                name = run_name(m, d, seed, "-eq")
                runs.append((name, replace(a.train, method=m, dense_frac=d, seed=seed, epochs=chosen[key],
                                           out_dir=os.path.join(a.out, name), resume=None)))
    os.makedirs(a.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(chosen, f, indent=1)
    return runs, chosen


def collect(a, suffix=""):
    """{(method, density): [summary per finished seed]}."""
    res = {}
    for m in a.methods:
        for d in ([1.0] if m == "dense" else a.densities):
            for seed in a.seeds:
                s = finished(os.path.join(a.out, run_name(m, d, seed, suffix)))
                if s:
                    res.setdefault((m, d), []).append({**s, "seed": seed})
    return res


def spread(xs, fmt="{:.4f}"):
    """'mean (min-max)' of a list."""
    if not xs:
        return "-"
    mean = fmt.format(statistics.mean(xs))
    return mean if len(xs) == 1 else f"{mean} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def paired(runs, ref, key="final_top1"):
    """Differences of final top-1 (or `key`) to `ref`'s run of the same seed."""
    by_seed = {r["seed"]: r[key] for r in ref or []}
    return [r[key] - by_seed[r["seed"]] for r in runs if r["seed"] in by_seed]


def within(runs, ref):
    """Top-1 of each run at its last evaluation within the training time of `ref`'s run of the same seed,
    minus that run's final top-1: what a run cut at a budget of hours has, without the lr's last decay
    (a lower bound on the run given that budget). A run with no evaluation in time counts nothing."""
    budget = {r["seed"]: (r["train_seconds"], r["final_top1"]) for r in ref or []}
    out = []
    for r in runs:
        if r["seed"] in budget:
            seconds, top1 = budget[r["seed"]]
            fits = [t1 for s, t1 in r.get("clock", []) if s <= seconds]
            if fits:
                out.append(fits[-1] - top1)
    return out


def paired_cell(diffs):
    """'mean +- standard error (min-max)' of paired differences: the seed-to-seed noise that pairing
    leaves, which a gain has to clear before it means anything."""
    if len(diffs) < 2:
        return spread(diffs, "{:+.4f}")
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    return f"{statistics.mean(diffs):+.4f} +- {se:.4f} ({min(diffs):+.4f}-{max(diffs):+.4f})"


def rows(a, res):
    """(method, density, runs, static's runs at that density or None) for every finished cell, dense
    first, then density by density in the order of --methods: the rows of the tables."""
    for d in [1.0] + list(a.densities):
        for m in a.methods:
            runs = res.get((m, d))
            if runs and (m == "dense") == (d == 1.0):
                yield m, d, runs, res.get(("static", d)) if m != "static" and d != 1.0 else None


def heads(runs):
    """Heads at the end of the runs, 'min-max' of their totals over all blocks (structured methods)."""
    n = [sum(r["counts"]["heads"]) for r in runs if r.get("counts")]
    return "-" if not n else f"{min(n)}" if min(n) == max(n) else f"{min(n)}-{max(n)}"


def tables(a, res, eq=None, chosen=None):
    t = a.train
    lines = [f"Study: `{t.model}` on `{t.data}`, {t.epochs} epochs ({t.warmup_epochs} warmup), "
             f"batch {t.batch_size}, lr {t.lr}, an update every {t.update_every} steps, churn {train.derived(t).churn} (rigl: alpha0 {t.alpha0}); "
             f"seeds {', '.join(map(str, a.seeds))}; mean (min-max) over seeds; \"vs\": paired by seed, mean +- standard "
             f"error (min-max); train s = training time without evaluation"
             + (f"; {a.jobs} runs at a time (times contended)" if a.jobs > 1 else ""), "",
             "| method | density | final top-1 | best top-1 | vs static, same seed | vs masked, same seed | heads at the end "
             "| img/s | train s | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m, d, runs, ref in rows(a, res):
        # the targets side by side: a DST method against its own start that never moves, and
        # against the mask-based DST on the same units (rigl: unstructured, not the same units)
        masked = res.get(("masked", d)) if m in train.MOVING and m != "masked" else None
        lines.append(f"| {m} | {d} | {spread([r['final_top1'] for r in runs])} | {spread([r['best_top1'] for r in runs])} | "
                     f"{paired_cell(paired(runs, ref))} | {paired_cell(paired(runs, masked))} | {heads(runs)} | "
                     f"{spread([r['img_per_s'] for r in runs], '{:.0f}')} | "
                     f"{spread([r['train_seconds'] for r in runs], '{:.0f}')} | {len(runs)} |")
    if any("final_top1_ema" in r for runs in res.values() for r in runs):
        lines += ["", f"The average of the weights (--train.ema-decay {t.ema_decay}), the same runs:", "",
                  "| method | density | final top-1 of the average | vs the model's own, same run | vs static's average, same seed |",
                  "|---|---|---|---|---|"]
        for m, d, runs, ref in rows(a, res):
            lines.append(f"| {m} | {d} | {spread([r['final_top1_ema'] for r in runs])} | "
                         f"{paired_cell([r['final_top1_ema'] - r['final_top1'] for r in runs])} | "
                         f"{paired_cell(paired(runs, ref, 'final_top1_ema')) if ref else '-'} |")
    if eq:
        lines += ["", "Equal wall-clock time: each method trained for the epochs (to a hundredth) that fit in the time "
                  "`masked` took at the same density, by the first table's times (same recipe otherwise); "
                  "compare the train s columns. The last two columns cut each run at its last epoch that ended within "
                  "the training time of `masked`'s run of the same seed (the lr not yet decayed there), and count "
                  "the seeds that had such an epoch.", "",
                  "| density | masked top-1 | masked train s | method | epochs | top-1 at equal time | train s | vs masked, same seed "
                  "| cut at masked's time, vs masked | seeds in time |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for m in a.equal_time:
            for d in a.densities:
                runs, ref = eq.get((m, d)), res.get(("masked", d))
                if not runs or not ref:
                    continue
                cut = within(runs, ref)
                lines.append(f"| {d} | {spread([r['final_top1'] for r in ref])} | {spread([r['train_seconds'] for r in ref], '{:.0f}')} | "
                             f"{m} | {chosen[f'{m}-d{d}']:g} | {spread([r['final_top1'] for r in runs])} | "
                             f"{spread([r['train_seconds'] for r in runs], '{:.0f}')} | {paired_cell(paired(runs, ref))} | "
                             f"{paired_cell(cut)} | {len(cut)} of {len(runs)} |")
    return "\n".join(lines) + "\n"


def curves(a, names):
    out = {}
    for name in names:
        try:
            out[name] = runlog.epoch_records(runlog.read_log(os.path.join(a.out, name)))
        except FileNotFoundError:
            pass
    return out


def validate(a):
    bad = [m for m in a.methods + a.equal_time if m not in train.METHODS]
    if bad:
        raise train.ArgError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(train.METHODS)}")
    if a.equal_time and "masked" not in a.methods:
        raise train.ArgError("--equal-time measures against masked: add masked to --methods, or leave --equal-time out")
    if not a.seeds or not a.densities or not a.methods or a.jobs < 1:
        raise train.ArgError("--methods, --densities and --seeds must not be empty; --jobs must be positive")
    for _, r in grid(replace(a, seeds=a.seeds[:1])):  # every method and density, before any run starts
        train.validate(replace(r, out_dir=os.path.join(a.out, "check")))


def main(a: Args):
    validate(a)
    runs = list(grid(a))
    errors = run_all(a, runs, "study")
    res, eq, chosen = collect(a), {}, {}
    if a.equal_time:
        eq_runs, chosen = equal_time_runs(a, res)
        errors.update(run_all(a, eq_runs, "equal time"))
        eq = collect(replace(a, methods=a.equal_time), "-eq")
        runs += eq_runs
    text = tables(a, res, eq, chosen)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "curves.json"), "w") as f:
        json.dump(curves(a, [n for n, _ in runs]), f)
    print(text)
    print(f"tables in {os.path.join(a.out, 'results.md')}, per-epoch curves in {os.path.join(a.out, 'curves.json')}")
    if errors:
        for n, e in errors.items():
            print(f"error: run {n} failed: {e}", file=sys.stderr)
        raise SystemExit(1)
    return res, eq


if __name__ == "__main__":
    import tyro

    def interrupt(sig, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # a scheduler's SIGTERM stops the study as Ctrl-C does
    try:
        main(tyro.cli(Args))
    except train.ArgError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    except KeyboardInterrupt:
        for s in (signal.SIGINT, signal.SIGTERM):  # the runs have saved: one more signal changes nothing
            signal.signal(s, signal.SIG_IGN)
        print("interrupted: finished runs are kept and the running ones saved a checkpoint; "
              "the same command continues the study", file=sys.stderr)
        raise SystemExit(130)
