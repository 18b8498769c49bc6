"""
Train a ViT with BARTER or a baseline. `python train.py --dense-frac 0.1` trains BARTER on CIFAR-10.
Logs a progress bar, one line and one JSONL record per epoch (loss, top-1, img/s, peak memory) and
per topology update (what moved, units per block); checkpoints every epoch and resumes exactly.
"""
import json
import math
import os
import resource
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

import data
from barter import Barter, Schedule, unit_budgets
from baselines import BiDST, Dense, Masked, Static, Unstructured
from vit import PRESETS, ViT, preset

CKPT_FORMAT = "barter-reference-checkpoint-v1"
METHODS = ("barter", "static", "masked", "rigl", "set", "bidst", "dense")
UNIT_METHODS = ("barter", "static", "masked")  # the methods that count heads and MLP channels


@dataclass
class Args:
    method: Literal["barter", "static", "masked", "rigl", "set", "bidst", "dense"] = "barter"
    """training method: BARTER (compact), static (BARTER's start, never updated) or a full-tensor baseline"""
    dense_frac: float = 0.1
    """density d in (0, 1]: fraction of heads, MLP channels (and weights for rigl/set/bidst) kept"""
    head_frac: Optional[float] = None
    """separate head density for barter/masked (None: --dense-frac)"""
    mlp_frac: Optional[float] = None
    """separate MLP-channel density for barter/masked (None: --dense-frac)"""
    model: str = "cifar-tiny"
    """model preset: micro, cifar-tiny, tiny-28, deit-tiny, deit-small, deit-base"""
    img_size: Optional[int] = None
    """image size the model sees (None: the preset's); the small datasets are resized to it on the device"""
    data: Literal["cifar10", "cifar100", "mnist", "fashion-mnist", "synthetic", "folder"] = "cifar10"
    """dataset; synthetic needs no network, folder is an ImageNet-layout folder (train/, val/)"""
    augment: bool = True
    """random crop (4 px padding) and horizontal flip of training images (never a flip for digits)"""
    data_dir: str = "data"
    """where datasets are downloaded to (or the image folder)"""
    epochs: int = 100
    """training epochs (the lr and topology schedules span all of them)"""
    max_steps: Optional[int] = None
    """stop after this many optimizer steps in all (smoke runs); schedules still span --epochs"""
    batch_size: int = 128
    """batch size"""
    lr: float = 1e-3
    """peak AdamW learning rate, reached after the warmup, then cosine decay to zero"""
    weight_decay: float = 0.05
    """AdamW weight decay on matrices (not on biases, norms, position embedding, class token)"""
    warmup_epochs: int = 5
    """linear lr warmup; no topology update happens before it ends"""
    label_smoothing: float = 0.1
    """cross-entropy label smoothing"""
    clip_grad: float = 1.0
    """gradient norm clip (0 = off)"""
    update_every: int = 500
    """steps between topology updates (BARTER and every baseline)"""
    end_frac: float = 0.75
    """fraction of training after which the topology is frozen"""
    alpha0: float = 0.25
    """fraction of each budget moved at the first update, cosine-decayed to zero at --end-frac"""
    distribution: Literal["erk", "uniform"] = "erk"
    """layer densities for rigl/set"""
    seed: int = 0
    """seed for init, data order, augmentation and every topology decision"""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda or cuda:N"""
    bf16: bool = True
    """bf16 autocast on CUDA (CPU always trains in fp32)"""
    compile: bool = False
    """torch.compile the model (recompiles after each topology update)"""
    workers: int = 8
    """DataLoader workers, for --data folder only"""
    out_dir: Optional[str] = None
    """log and checkpoints (None: runs/METHOD-dDENSITY-MODEL-DATA-sSEED)"""
    resume: Optional[str] = None
    """checkpoint to continue from (must match this run's arguments)"""


# arguments that may differ between a run and its resumption
RESUMABLE_CHANGES = {"max_steps", "device", "compile", "workers", "out_dir", "resume", "data_dir"}


class ArgError(ValueError):
    pass


def validate(args):
    def need(ok, msg):
        if not ok:
            raise ArgError(msg)

    for name in ("dense_frac", "head_frac", "mlp_frac", "end_frac", "alpha0"):
        v = getattr(args, name)
        need(v is None or 0 < v <= 1, f"--{name.replace('_', '-')} must be in (0, 1], got {v}")
    for name in ("epochs", "batch_size", "update_every", "workers"):
        need(getattr(args, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    need(args.max_steps is None or args.max_steps > 0, f"--max-steps must be positive, got {args.max_steps}")
    need(args.lr > 0 and args.weight_decay >= 0 and args.warmup_epochs >= 0 and args.clip_grad >= 0,
         "--lr must be positive; --weight-decay, --warmup-epochs and --clip-grad non-negative")
    need(0 <= args.label_smoothing < 1, f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    need(args.model in PRESETS, f"unknown --model {args.model!r}; choose from {', '.join(PRESETS)}")
    patch = PRESETS[args.model].patch_size
    need(args.img_size is None or (args.img_size > 0 and args.img_size % patch == 0),
         f"--img-size must be a positive multiple of {args.model}'s patch size {patch}, got {args.img_size}")
    need(args.method in METHODS, f"unknown --method {args.method!r}; choose from {', '.join(METHODS)}")
    need(args.data in data.DATASETS, f"unknown --data {args.data!r}; choose from {', '.join(data.DATASETS)}")
    if args.data == "folder":
        problem = data.folder_problem(args.data_dir)
        need(problem is None, f"--data-dir {problem}")
    elif args.data != "synthetic":
        parent = os.path.dirname(os.path.abspath(args.data_dir))
        need(os.path.isdir(args.data_dir) or os.path.isdir(parent),
             f"--data-dir {args.data_dir!r} is not there, nor is the folder to create it in")
    existing = os.path.join(run_dir(args), "checkpoint.pt")
    need(args.resume or not os.path.exists(existing), f"{run_dir(args)} holds a checkpoint already: "
         f"continue it with --resume {existing}, or pick another --out-dir")
    if args.method in UNIT_METHODS:
        try:
            unit_budgets(PRESETS[args.model], args.dense_frac, args.head_frac, args.mlp_frac)
        except ValueError as e:
            raise ArgError(str(e)) from None
    if args.device != "auto":
        try:
            dev = torch.device(args.device)
        except RuntimeError:
            raise ArgError(f"--device {args.device!r} is not a device") from None
        need(dev.type == "cpu" or (dev.type == "cuda" and torch.cuda.is_available()
                                   and (dev.index or 0) < torch.cuda.device_count()),
             f"--device {args.device} is not available here")


def pick_device(name):
    """'auto' is cuda when there is one, else cpu."""
    return torch.device(name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))


def run_dir(args):
    return args.out_dir or f"runs/{args.method}-d{args.dense_frac}-{args.model}-{args.data}-s{args.seed}"


def load_resume(args):
    path = args.resume
    if not os.path.isfile(path):
        raise ArgError(f"--resume {path!r}: no such file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise ArgError(f"--resume {path!r} is not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        raise ArgError(f"--resume {path!r} is not a checkpoint of this project")
    differ = [k for k, v in asdict(args).items() if k not in RESUMABLE_CHANGES and ckpt["args"].get(k) != v]
    if differ:
        raise ArgError("--resume checkpoint was made with other arguments: " +
                       ", ".join(f"--{k.replace('_', '-')} {ckpt['args'][k]!r} (now {getattr(args, k)!r})" for k in differ))
    return ckpt


def make_method(name, model, schedule, dense_frac, head_frac=None, mlp_frac=None, distribution="erk", seed=0):
    if name in ("barter", "static"):
        return (Barter if name == "barter" else Static)(model, schedule, dense_frac, head_frac, mlp_frac, seed=seed)
    if name == "masked":
        return Masked(model, schedule, dense_frac, head_frac, mlp_frac, seed=seed)
    if name in ("rigl", "set"):
        return Unstructured(model, schedule, dense_frac, "gradient" if name == "rigl" else "random", distribution, seed)
    if name == "bidst":
        return BiDST(model, schedule, dense_frac, seed=seed)
    return Dense(model)


def make_optimizer(model, lr, weight_decay):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and n not in ("pos_embed", "cls_token") else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999))


def train_step(model, fwd, method, opt, x, y, t, amp, clip=0.0, smoothing=0.0):
    """One optimizer step t (1-based) with the method's hooks around it. Returns (loss, update record)."""
    method.before_forward(t)
    with amp:
        loss = F.cross_entropy(fwd(x), y, label_smoothing=smoothing)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    method.after_backward(opt, t)  # statistics come from this step's gradients, before clipping
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.detach(), method.after_step(opt, t)


def bf16_supported(device):
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def autocast(device, bf16):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def show_counts(rec, prev):
    """'heads 1 1 0 2(+1) | mlp 77 80(-3) ...' - units per block, with the change since `prev`."""
    parts = []
    for kind, c in rec["counts"].items():
        if kind == "weights":
            continue
        old = prev.get(kind, c)
        parts.append(kind + " " + " ".join(f"{n}({n - o:+d})" if n != o else str(n) for n, o in zip(c, old)))
    moved = ", ".join(f"{v} {k}" for k, v in rec["moved"].items())
    return f"step {rec['step']}: moved {moved}" + (" | " + " | ".join(parts) if parts else "")


@torch.no_grad()
def evaluate(fwd, loader, amp):
    was = fwd.training
    fwd.eval()
    correct = total = 0
    for x, y in loader.epoch(0):
        with amp:
            correct += int((fwd(x).argmax(1) == y).sum())
        total += len(y)
    fwd.train(was)
    return correct / max(total, 1)


def save_checkpoint(path, **state):
    tmp = path + ".tmp"
    torch.save({"format": CKPT_FORMAT, **state}, tmp)
    os.replace(tmp, path)  # atomic: a crash mid-write never leaves a broken checkpoint


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


def summarize(out, total_steps, counts=None):
    """One record for the whole run, from its log (so a resumed run counts every part)."""
    recs = read_log(out)
    ep = [r for r in recs if r["type"] in ("epoch", "partial-epoch")]
    seconds = sum(r["seconds"] for r in ep)
    images = sum(r["seconds"] * r["img_per_s"] for r in ep)
    top1 = [r["test_top1"] for r in ep]
    rec = {"type": "summary", "step": ep[-1]["step"], "total_steps": total_steps, "final_top1": top1[-1],
           "best_top1": max(top1), "train_seconds": seconds, "img_per_s": images / seconds,
           "peak_mem_mb": max(r["peak_mem_mb"] for r in ep), "mem": ep[-1]["mem"], "density": ep[-1]["density"]}
    if counts:
        rec["counts"] = counts
    return rec


def main(args: Args):
    validate(args)
    ckpt = load_resume(args) if args.resume else None
    device = pick_device(args.device)
    out = run_dir(args)
    torch.manual_seed(args.seed)
    train_dl, test_dl, info = data.load(args.data, args.data_dir, args.batch_size, device,
                                        args.img_size or PRESETS[args.model].img_size, args.seed, args.workers,
                                        args.augment)
    cfg = preset(args.model, in_chans=info.in_chans, img_size=info.img_size, num_classes=info.num_classes)
    shapes = {"heads": ckpt["heads"], "mlp": ckpt["mlp"]} if ckpt else {}
    model = ViT(cfg, **shapes).to(device)
    spe = len(train_dl)
    total = args.epochs * spe
    schedule = Schedule(total, args.update_every, args.alpha0, args.end_frac, start=args.warmup_epochs * spe)
    method = make_method(args.method, model, schedule, args.dense_frac, args.head_frac, args.mlp_frac,
                         args.distribution, args.seed)
    if ckpt is None:
        method.init_model()
    opt = make_optimizer(model, args.lr, args.weight_decay)
    step = 0
    if ckpt:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        method.load_state_dict(ckpt["method"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        step = ckpt["step"]
    fwd = torch.compile(model) if args.compile else model
    amp = autocast(device, args.bf16 and bf16_supported(device))  # the CPU trains in fp32
    end = min(total, args.max_steps or total)
    warm = args.warmup_epochs * spe

    def lr_at(t):
        return args.lr * (t / warm if t <= warm else 0.5 * (1 + math.cos(math.pi * (t - warm) / max(total - warm, 1))))

    def checkpoint():
        save_checkpoint(os.path.join(out, "checkpoint.pt"), args=asdict(args), cfg=asdict(cfg),
                        heads=model.counts("heads"), mlp=model.counts("mlp"), model=model.state_dict(),
                        optimizer=opt.state_dict(), method=method.state_dict(), step=step,
                        rng={"torch": torch.get_rng_state()})

    # everything that can fail on bad input has run: only now does the run get its folder
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, "log.jsonl")
    if ckpt:  # records written after the checkpoint (a kill mid-epoch) are replayed: drop them
        kept = [r for r in read_log(out) if r["step"] <= step and r["type"] != "summary"] if os.path.exists(log_path) else []
        with open(log_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
    stop = []  # Ctrl-C / SIGTERM finish the current step, save, and exit cleanly
    handler = lambda sig, frame: stop.append(sig)
    old_handlers = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    log = open(log_path, "a" if ckpt else "w")
    counts = {}
    print(f"{args.method} d={args.dense_frac} {args.model} on {args.data} ({device}): "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, density {method.density():.4f}, "
          f"{spe} steps/epoch, {total} steps" + (f", resumed at step {step}" if ckpt else ""))
    if args.method in UNIT_METHODS:
        print("units per block: " + " | ".join(f"{k} " + " ".join(map(str, method.counts(k))) for k in ("heads", "mlp")))
        counts = {k: method.counts(k) for k in ("heads", "mlp")}
    if not ckpt:  # what a reader of the log (plot.py, study.py) needs to know about the run
        log.write(json.dumps({"type": "start", "step": 0, "args": asdict(args), "cfg": asdict(cfg),
                              "dense": {"heads": cfg.num_heads, "mlp": cfg.mlp_hidden}, "counts": counts}) + "\n")
    try:
        while step < end and not stop:
            epoch, first = divmod(step, spe)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t0, n_img, loss_sum = time.perf_counter(), 0, torch.zeros((), device=device)
            bar = tqdm(total=spe, initial=first, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False, disable=None)
            for x, y in train_dl.epoch(epoch, first):
                step += 1
                for g in opt.param_groups:
                    g["lr"] = lr_at(step)
                loss, rec = train_step(model, fwd, method, opt, x, y, step, amp, args.clip_grad, args.label_smoothing)
                loss_sum += loss
                n_img += len(y)
                bar.update(1)
                if rec is not None:
                    tqdm.write(f"[{args.method}] " + show_counts(rec, counts))
                    counts = rec["counts"]
                    log.write(json.dumps({"type": "update", **rec}) + "\n")
                    log.flush()
                if step % 20 == 0 or step == end or stop:
                    if not math.isfinite(float(loss)):
                        raise FloatingPointError(f"loss is {float(loss)} at step {step}")
                    bar.set_postfix(loss=f"{float(loss):.3f}", img_s=f"{n_img / (time.perf_counter() - t0):.0f}")
                if step >= end or stop:
                    break
            sync(device)
            seconds = time.perf_counter() - t0
            bar.close()
            done_epoch = step % spe == 0
            rec = {"type": "epoch" if done_epoch else "partial-epoch", "epoch": epoch + 1, "step": step,
                   "train_loss": float(loss_sum) / max(n_img // args.batch_size, 1), "seconds": seconds,
                   "img_per_s": n_img / seconds, "peak_mem_mb": peak_memory_mb(device),
                   "mem": "cuda-allocator-peak" if device.type == "cuda" else "process-peak-rss",
                   "params": sum(p.numel() for p in model.parameters()), "density": method.density()}
            if not math.isfinite(rec["train_loss"]):
                raise FloatingPointError(f"loss is {rec['train_loss']} in epoch {epoch + 1}")
            rec["test_top1"] = evaluate(fwd, test_dl, amp)
            tqdm.write(f"epoch {epoch + 1} step {step}: loss {rec['train_loss']:.4f} top-1 {rec['test_top1']:.4f} "
                       f"{rec['img_per_s']:.0f} img/s peak {rec['peak_mem_mb']:.0f} MB density {rec['density']:.4f}")
            log.write(json.dumps(rec) + "\n")
            log.flush()
            checkpoint()
        if not stop:
            summary = summarize(out, total, {k: method.counts(k) for k in ("heads", "mlp")}
                                if args.method in UNIT_METHODS else None)
            log.write(json.dumps(summary) + "\n")
            print(show_summary(summary, out))
    except FloatingPointError as e:
        print(f"error: {e}; stopping. The last good checkpoint in {out} is intact.", file=sys.stderr)
        raise SystemExit(1)
    finally:
        log.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    if stop:
        print(f"interrupted: checkpoint at step {step} saved in {out}; continue with --resume {out}/checkpoint.pt")
    return model, method, opt


def show_summary(s, out):
    done = "done" if s["step"] >= s["total_steps"] else "stopped early (--max-steps)"
    mem = f"{s['peak_mem_mb']:.0f} MB {'CUDA allocator' if s['mem'].startswith('cuda') else 'process RSS'}"
    lines = [f"{done}: step {s['step']}/{s['total_steps']}, test top-1 {s['final_top1']:.4f} (best {s['best_top1']:.4f}), "
             f"{s['train_seconds']:.0f} s of training at {s['img_per_s']:.0f} img/s, peak {mem}, density {s['density']:.4f}"]
    if "counts" in s:
        lines.append("final units per block: " + " | ".join(f"{k} " + " ".join(map(str, c)) for k, c in s["counts"].items()))
    lines.append(f"picture of this run: python plot.py {out}")
    return "\n".join(lines)


if __name__ == "__main__":
    import tyro

    try:
        main(tyro.cli(Args))
    except (ArgError, FileNotFoundError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
