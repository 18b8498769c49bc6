"""
Train a ViT with BARTER or a baseline. `python train.py --dense-frac 0.1` trains BARTER on CIFAR-10.
Logs a progress bar, one line and one JSONL record per epoch (loss, top-1, img/s, peak memory) and
per topology update (what moved, units per block); checkpoints every epoch and resumes exactly.
Starts from scratch or from pretrained weights (--pretrained); runs as one process or under torchrun.
"""
import itertools
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext, redirect_stdout
from dataclasses import asdict, dataclass, replace
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

import data
import weights
from barter import Barter, Schedule, initial_units, unit_budgets, widen
from baselines import BiDST, Dense, Masked, Static, Unstructured
from step import (EMA, Graph, Ranks, Stepper, autocast, bf16_supported, environment, evaluate, load_optimizer,
                  make_optimizer, peak_memory_mb, pick_device, set_lr, sync, torchrun_world)
from runlog import read_log, show_counts, show_summary, summarize
from vit import PRESETS, ViT, ViTConfig

METHODS = ("barter", "static", "masked", "rigl", "set", "bidst", "dense")
UNIT_METHODS = ("barter", "static", "masked")  # the methods that count heads and MLP channels
MOVING = ("barter", "masked", "rigl", "set", "bidst")  # the methods whose topology updates
UNIT_MOVING = ("barter", "masked")  # the methods that move heads and channels (--churn, --budgets)
WEIGHT_METHODS = ("rigl", "set", "bidst")  # full-tensor masks of single weights


@dataclass
class Args:
    method: Literal["barter", "static", "masked", "rigl", "set", "bidst", "dense"] = "barter"
    """training method: BARTER (compact), static (BARTER's start, never updated) or a full-tensor baseline"""
    dense_frac: float = 0.1
    """density d in (0, 1]: fraction of heads, MLP channels (and weights for rigl/set/bidst) kept"""
    head_frac: Optional[float] = None
    """separate head density for barter/static/masked (None: --dense-frac)"""
    mlp_frac: Optional[float] = None
    """separate MLP-channel density for barter/static/masked (None: --dense-frac)"""
    model: str = "cifar-tiny"
    """model preset: micro, cifar-tiny, tiny-28, tiny-32, deit-tiny, deit-small, deit-base, vit-large"""
    img_size: Optional[int] = None
    """image size the model sees (None: the preset's); the small datasets are resized to it on the device"""
    data: Literal["cifar10", "cifar100", "mnist", "fashion-mnist", "synthetic", "folder"] = "cifar10"
    """dataset; synthetic needs no network, folder is an ImageNet-layout folder (train/, val/)"""
    augment: bool = True
    """random crop (4 px padding) and horizontal flip of training images (never a flip for digits)"""
    data_dir: str = "data"
    """where datasets are downloaded to (or the image folder)"""
    epochs: float = 100
    """training epochs, which the lr and topology schedules span; a fraction ends within the last epoch"""
    max_steps: Optional[int] = None
    """stop after this many optimizer steps in all (smoke runs); schedules still span --epochs"""
    batch_size: int = 128
    """batch size (the global batch under torchrun)"""
    lr: float = 1e-3
    """peak AdamW learning rate, reached after the warmup, then cosine decay to zero"""
    weight_decay: float = 0.05
    """AdamW weight decay on matrices (not on biases, norms, position embedding, class token)"""
    warmup_epochs: int = 5
    """linear lr warmup; barter/masked updates do not wait for it, rigl/set/bidst's start at its end"""
    label_smoothing: float = 0.1
    """cross-entropy label smoothing"""
    clip_grad: float = 1.0
    """gradient norm clip (0 = off)"""
    ema_decay: Optional[float] = None
    """also keep an exponential moving average of the weights (e.g. 0.999) and report its test top-1"""
    update_every: int = 500
    """steps between topology updates (BARTER and every baseline)"""
    end_frac: float = 0.75
    """fraction of training after which the topology is frozen"""
    churn: Optional[float] = None
    """barter/masked: fraction of the channel budget swapped over the whole run, cosine-decayed over the
    updates (None: 0.5 from scratch, 0.1 with --pretrained, where a unit moved is pretrained knowledge lost)"""
    budgets: Literal["shared", "separate"] = "shared"
    """barter/masked: shared, one budget of weights (a head's worth may change kind at an update, and heads
    move only that way); separate, the paper's two fixed unit budgets (heads swapped like channels)"""
    alpha0: float = 0.25
    """rigl/set: fraction of each layer's weights moved at the first update (RigL's alpha), decaying to --end-frac"""
    grow: Optional[Literal["clone", "fresh"]] = None
    """barter: a grown unit is a split of a strong unit (clone) or a new unit that outputs nothing in its
    block (fresh: the function stays exact) (None: clone from scratch, fresh with --pretrained)"""
    distribution: Literal["erk", "uniform"] = "erk"
    """layer densities for rigl/set"""
    seed: int = 0
    """seed for init, data order, augmentation and every topology decision"""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda or cuda:N"""
    bf16: bool = True
    """bf16 autocast on CUDA (CPU always trains in fp32)"""
    compile: bool = False
    """torch.compile the model; each update that changes a shape compiles again, so it pays when they are far apart"""
    cuda_graph: bool = False
    """capture the step as one CUDA graph and replay it, so that Python's launches no longer bound a compact
    model's step; captured again after each update. CUDA, one process. Not yet the default: untested on a GPU"""
    workers: int = 8
    """DataLoader workers for an image folder (a prepared one is read by one thread)"""
    out_dir: Optional[str] = None
    """log and checkpoints (None: runs/METHOD-dDENSITY-MODEL-DATA-sSEED)"""
    resume: Optional[str] = None
    """checkpoint to continue from (must match this run's arguments)"""
    eval_only: bool = False
    """with --resume: print the checkpoint's test top-1 and exit (its own data arguments are used)"""
    pretrained: Optional[str] = None
    """start from these weights: a torchvision or timm/DeiT ViT state dict, a checkpoint or a published model/
    folder of this project, or torchvision:NAME (e.g. torchvision:vit_b_16); the shape comes from them, not --model"""
    init_batches: int = 8
    """with --pretrained: training batches over which every unit is scored once (a one-time dense cost)"""
    pretrained_heads: Optional[int] = None
    """heads per block of --pretrained state dicts, which do not store it (None: DeiT/ViT's for the width)"""


def derived(args):
    """The arguments whose default depends on --pretrained, filled in: a fine-tune moves fewer units and
    grows fresh ones, which keep the pretrained function (docs/ablations.md, "Fine-tuning")."""
    tune = args.pretrained is not None
    return replace(args, churn=(0.1 if tune else 0.5) if args.churn is None else args.churn,
                   grow=args.grow or (("fresh" if tune else "clone") if args.method == "barter" else None))


# arguments that may differ between a run and its resumption
RESUMABLE_CHANGES = {"max_steps", "device", "compile", "cuda_graph", "workers", "out_dir", "resume", "data_dir", "eval_only"}
# the arguments only some methods read (every other argument is read by every method)
READ_BY = {"dense_frac": tuple(m for m in METHODS if m != "dense"), "head_frac": UNIT_METHODS, "mlp_frac": UNIT_METHODS,
           "grow": ("barter",), "churn": UNIT_MOVING, "budgets": UNIT_MOVING,
           "alpha0": WEIGHT_METHODS, "distribution": ("rigl", "set"), "update_every": MOVING, "end_frac": MOVING}
PRETRAINED_ONLY = ("init_batches", "pretrained_heads")


class ArgError(ValueError):
    pass


def ignored(args):
    """What a user set away from its default that this run does not read, said in one line (None if
    nothing). Not an error: study.py passes one set of arguments to every method of a grid."""
    default = Args()
    given = lambda names: ", ".join(f"--{k.replace('_', '-')}" for k in names if getattr(args, k) != getattr(default, k))
    parts = []
    if flags := given(k for k, methods in READ_BY.items() if args.method not in methods):
        parts.append(f"{flags} (not read by --method {args.method})")
    if not args.pretrained and (flags := given(PRETRAINED_ONLY)):
        parts.append(f"{flags} (read only with --pretrained)")
    if (args.pretrained or "").startswith("torchvision:") and (flags := given(["pretrained_heads"])):
        parts.append(f"{flags} (torchvision's model gives its own head count)")
    return f"note: ignored: {'; '.join(parts)}" if parts else None


def validate(args):
    def need(ok, msg):
        if not ok:
            raise ArgError(msg)

    for name in ("dense_frac", "head_frac", "mlp_frac", "end_frac", "alpha0"):
        v = getattr(args, name)
        need(v is None or 0 < v <= 1, f"--{name.replace('_', '-')} must be in (0, 1], got {v}")
    need(args.churn is None or args.churn > 0, f"--churn must be positive, got {args.churn}")
    for name in ("epochs", "batch_size", "update_every", "workers", "init_batches"):
        need(getattr(args, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    need(args.max_steps is None or args.max_steps > 0, f"--max-steps must be positive, got {args.max_steps}")
    need(args.batch_size % torchrun_world() == 0,
         f"--batch-size {args.batch_size} (the global batch) must divide by the {torchrun_world()} ranks")
    need(args.lr > 0 and args.weight_decay >= 0 and args.warmup_epochs >= 0 and args.clip_grad >= 0,
         "--lr must be positive; --weight-decay, --warmup-epochs and --clip-grad non-negative")
    need(0 <= args.label_smoothing < 1, f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    need(args.ema_decay is None or 0 < args.ema_decay < 1, f"--ema-decay must be in (0, 1), got {args.ema_decay}")
    need(args.model in PRESETS, f"unknown --model {args.model!r}; choose from {', '.join(PRESETS)}")
    need(args.pretrained_heads is None or args.pretrained_heads > 0, f"--pretrained-heads must be positive, got {args.pretrained_heads}")
    need(not args.eval_only or args.resume, "--eval-only needs --resume CHECKPOINT")
    need(not args.pretrained or args.resume or args.pretrained.startswith("torchvision:") or os.path.exists(args.pretrained),
         f"--pretrained {args.pretrained!r}: no such file or folder")  # here, so study.py stops once; a resume needs only its checkpoint
    if not args.pretrained:  # else the shape comes from the weights file: checked once it is read
        check_img_size(args.img_size, PRESETS[args.model])
    need(args.method in METHODS, f"unknown --method {args.method!r}; choose from {', '.join(METHODS)}")
    need(args.method != "barter" or args.grow in (None,) + Barter.grows,
         f"--grow {args.grow} is not a way barter grows; choose {' or '.join(Barter.grows)}")
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
    if args.method in UNIT_METHODS and not args.pretrained:
        check_budgets(args, PRESETS[args.model])
    if args.device != "auto":
        try:
            dev = torch.device(args.device)
        except RuntimeError:
            raise ArgError(f"--device {args.device!r} is not a device") from None
        need(dev.type == "cpu" or (dev.type == "cuda" and torch.cuda.is_available()
                                   and (dev.index or 0) < torch.cuda.device_count()),
             f"--device {args.device} is not available here")
    if args.cuda_graph:
        need(pick_device(args.device).type == "cuda", f"--cuda-graph needs a CUDA device; this run would be on "
             f"{pick_device(args.device)} (leave --cuda-graph off there)")
        need(not args.compile, "--cuda-graph and --compile: pick one (torch.compile's mode='reduce-overhead' "
             "captures CUDA graphs of its own)")


def check_img_size(img_size, cfg):
    if img_size is not None and (img_size <= 0 or img_size % cfg.patch_size):
        raise ArgError(f"--img-size must be a positive multiple of the patch size {cfg.patch_size}, got {img_size}")


def check_budgets(args, cfg):
    try:
        unit_budgets(cfg, args.dense_frac, args.head_frac, args.mlp_frac)
    except ValueError as e:
        raise ArgError(str(e)) from None


def total_steps(args, spe):
    """The run's optimizer steps: --epochs of spe steps each, a fractional epoch rounded to a step."""
    return round(args.epochs * spe)


def run_dir(args):
    return args.out_dir or f"runs/{args.method}-d{args.dense_frac}-{args.model}-{args.data}-s{args.seed}"


def read_checkpoint(path):
    """--resume's checkpoint, or one line saying why not."""
    try:
        return weights.read_checkpoint(path)
    except weights.WeightsError as e:
        raise ArgError(f"--resume {e}") from None


def load_resume(args):
    ckpt = read_checkpoint(args.resume)
    saved = ckpt["args"]
    if "trade" in saved:  # written before --budgets replaced --no-trade
        saved["budgets"] = "shared" if saved.pop("trade") else "separate"
    if saved.get("method") != "barter":  # masked recorded its growth, which is no longer a choice
        saved["grow"] = None
    default = {k: f.default for k, f in Args.__dataclass_fields__.items()}  # for arguments added since
    differ = [k for k, v in asdict(args).items() if k not in RESUMABLE_CHANGES and saved.get(k, default[k]) != v]
    if differ:
        raise ArgError("--resume checkpoint was made with other arguments: " +
                       ", ".join(f"--{k.replace('_', '-')} {saved.get(k, default[k])!r} (now {getattr(args, k)!r})" for k in differ))
    return ckpt


def make_method(name, model, schedule, dense_frac, head_frac=None, mlp_frac=None, distribution="erk", seed=0, grow=None,
                budgets="shared"):
    if name == "barter":
        return Barter(model, schedule, dense_frac, head_frac, mlp_frac, seed=seed, grow=grow or "clone", budgets=budgets)
    if name in ("static", "masked"):  # static never grows
        return (Static if name == "static" else Masked)(model, schedule, dense_frac, head_frac, mlp_frac, seed=seed,
                                                         budgets=budgets)
    if name in ("rigl", "set"):
        return Unstructured(model, schedule, dense_frac, "gradient" if name == "rigl" else "random", distribution, seed)
    if name == "bidst":
        return BiDST(model, schedule, dense_frac, seed=seed)
    return Dense(model)


def eval_checkpoint(args):
    """--eval-only: the checkpoint's model on its test split."""
    ckpt = read_checkpoint(args.resume)
    model = weights.from_checkpoint(ckpt).eval()
    a = {**asdict(Args()), **{k: v for k, v in ckpt["args"].items() if k in Args.__dataclass_fields__}}
    device = pick_device(args.device)
    data_dir = args.data_dir if args.data_dir != Args.data_dir else a["data_dir"]
    _, test_dl, _ = data.load(a["data"], data_dir, a["batch_size"], device, model.cfg.img_size, a["seed"], args.workers)
    amp = autocast(device, a["bf16"] and bf16_supported(device))
    top1 = evaluate(model.to(device), test_dl, amp)
    print(f"{args.resume}: {a['method']} d={a['dense_frac']} at step {ckpt['step']}, test top-1 {top1:.4f} "
          f"on the {a['data']} test split")
    if ckpt.get("ema"):
        top1_ema = evaluate(weights.from_checkpoint(ckpt, ema=True).eval().to(device), test_dl, amp)
        print(f"the average of its weights (--ema-decay {a['ema_decay']}): test top-1 {top1_ema:.4f}")
    return top1


# ---- a run's data, model and method ---------------------------------------------------------------

def read_pretrained(args):
    """The --pretrained model (dense or compact, on the CPU), its shape checked against the arguments."""
    try:
        model, kind = weights.load_pretrained(args.pretrained, args.pretrained_heads)
    except weights.WeightsError as e:
        raise ArgError(f"--pretrained {e}") from None
    check_img_size(args.img_size, model.cfg)
    if args.method in UNIT_METHODS:
        check_budgets(args, model.cfg)
    c = model.cfg
    print(f"pretrained: {kind} weights from {args.pretrained}: {c.depth} blocks of width {c.dim}, {c.num_heads} heads, "
          f"MLP {c.mlp_hidden}, {c.img_size} px in patches of {c.patch_size}, {c.num_classes} classes")
    return model


def pretrained_start(model, args, cfg, batches, amp, device):
    """The compact start of a fine-tune: the pretrained model fitted to this data (weights.adapt), widened to
    its dense shape (barter.widen), a new head fitted to the frozen features, then every unit scored once
    by BARTER's own statistic over `batches` and the best kept within the budgets (barter.initial_units).
    Returns (model, init_model's arguments, a record of the start, mean_loss() over the batches)."""
    t0 = time.perf_counter()
    try:
        new_head, notes = weights.adapt(model, cfg)
    except weights.WeightsError as e:
        raise ArgError(f"--pretrained {e}") from None
    for note in notes:
        print(note)
    model = widen(model, torch.Generator().manual_seed(args.seed)).to(device)
    if new_head:
        weights.fit_head(model, batches)

    def loss_of(x, y):
        with amp:
            return F.cross_entropy(model(x), y, label_smoothing=args.label_smoothing)

    @torch.no_grad()
    def mean_loss():
        return sum(float(loss_of(x, y)) for x, y in batches) / len(batches)

    rec, kw = {"batches": len(batches), "loss_dense": mean_loss()}, {}
    if args.method in UNIT_METHODS:
        budget, lo, hi = unit_budgets(cfg, args.dense_frac, args.head_frac, args.mlp_frac)
        kw["keep"] = initial_units(model, budget, lo, hi, batches, loss_of)
    elif args.method in WEIGHT_METHODS:
        kw["magnitude"] = True  # random masks would throw most of the pretrained function away
    rec["seconds"] = time.perf_counter() - t0
    return model, kw, rec, mean_loss


def build(args, ckpt, device, amp, ranks=None):
    """Data, model and method of a run: initialised for a fresh run (from scratch or from --pretrained),
    or shaped like the checkpoint for its weights to be loaded. Returns (train loader, test loader,
    config, model, method, record of the pretrained start or None)."""
    args = derived(args)  # main has filled them in already; a direct caller gets the same run
    pre = read_pretrained(args) if args.pretrained and not ckpt else None
    base = ViTConfig(**ckpt["cfg"]) if ckpt else (pre.cfg if pre else PRESETS[args.model])
    rank, world = (ranks.rank, ranks.world) if ranks else (0, 1)
    train_dl, test_dl, info = data.load(args.data, args.data_dir, args.batch_size, device, args.img_size or base.img_size,
                                        args.seed, args.workers, args.augment, rank, world)
    cfg = replace(base, in_chans=info.in_chans, img_size=info.img_size, num_classes=info.num_classes)
    init_kw, init_rec = {}, None
    if pre:
        batches = list(itertools.islice(train_dl.epoch(0), args.init_batches))
        model, init_kw, init_rec, mean_loss = pretrained_start(pre, args, cfg, batches, amp, device)
    else:
        model = ViT(cfg, **({"heads": ckpt["heads"], "mlp": ckpt["mlp"]} if ckpt else {})).to(device)
    spe = len(train_dl)
    steps = total_steps(args, spe)
    if steps < 1:
        raise ArgError(f"--epochs {args.epochs} is less than one step of the {spe} in an epoch")
    # BARTER and masked update from the first interval (barter.Schedule); the weight-level baselines
    # wait for the end of the lr warmup, where regrowing weights by the gradients of a model that has
    # barely trained does not throw them away (docs/ablations.md, "Baselines")
    start = args.warmup_epochs * spe if args.method in WEIGHT_METHODS else 0
    schedule = Schedule(steps, args.update_every, args.alpha0, args.end_frac, start=start,
                        churn=args.churn if args.method in UNIT_MOVING else None)
    if args.method in MOVING and not schedule.updates():  # it would be the static control under another name
        end = int(schedule.end_frac * schedule.total_steps)
        raise ArgError(f"--method {args.method} would never update its topology: no multiple of --update-every "
                       f"{args.update_every} lies between step {start} ({'the end of the lr warmup' if start else 'the start'}) "
                       f"and step {end} (--end-frac x {schedule.total_steps} steps), where updates stop; lower --update-every"
                       f"{' or --warmup-epochs' if start else ''} or raise --epochs (--method static is the run without updates)")
    method = make_method(args.method, model, schedule, args.dense_frac, args.head_frac, args.mlp_frac,
                         args.distribution, args.seed, args.grow, args.budgets)
    if ckpt is None:
        method.init_model(**init_kw)
    if init_rec:
        init_rec["loss_start"] = mean_loss()
        print(f"compact start by gate-Taylor over {len(batches)} batches in {init_rec['seconds']:.1f} s (one-time dense "
              f"cost): loss {init_rec['loss_dense']:.4f} dense -> {init_rec['loss_start']:.4f} at step 0")
    return train_dl, test_dl, cfg, model, method, init_rec


def main(args: Args):
    if args.eval_only:
        return eval_checkpoint(args)
    unread = ignored(args)
    args = derived(args)  # the checkpoint and the log record the values the run used
    validate(args)
    ranks = Ranks(args.device)
    try:
        with (nullcontext() if ranks.main else redirect_stdout(open(os.devnull, "w"))):
            if unread:
                print(unread)
            out = Run(args, ranks).go()
    except BaseException:
        ranks.close(finished=False)  # a failed rank must not wait for peers that will never come
        raise
    ranks.close()
    return out


# ---- the run and its loop -----------------------------------------------------------------------------

class Run:
    """One training run: set up (or restored from --resume) here, then go(): epochs of steps, each epoch
    evaluated, logged and checkpointed. Ctrl-C or SIGTERM finishes the step, saves and exits (every rank
    at the same step); a non-finite loss or gradient stops the run with the last good checkpoint intact."""

    def __init__(self, args, ranks):
        ckpt = load_resume(args) if args.resume else None
        self.args, self.ranks, self.device, self.out = args, ranks, ranks.device, run_dir(args)
        torch.manual_seed(args.seed)
        self.amp = autocast(self.device, args.bf16 and bf16_supported(self.device))  # the CPU trains in fp32
        self.train_dl, self.test_dl, self.cfg, self.model, self.method, init_rec = build(args, ckpt, self.device, self.amp, ranks)
        self.spe = len(self.train_dl)
        self.total = total_steps(args, self.spe)
        self.end = min(self.total, args.max_steps or self.total)
        self.opt = make_optimizer(self.model, args.lr, args.weight_decay)
        self.ema = EMA(self.model, args.ema_decay) if args.ema_decay else None
        self.method.shadow = self.ema.shadow if self.ema else None
        self.step = self.restore(ckpt) if ckpt else 0
        self.graphs = args.cuda_graph and ranks.world == 1  # under DDP the step runs eagerly (said in the first line)
        self.stepper = Stepper(self.model, self.method, self.opt, self.amp, args.clip_grad, args.label_smoothing,
                               Graph(self.device) if self.graphs else None)
        self.stepper.fwd = ranks.wrap(self.model, args.compile)
        self.env = environment(self.device)
        self.counts = {k: self.method.counts(k) for k in ("heads", "mlp")} if args.method in UNIT_METHODS else {}
        self.log = self.open_log(ckpt, init_rec)  # everything that can fail on bad input has run: the folder now

    def restore(self, ckpt):
        self.model.load_state_dict(ckpt["model"])
        load_optimizer(self.opt, ckpt["optimizer"])
        if self.ema:
            self.ema.load_state_dict(self.model, ckpt["ema"])
        self.method.load_state_dict(ckpt["method"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if self.device.type == "cuda" and ckpt["rng"].get("cuda") is not None:  # bidst's noise on CUDA
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], self.device)
        return ckpt["step"]

    def open_log(self, ckpt, init_rec):
        """log.jsonl, after the run's first lines: records written after the checkpoint resumed from (a kill
        mid-epoch) are dropped, since those steps run again."""
        a, path = self.args, os.path.join(self.out, "log.jsonl")
        if self.ranks.main:
            os.makedirs(self.out, exist_ok=True)
            if ckpt:
                kept = [r for r in read_log(self.out) if r["step"] <= self.step and r["type"] != "summary"] if os.path.exists(path) else []
                with open(path, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in kept)
        print(f"{a.method} d={a.dense_frac} {a.pretrained or a.model} on {a.data} ({self.device}"
              f"{f', {self.ranks.world} ranks' if self.ranks.world > 1 else ''}): {sum(p.numel() for p in self.model.parameters()):,} "
              f"parameters, density {self.method.density():.4f}, {self.spe} steps/epoch, {self.total} steps"
              + (f", resumed at step {self.step}" if ckpt else "") + (", the step captured as a CUDA graph" if self.graphs
                                                                     else "; --cuda-graph: under torchrun the step runs eagerly" if a.cuda_graph else ""))
        was = (ckpt or {}).get("env") or self.env  # checkpoints from before the record have none
        changed = [f"{k} {v} (the run had {was.get(k)})" for k, v in self.env.items() if was.get(k) != v]
        if changed:
            print("resumed with " + ", ".join(changed) + ": it continues correctly, but not bit for bit as a run never stopped")
        if self.counts:
            print("units per block: " + " | ".join(f"{k} " + " ".join(map(str, c)) for k, c in self.counts.items()))
            if 0 in self.counts["heads"]:  # the budget holds fewer heads than blocks, and channels cannot pay for more
                print(f"{self.counts['heads'].count(0)} of {self.cfg.depth} blocks start without a head (README, How it works)")
        log = open(path if self.ranks.main else os.devnull, "a" if ckpt else "w")
        if not ckpt:  # what a reader of the log (plot.py, study.py) needs to know about the run
            log.write(json.dumps({"type": "start", "step": 0, "args": asdict(a), "cfg": asdict(self.cfg), "init": init_rec,
                                  "world": self.ranks.world, "env": self.env, "counts": self.counts,
                                  "dense": {"heads": self.cfg.num_heads, "mlp": self.cfg.mlp_hidden}}) + "\n")
        return log

    def lr_at(self, t):
        warm, total = self.args.warmup_epochs * self.spe, self.total
        return self.args.lr * (t / warm if t <= warm else 0.5 * (1 + math.cos(math.pi * (t - warm) / max(total - warm, 1))))

    def checkpoint(self):
        if self.ranks.main:  # every rank holds the same model: one file, from rank 0
            m, dev = self.model, self.device
            weights.save_checkpoint(os.path.join(self.out, "checkpoint.pt"), args=asdict(self.args), cfg=asdict(self.cfg),
                            heads=m.counts("heads"), mlp=m.counts("mlp"), model=m.state_dict(), optimizer=self.opt.state_dict(),
                            method=self.method.state_dict(), step=self.step, env=self.env,
                            ema=self.ema.state_dict(m) if self.ema else None,
                            rng={"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None})

    def go(self):
        signalled = []  # Ctrl-C / SIGTERM: finish the current step, save, and exit cleanly (all ranks)
        old_handlers = {s: signal.signal(s, lambda sig, frame: signalled.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)}
        stop = False
        try:
            while self.step < self.end and not stop:
                stop = self.epoch(signalled)
            if not stop and self.ranks.main:
                summary = summarize(self.out, self.total, self.counts or None)
                self.log.write(json.dumps(summary) + "\n")
                self.publish()
                print(show_summary(summary, self.out))
        except FloatingPointError as e:
            print(f"error: {e}; stopping. The last good checkpoint in {self.out} is intact.", file=sys.stderr)
            raise SystemExit(1)
        finally:
            self.log.close()
            for s, h in old_handlers.items():
                signal.signal(s, h)
        if stop:
            print(f"interrupted: checkpoint at step {self.step} saved in {self.out}; continue with --resume {self.out}/checkpoint.pt")
        return self.model, self.method, self.opt

    def publish(self):
        """The trained model as model/ in the run folder (weights.save_pretrained), the average of its weights
        where --ema-decay kept one; a structured masked run's compacted to the units its masks keep."""
        with self.ema.swapped_in(self.model) if self.ema else nullcontext():
            model = weights.publishable(self.model, getattr(self.method, "active", None))
        kept = f"the average of the weights (--ema-decay {self.args.ema_decay})" if self.ema else "the trained weights"
        weights.save_pretrained(model, os.path.join(self.out, "model"), weights=kept, method=self.args.method)
        if self.args.method in WEIGHT_METHODS:
            print(f"model/ holds {self.args.method}'s model dense: its sparsity is of single weights, zeros in dense tensors")

    def epoch(self, signalled):
        """Train to the end of the current epoch (or --max-steps, or a signal), then evaluate, log and save.
        Returns whether a signal stopped it."""
        a, ranks, dev = self.args, self.ranks, self.device
        epoch, first = divmod(self.step, self.spe)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        sync(dev)
        t0, n_img, n_steps, loss_sum, stop = time.perf_counter(), 0, 0, torch.zeros((), device=dev), False
        bar = tqdm(total=min(self.spe, self.end - epoch * self.spe), initial=first, desc=f"epoch {epoch + 1}/{math.ceil(a.epochs)}",
                   leave=False, disable=None if ranks.main else True)
        batches = data.Waiting(self.train_dl.epoch(epoch, first))
        for x, y in batches:
            self.step += 1
            set_lr(self.opt, self.lr_at(self.step))
            loss, rec = self.stepper(x, y, self.step)
            if self.ema:  # after the update: the average was resized or masked with the model
                self.ema.update(self.model, self.step)
            loss_sum += loss
            n_img, n_steps = n_img + len(y) * ranks.world, n_steps + 1
            bar.update(1)
            if rec is not None:
                self.updated(rec)
            # under torchrun every rank must stop at the same step: they agree on it every 10 steps
            stop = bool(signalled) if ranks.world == 1 else self.step % 10 == 0 and ranks.reduce(bool(signalled), "max") > 0
            if self.step % 20 == 0 or self.step == self.end or stop:
                shown = ranks.reduce(loss) / ranks.world
                if not math.isfinite(shown):
                    raise FloatingPointError(f"the loss or a gradient is not finite at step {self.step}")
                elapsed = time.perf_counter() - t0
                bar.set_postfix(loss=f"{shown:.3f}", img_s=f"{n_img / elapsed:.0f}", data_wait=f"{batches.seconds / elapsed:.0%}")
            if self.step >= self.end or stop:
                break
        batches.close()  # a loader's thread, if it has one, ends here and not when the epoch's record is written
        sync(dev)
        seconds = time.perf_counter() - t0
        bar.close()
        rec = {"type": "epoch" if self.step % self.spe == 0 else "partial-epoch", "epoch": epoch + 1, "step": self.step,
               "train_loss": ranks.reduce(loss_sum) / ranks.world / max(n_steps, 1), "seconds": seconds,
               "img_per_s": n_img / seconds, "data_wait": batches.seconds / seconds, "peak_mem_mb": ranks.reduce(peak_memory_mb(dev), "max"),
               "mem": "cuda-allocator-peak" if dev.type == "cuda" else "process-peak-rss",
               "params": sum(p.numel() for p in self.model.parameters()), "density": self.method.density()}
        if not math.isfinite(rec["train_loss"]):
            raise FloatingPointError(f"the loss or a gradient is not finite in epoch {epoch + 1}")
        rec["test_top1"] = evaluate(self.stepper.fwd, self.test_dl, self.amp, ranks)
        if self.ema:
            with self.ema.swapped_in(self.model):
                rec["test_top1_ema"] = evaluate(self.stepper.fwd, self.test_dl, self.amp, ranks)
        tqdm.write(f"epoch {epoch + 1} step {self.step}: loss {rec['train_loss']:.4f} top-1 {rec['test_top1']:.4f} "
                   + (f"(average {rec['test_top1_ema']:.4f}) " if self.ema else "") +
                   f"{rec['img_per_s']:.0f} img/s ({rec['data_wait']:.0%} waiting for data) peak {rec['peak_mem_mb']:.0f} MB "
                   f"density {rec['density']:.4f}")
        self.log.write(json.dumps(rec) + "\n")
        self.log.flush()
        self.checkpoint()
        return stop

    def updated(self, rec):
        """After a topology update: the ranks agree, the step calls the resized model, the log says what moved."""
        self.ranks.check_lockstep(rec["counts"], self.step)
        self.stepper.fwd = self.ranks.wrap(self.model, self.args.compile)
        tqdm.write(f"[{self.args.method}] " + show_counts(rec, self.counts))
        if "weights" not in rec["counts"]:
            self.counts = rec["counts"]
        self.log.write(json.dumps({"type": "update", **rec}) + "\n")
        self.log.flush()


if __name__ == "__main__":
    import tyro

    try:
        main(tyro.cli(Args))
    except (ArgError, FileNotFoundError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    if torchrun_world() > 1:
        # a torchrun rank whose work is written and whose group is destroyed skips the interpreter's
        # finalization, where gloo's threads still abort a rank now and then ("terminate called without
        # an active exception"; pytorch/pytorch#179291 traces such aborts to objects freed at finalization)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
