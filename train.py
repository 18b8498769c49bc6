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
import platform
import resource
import signal
import sys
import time
from contextlib import contextmanager, nullcontext, redirect_stdout
from dataclasses import asdict, dataclass, replace
from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import data
import vit
from barter import FRESH, Barter, Schedule, initial_units, resize, unit_budgets
from baselines import BiDST, Dense, Masked, Static, Unstructured
from vit import CKPT_FORMAT, PRESETS, ViT, ViTConfig
METHODS = ("barter", "static", "masked", "rigl", "set", "bidst", "dense")
UNIT_METHODS = ("barter", "static", "masked")  # the methods that count heads and MLP channels
MOVING = ("barter", "masked", "rigl", "set", "bidst")  # the methods whose topology updates
UNIT_MOVING = ("barter", "masked")  # the methods that move heads and channels (--grow, --churn, --trade)
WEIGHT_METHODS = ("rigl", "set", "bidst")  # full-tensor masks of single weights


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
    """model preset: micro, cifar-tiny, tiny-28, tiny-32, deit-tiny, deit-small, deit-base"""
    img_size: Optional[int] = None
    """image size the model sees (None: the preset's); the small datasets are resized to it on the device"""
    data: Literal["cifar10", "cifar100", "mnist", "fashion-mnist", "synthetic", "folder"] = "cifar10"
    """dataset; synthetic needs no network, folder is an ImageNet-layout folder (train/, val/)"""
    augment: bool = True
    """random crop (4 px padding) and horizontal flip of training images (never a flip for digits)"""
    data_dir: str = "data"
    """where datasets are downloaded to (or the image folder)"""
    epochs: float = 100
    """training epochs (the lr and topology schedules span all of them); may be fractional: 4.5 ends halfway
    through the fifth, as study.py's runs at equal time do"""
    max_steps: Optional[int] = None
    """stop after this many optimizer steps in all (smoke runs); schedules still span --epochs"""
    batch_size: int = 128
    """batch size"""
    lr: float = 1e-3
    """peak AdamW learning rate, reached after the warmup, then cosine decay to zero"""
    weight_decay: float = 0.05
    """AdamW weight decay on matrices (not on biases, norms, position embedding, class token)"""
    warmup_epochs: int = 5
    """linear lr warmup; barter/masked updates do not wait for it (the first is at step --update-every),
    rigl/set/bidst's start at its end"""
    label_smoothing: float = 0.1
    """cross-entropy label smoothing"""
    clip_grad: float = 1.0
    """gradient norm clip (0 = off)"""
    ema_decay: Optional[float] = None
    """also keep an exponential moving average of the weights with this decay (e.g. 0.999 for runs of
    many thousand steps; None: none) and report its test top-1 beside the model's. It is resized with
    the model at every BARTER update and masked with it in the baselines"""
    update_every: int = 500
    """steps between topology updates (BARTER and every baseline)"""
    end_frac: float = 0.75
    """fraction of training after which the topology is frozen"""
    churn: Optional[float] = None
    """barter/masked: fraction of the channel budget swapped over the whole run (all updates together,
    cosine-decayed; the heads' too with --no-trade, else heads move by the trade alone); the fraction per
    update is derived from it. Each update rounds its share to whole units, so a kind of few units can
    move more or fewer than that (None: 0.5 from scratch, 0.1 with --pretrained, where a pretrained unit
    moved is knowledge lost; measured in the README)"""
    alpha0: float = 0.25
    """rigl/set: fraction of each layer's weights moved at the first update (RigL's alpha), cosine-decayed
    to zero at --end-frac"""
    grow: Optional[Literal["clone", "sprout", "fresh", "gradient", "random"]] = None
    """barter: a grown unit is a split of a strong unit (clone), a new unit with a strong unit's input side
    and a zero output side (sprout: a one-sided split), a new unit with a zero output side in a strong
    unit's block (fresh), or a new unit in an absent slot drawn at random (random: a structured SET)
    (None: clone from scratch, fresh with --pretrained; measured in the README). masked: the masked units
    with the largest dense gradient grow (gradient, the default) or units drawn at random (random)"""
    trade: bool = True
    """barter/masked: at each update a head's worth of weights may move between heads and MLP channels
    (by the same scores), the weight density fixed, and heads move only this way; --no-trade keeps both
    unit budgets fixed and swaps heads within their kind like channels"""
    distribution: Literal["erk", "uniform"] = "erk"
    """layer densities for rigl/set"""
    seed: int = 0
    """seed for init, data order, augmentation and every topology decision"""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda or cuda:N"""
    bf16: bool = True
    """bf16 autocast on CUDA (CPU always trains in fp32)"""
    compile: bool = False
    """torch.compile the model; the step after each topology update that changes a shape compiles again
    (15-29 s each for cifar-tiny on a 2-core CPU: it pays only when updates are far apart; README,
    "Training", and BENCHMARKS.md)"""
    cuda_graph: bool = False
    """capture the training step (forward, backward, statistics, clipping, AdamW) as one CUDA graph and replay
    it, so that Python's kernel launches no longer bound a compact model's step; a step that updates the
    topology runs eagerly and the step is captured again after it. CUDA only, one process (under torchrun
    the step runs eagerly). Not yet the default: its CUDA tests have not run on a GPU"""
    workers: int = 8
    """DataLoader workers, for --data folder only"""
    out_dir: Optional[str] = None
    """log and checkpoints (None: runs/METHOD-dDENSITY-MODEL-DATA-sSEED)"""
    resume: Optional[str] = None
    """checkpoint to continue from (must match this run's arguments)"""
    eval_only: bool = False
    """with --resume: print the checkpoint's test top-1 and exit (its own data arguments are used)"""
    pretrained: Optional[str] = None
    """start from these weights: a torchvision or timm/DeiT ViT state dict, a checkpoint of this project, or
    torchvision:NAME (e.g. torchvision:vit_b_16). The model shape comes from the file; --model is not used"""
    select: Literal["taylor", "magnitude", "first"] = "taylor"
    """with --pretrained: the units the compact start keeps (gate-Taylor score over --init-batches, weight norm,
    or the first units of each block)"""
    init_batches: int = 8
    """with --pretrained: training batches over which every unit is scored once (a one-time dense cost)"""
    pretrained_heads: Optional[int] = None
    """heads per block of --pretrained state dicts, which do not store it (None: the DeiT/ViT value for the
    width: 3 for 192, 6 for 384, 12 for 768, 16 for 1024 and 1280; else width / 64)"""


def derived(args):
    """The arguments whose default depends on --pretrained, filled in. A fine-tune moves fewer units and
    grows fresh ones: in the measured fine-tunes churn 0.5 cost 0.18 / 1.09 points against 0.1 (d = 0.1 /
    0.3) and the clone 0.20-0.26 against fresh at d = 0.1 (README, "Fine-tuning"); from scratch the clone
    is the better."""
    tune = args.pretrained is not None
    return replace(args, churn=(0.1 if tune else 0.5) if args.churn is None else args.churn,
                   grow=args.grow or ("gradient" if args.method == "masked" else "fresh" if tune else "clone"))


# arguments that may differ between a run and its resumption
RESUMABLE_CHANGES = {"max_steps", "device", "compile", "cuda_graph", "workers", "out_dir", "resume", "data_dir", "eval_only"}


class ArgError(ValueError):
    pass


# the arguments only some methods read (every other argument is read by every method)
READ_BY = {"dense_frac": tuple(m for m in METHODS if m != "dense"), "head_frac": UNIT_METHODS, "mlp_frac": UNIT_METHODS,
           "grow": UNIT_MOVING, "churn": UNIT_MOVING, "trade": UNIT_MOVING,
           "alpha0": WEIGHT_METHODS, "distribution": ("rigl", "set"), "update_every": MOVING, "end_frac": MOVING}
PRETRAINED_ONLY = ("select", "init_batches", "pretrained_heads")


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


def torchrun_world():
    """How many processes torchrun started (1 for a plain run)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def validate(args):
    world = torchrun_world()

    def need(ok, msg):
        if not ok:
            raise ArgError(msg)

    for name in ("dense_frac", "head_frac", "mlp_frac", "end_frac", "alpha0"):
        v = getattr(args, name)
        need(v is None or 0 < v <= 1, f"--{name.replace('_', '-')} must be in (0, 1], got {v}")
    need(args.churn is None or args.churn > 0, f"--churn must be positive, got {args.churn}")
    for name in ("epochs", "batch_size", "update_every", "workers"):
        need(getattr(args, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    need(args.max_steps is None or args.max_steps > 0, f"--max-steps must be positive, got {args.max_steps}")
    need(args.batch_size % world == 0, f"--batch-size {args.batch_size} (the global batch) must divide by the {world} ranks")
    need(args.lr > 0 and args.weight_decay >= 0 and args.warmup_epochs >= 0 and args.clip_grad >= 0,
         "--lr must be positive; --weight-decay, --warmup-epochs and --clip-grad non-negative")
    need(0 <= args.label_smoothing < 1, f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    need(args.ema_decay is None or 0 < args.ema_decay < 1, f"--ema-decay must be in (0, 1), got {args.ema_decay}")
    need(args.model in PRESETS, f"unknown --model {args.model!r}; choose from {', '.join(PRESETS)}")
    need(args.init_batches > 0, f"--init-batches must be positive, got {args.init_batches}")
    need(args.pretrained_heads is None or args.pretrained_heads > 0, f"--pretrained-heads must be positive, got {args.pretrained_heads}")
    need(not args.eval_only or args.resume, "--eval-only needs --resume CHECKPOINT")
    need(not args.pretrained or args.resume or args.pretrained.startswith("torchvision:") or os.path.isfile(args.pretrained),
         f"--pretrained {args.pretrained!r}: no such file")  # here, so study.py stops once; a resume needs only its checkpoint
    if not args.pretrained:  # else the shape comes from the weights file: checked once it is read
        check_img_size(args.img_size, PRESETS[args.model])
    need(args.method in METHODS, f"unknown --method {args.method!r}; choose from {', '.join(METHODS)}")
    for cls in (Barter, Masked):
        need(args.method != cls.name or args.grow in (None,) + cls.grows,
             f"--grow {args.grow} is not a way {cls.name} grows; choose {' or '.join(cls.grows)}")
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


def pick_device(name):
    """'auto' is cuda when there is one, else cpu."""
    return torch.device(name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))


def total_steps(args, spe):
    """The run's optimizer steps: --epochs of spe steps each, a fractional epoch rounded to a step."""
    return round(args.epochs * spe)


def run_dir(args):
    return args.out_dir or f"runs/{args.method}-d{args.dense_frac}-{args.model}-{args.data}-s{args.seed}"


def load_resume(args):
    try:
        ckpt = vit.read_checkpoint(args.resume)
    except vit.WeightsError as e:
        raise ArgError(f"--resume {e}") from None
    default = {k: f.default for k, f in Args.__dataclass_fields__.items()}  # for arguments added since
    if ckpt["args"].get("method") == "masked" and ckpt["args"].get("grow") in ("clone", "fresh"):
        ckpt["args"]["grow"] = "gradient"  # recorded before masked had --grow: it grew by the gradient
    differ = [k for k, v in asdict(args).items() if k not in RESUMABLE_CHANGES and ckpt["args"].get(k, default[k]) != v]
    if differ:
        raise ArgError("--resume checkpoint was made with other arguments: " +
                       ", ".join(f"--{k.replace('_', '-')} {ckpt['args'].get(k, default[k])!r} (now {getattr(args, k)!r})" for k in differ))
    return ckpt


def make_method(name, model, schedule, dense_frac, head_frac=None, mlp_frac=None, distribution="erk", seed=0, grow=None,
                trade=True):
    way = {} if grow is None else {"grow": grow}  # None: the method's own default
    if name in ("barter", "masked"):
        return (Barter if name == "barter" else Masked)(model, schedule, dense_frac, head_frac, mlp_frac, seed=seed,
                                                         trade=trade, **way)
    if name == "static":  # never grows
        return Static(model, schedule, dense_frac, head_frac, mlp_frac, seed=seed, trade=trade)
    if name in ("rigl", "set"):
        return Unstructured(model, schedule, dense_frac, "gradient" if name == "rigl" else "random", distribution, seed)
    if name == "bidst":
        return BiDST(model, schedule, dense_frac, seed=seed)
    return Dense(model)


def make_optimizer(model, lr, weight_decay, fused=None):
    """AdamW, weight decay on matrices only. On CUDA the fused kernel, capturable, with the lr held in a
    0-dim device tensor: a compact model's step is short enough that the default's many launches show,
    and a captured step (Stepper) must read the lr from memory that is filled before each replay. On
    the CPU a float lr and torch's default kernels, as ever, so CPU runs repeat bit for bit.
    fused=True asks for the fused kernel and the tensor lr on any device (tests)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and n not in ("pos_embed", "cls_token") else no_decay).append(p)
    dev = next(model.parameters()).device
    fused = dev.type == "cuda" if fused is None else fused
    kw = dict(fused=True, capturable=dev.type == "cuda", lr=torch.tensor(float(lr), device=dev)) if fused else dict(lr=lr)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], betas=(0.9, 0.999), **kw)


def set_lr(opt, lr):
    """Every group's lr: filled in place where it is a tensor (no host sync, and a captured step sees it)."""
    for g in opt.param_groups:
        if torch.is_tensor(g["lr"]):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


def load_optimizer(opt, sd):
    """opt.load_state_dict, keeping this optimizer's kernel choice and the form of its lr (a checkpoint may
    come from another device; torch takes both from the file, and places the step counts by them)."""
    own = ("fused", "capturable", "foreach")
    groups = [{**saved, **{k: g[k] for k in own},
               "lr": g["lr"].clone().fill_(float(saved["lr"])) if torch.is_tensor(g["lr"]) else float(saved["lr"])}
              for saved, g in zip(sd["param_groups"], opt.param_groups)]
    opt.load_state_dict({**sd, "param_groups": groups})


class EMA:
    """An exponential moving average of the trainable weights (timm's ModelEma, DeiT's model_ema):
    one tensor per Parameter in `shadow`, keyed by the Parameter as optimizer.state is, so that a
    BARTER update gathers it through the same indices as the weights (barter.resize) and a masked
    method zeroes it where it masks (baselines.apply_masks). The decay warms up as TensorFlow's
    ExponentialMovingAverage with num_updates: min(decay, (1 + t) / (10 + t)) at step t."""

    def __init__(self, model, decay):
        self.decay = decay
        self.shadow = {p: p.detach().clone() for p in self.params(model)}

    @staticmethod
    def params(model):
        return [p for p in model.parameters() if p.requires_grad]

    @torch.no_grad()
    def update(self, model, t):
        ps = self.params(model)  # one multi-tensor lerp per step, as timm's ModelEmaV3 does it
        torch._foreach_lerp_([self.shadow[p] for p in ps], [p.detach() for p in ps], 1 - min(self.decay, (1 + t) / (10 + t)))

    @contextmanager
    def swapped_in(self, model):
        """The model holds the average inside the with-block and its own weights again after it."""
        own = {p: p.detach().clone() for p in self.params(model)}
        with torch.no_grad():
            for p in own:
                p.copy_(self.shadow[p])
        try:
            yield
        finally:
            with torch.no_grad():
                for p, w in own.items():
                    p.copy_(w)

    def state_dict(self, model):
        return {n: self.shadow[p] for n, p in model.named_parameters() if p.requires_grad}

    def load_state_dict(self, model, sd):
        new = {p: sd[n].to(p.device, p.dtype) for n, p in model.named_parameters() if p.requires_grad}
        self.shadow.clear()  # in place: the method holds this same dict
        self.shadow.update(new)


def train_step(model, fwd, method, opt, x, y, amp, clip=0.0, smoothing=0.0):
    """Forward, backward, the method's statistics, clipping and the optimizer step: device work only, no
    host sync and no tensor made from host values, so that it can be captured as one CUDA graph.
    Returns the loss (a device tensor)."""
    with amp:
        loss = F.cross_entropy(fwd(x), y, label_smoothing=smoothing)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    method.after_backward(opt)  # statistics come from this step's gradients, before clipping
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # scales by min(1, clip / norm) on the device
    opt.step()
    return loss.detach()


class Graph:
    """torch.cuda.CUDAGraph as the Stepper uses it (the tests hand it a stand-in with the same methods).
    capture(fn) records fn's kernels without running them and keeps fn's output, whose memory every
    replay() refills. All captures draw on one memory pool and the graph before is freed first, so a
    run that captures again after every update does not grow its reserved memory. Warm-up and capture
    share one side stream, as PyTorch's docs on whole-network capture ask."""

    def __init__(self):
        self.pool, self.stream, self.graph, self.out = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), None, None

    @contextmanager
    def side_stream(self):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def capture(self, fn):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            self.out = fn()

    def replay(self):
        self.graph.replay()
        return self.out

    def release(self):
        self.graph = self.out = None


class Stepper:
    """Runs step t of a run: train_step, then the method's host-side after_step (its step count, and the
    topology update when one is due). With a graph (Graph, on CUDA), steps between updates replay one
    captured train_step on static input buffers: a few eager warm-up steps on the graph's stream, then a
    capture, then a replay per step. A step that updates the topology runs eagerly and releases the
    graph: it changes the tensors (shapes, statistics buffers) the graph was captured with, so the
    next steps warm up and capture again. `fwd` is what the step calls: the model, its DDP wrapper or
    its compiled form (set again by the caller after an update)."""

    WARMUP = 2  # eager steps before each capture

    def __init__(self, model, method, opt, amp, clip=0.0, smoothing=0.0, graph=None):
        self.model, self.fwd, self.method, self.opt, self.amp = model, model, method, opt, amp
        self.clip, self.smoothing, self.graph = clip, smoothing, graph
        self.warm, self.captured, self.captures, self.x, self.y = 0, False, 0, None, None

    def step(self, x, y):
        return train_step(self.model, self.fwd, self.method, self.opt, x, y, self.amp, self.clip, self.smoothing)

    def release(self):
        if self.graph is not None:
            self.graph.release()
        self.warm, self.captured = 0, False

    def __call__(self, x, y, t):
        """(loss, update record or None). The loss is a device tensor; a replayed step's is refilled by
        the next replay, so read or add it before the next step."""
        g = self.graph
        if g is None or self.method.updates_at(t):
            self.release()
            self.method.before_forward(t)
            loss = self.step(x, y)
        else:
            if self.captured and x.shape != self.x.shape:  # a batch of another shape: capture anew
                self.release()
            if self.captured:
                self.x.copy_(x)
                self.y.copy_(y)
                loss = g.replay()
            elif self.warm < self.WARMUP:
                with g.side_stream():
                    loss = self.step(x, y)
                self.warm += 1
            else:
                self.x, self.y = x.clone(), y.clone()  # the static input buffers
                self.opt.zero_grad(set_to_none=True)  # the graph's own gradients are made in its pool
                g.capture(lambda: self.step(self.x, self.y))
                self.captured, self.captures = True, self.captures + 1
                loss = g.replay()
        return loss, self.method.after_step(self.opt, t)


def bf16_supported(device):
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def autocast(device, bf16):
    # no cast cache: PyTorch's CUDA-graph notes ask for it off where a step is captured (a cached cast
    # would outlive the capture that made it); every weight is cast once per forward here, so it saves nothing
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False) if bf16 else nullcontext()


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
    if rec.get("traded"):
        moved += ", channels traded for a head" if rec["traded"] > 0 else ", a head traded for channels"
    return f"step {rec['step']}: moved {moved}" + (" | " + " | ".join(parts) if parts else "")


@torch.no_grad()
def evaluate(fwd, loader, amp, ranks=None):
    """Top-1 on the loader's images (under torchrun each rank counts its share)."""
    was = fwd.training
    fwd.eval()
    correct, total = 0, 0  # counted on the device: one read at the end, not one sync per batch
    for x, y in loader.epoch(0):
        with amp:
            correct = correct + (fwd(x).argmax(1) == y).sum()
        total += len(y)
    correct = int(correct)
    fwd.train(was)
    if ranks is not None:
        correct, total = ranks.reduce(correct), ranks.reduce(total)
    return correct / max(total, 1)


def environment(device):
    """What decides a run's numbers beside its arguments. A run reproduces bit for bit only under the
    same torch, device and CPU thread count: the accuracy protocol's barter run at d = 0.1, seed 0,
    made 0.8622 on one thread and 0.8660 on two, on the same CPU (README, "Training")."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "cpu_threads": torch.get_num_threads(), "torch": str(torch.__version__)}  # a plain str: checkpoints load with weights_only


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


# ---- fine-tuning: pretrained weights in, the compact start chosen from them ---------------------------

def read_pretrained(args):
    """The pretrained model (dense or compact, on the CPU), its shape checked against the arguments."""
    try:
        model, kind = vit.load_pretrained(args.pretrained, args.pretrained_heads)
    except vit.WeightsError as e:
        raise ArgError(f"--pretrained {e}") from None
    check_img_size(args.img_size, model.cfg)
    if args.method in UNIT_METHODS:
        check_budgets(args, model.cfg)
    c = model.cfg
    print(f"pretrained: {kind} weights from {args.pretrained}: {c.depth} blocks of width {c.dim}, {c.num_heads} heads, "
          f"MLP {c.mlp_hidden}, {c.img_size} px in patches of {c.patch_size}, {c.num_classes} classes")
    return model


@torch.no_grad()
def adapt(model, cfg, gen):
    """The pretrained model made fit for this data (cfg): grey images, the patch grid, the classes; a
    compact model is widened to its dense shape with fresh units that output nothing."""
    old = model.cfg
    if old.in_chans != cfg.in_chans:
        if (old.in_chans, cfg.in_chans) != (3, 1):
            raise ArgError(f"--pretrained weights take {old.in_chans} channels, the data has {cfg.in_chans}")
        w, b = model.patch_embed.weight, model.patch_embed.bias  # grey = RGB with three equal channels
        model.patch_embed = torch.nn.Conv2d(1, old.dim, old.patch_size, old.patch_size).to(w.dtype)
        model.patch_embed.weight.copy_(w.sum(1, keepdim=True))
        model.patch_embed.bias.copy_(b)
        print("grey images: the RGB patch embedding is summed over its three channels")
    grid = cfg.img_size // cfg.patch_size
    model.pos_embed = torch.nn.Parameter(vit.resample_pos_embed(model.pos_embed.detach(), grid))
    if old.num_classes != cfg.num_classes:
        model.head = torch.nn.Linear(old.dim, cfg.num_classes)
        torch.nn.init.zeros_(model.head.weight)
        torch.nn.init.zeros_(model.head.bias)
        print(f"new classifier head for {cfg.num_classes} classes (the weights have {old.num_classes}): zero, then "
              f"fitted to the frozen features of the --init-batches before units are scored")
    model.cfg = cfg
    dense = {"heads": cfg.num_heads, "mlp": cfg.mlp_hidden}
    widen = {k: [None if n == dense[k] else torch.cat([torch.arange(n), torch.full((dense[k] - n,), FRESH)])
                 for n in model.counts(k)] for k in dense}
    resize(model, None, widen["heads"], widen["mlp"], generator=gen)
    return model


def fit_head(model, batches, steps=200):
    """Fit a zero head to the frozen features of `batches` (logistic regression, Adam)."""
    with torch.no_grad():
        feats = torch.cat([model.features(x).float() for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    W = torch.zeros_like(model.head.weight, dtype=torch.float32, requires_grad=True)
    b = torch.zeros_like(model.head.bias, dtype=torch.float32, requires_grad=True)
    opt = torch.optim.Adam([W, b], lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(feats @ W.T + b, ys).backward()
        opt.step()
    with torch.no_grad():
        model.head.weight.copy_(W)
        model.head.bias.copy_(b)


def choose_start(model, args, cfg, batches, amp, new_head):
    """What init_model needs to start from the pretrained weights, a record of the choice, and mean_loss()
    over the scoring batches (the record holds it before and after the slicing)."""
    t0 = time.perf_counter()
    if new_head:
        fit_head(model, batches)

    def loss_of(x, y):
        with amp:
            return F.cross_entropy(model(x), y, label_smoothing=args.label_smoothing)

    @torch.no_grad()
    def mean_loss():
        return sum(float(loss_of(x, y)) for x, y in batches) / len(batches)

    rec = {"select": args.select, "batches": len(batches)}
    rec["loss_dense"] = mean_loss()
    kw = {}
    if args.method in UNIT_METHODS:
        budget, lo, hi = unit_budgets(cfg, args.dense_frac, args.head_frac, args.mlp_frac)
        kw["keep"] = initial_units(model, args.select, budget, lo, hi, batches, loss_of)
    elif args.method in WEIGHT_METHODS:
        kw["magnitude"] = True  # random masks would throw most of the pretrained function away
    rec["seconds"] = time.perf_counter() - t0
    return kw, rec, mean_loss


def eval_checkpoint(args):
    """--eval-only: the checkpoint's model on its test split."""
    try:
        ckpt = vit.read_checkpoint(args.resume)
    except vit.WeightsError as e:
        raise ArgError(f"--resume {e}") from None
    model = vit.from_checkpoint(ckpt).eval()
    a = {**asdict(Args()), **{k: v for k, v in ckpt["args"].items() if k in Args.__dataclass_fields__}}
    device = pick_device(args.device)
    data_dir = args.data_dir if args.data_dir != Args.data_dir else a["data_dir"]
    _, test_dl, _ = data.load(a["data"], data_dir, a["batch_size"], device, model.cfg.img_size, a["seed"], args.workers)
    amp = autocast(device, a["bf16"] and bf16_supported(device))
    top1 = evaluate(model.to(device), test_dl, amp)
    print(f"{args.resume}: {a['method']} d={a['dense_frac']} at step {ckpt['step']}, test top-1 {top1:.4f} "
          f"on the {a['data']} test split")
    if ckpt.get("ema"):
        top1_ema = evaluate(vit.from_checkpoint(ckpt, ema=True).eval().to(device), test_dl, amp)
        print(f"the average of its weights (--ema-decay {a['ema_decay']}): test top-1 {top1_ema:.4f}")
    return top1


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
        model = adapt(pre, cfg, torch.Generator().manual_seed(args.seed)).to(device)
        batches = list(itertools.islice(train_dl.epoch(0), args.init_batches))
        init_kw, init_rec, mean_loss = choose_start(model, args, cfg, batches, amp, base.num_classes != cfg.num_classes)
    else:
        shapes = {"heads": ckpt["heads"], "mlp": ckpt["mlp"]} if ckpt else {}
        model = ViT(cfg, **shapes).to(device)
    spe = len(train_dl)
    steps = total_steps(args, spe)
    if steps < 1:
        raise ArgError(f"--epochs {args.epochs} is less than one step of the {spe} in an epoch")
    # BARTER and masked update from the first interval (barter.Schedule says why). The weight-level
    # baselines wait for the end of the lr warmup: regrowing a quarter of every layer by the gradients
    # of a model that has barely trained cost rigl 0.54-0.56 points on the protocol (EXPERIMENTS.md,
    # "RigL's updates wait for the warmup"). set and bidst swap weights the same way and follow rigl
    # (not measured on their own).
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
                         args.distribution, args.seed, args.grow, args.trade)
    if ckpt is None:
        method.init_model(**init_kw)
    if init_rec:
        init_rec["loss_start"] = mean_loss()
        print(f"compact start by {args.select} over {len(batches)} batches in {init_rec['seconds']:.1f} s (one-time dense "
              f"cost): loss {init_rec['loss_dense']:.4f} dense -> {init_rec['loss_start']:.4f} at step 0")
    return train_dl, test_dl, cfg, model, method, init_rec


class Ranks:
    """The processes of a torchrun job (RANK, WORLD_SIZE, LOCAL_RANK in the environment; NCCL on CUDA,
    gloo on the CPU), or the one process of a plain run: which device, who writes, and the few
    reductions the training loop needs so that every rank sees the same numbers."""

    def __init__(self, device_name):
        env = os.environ
        self.rank, self.world, self.local = int(env.get("RANK", 0)), torchrun_world(), int(env.get("LOCAL_RANK", 0))
        self.main = self.rank == 0
        self.device = pick_device(device_name)
        if self.device.type == "cuda" and self.world > 1:
            self.device = torch.device("cuda", self.local)
            torch.cuda.set_device(self.device)
        self.owns_group = self.world > 1 and not dist.is_initialized()
        self.compiled_shapes = None  # the parameter shapes dynamo last compiled (wrap)
        if self.owns_group:
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    def reduce(self, value, op="sum"):
        if self.world == 1:
            return float(value)
        t = torch.tensor(float(value), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.item()

    def wrap(self, model, compile):
        """What the training step calls: the model, in DDP under torchrun (rebuilt after every resize:
        DDP holds the parameters it was built with), compiled if asked."""
        fwd = model
        if self.world > 1:
            empty = any(b.attn.num_heads == 0 or b.mlp.hidden == 0 for b in model.blocks)  # their norms go unused
            fwd = DDP(model, device_ids=[self.local] if self.device.type == "cuda" else None, find_unused_parameters=empty)
        if not compile:
            return fwd
        shapes = [p.shape for p in model.parameters()]
        if shapes != self.compiled_shapes:
            # dynamo keeps 8 graphs of a function and then runs it eagerly for the rest of the process,
            # with one warning: a run resized more often would drop to eager unseen. Start afresh at
            # each new set of shapes instead: the next step recompiles
            torch.compiler.reset()
            self.compiled_shapes = shapes
        return torch.compile(fwd)

    def check_lockstep(self, counts, step):
        """Every rank must have made the same topology decision; say so clearly if not (before DDP
        would fail on mismatched shapes, or hang)."""
        if self.world == 1:
            return
        every = [None] * self.world
        dist.all_gather_object(every, counts)
        if any(c != every[0] for c in every):
            raise RuntimeError(f"ranks disagree on the units after the update at step {step}: " +
                               "; ".join(f"rank {r}: {c}" for r, c in enumerate(every)))

    def close(self, finished=True):
        if self.owns_group:
            if finished:  # no rank tears its group down while a peer's last collective is in flight
                dist.barrier()  # (seen: gloo aborting a rank at exit, "terminate called without an active exception")
            dist.destroy_process_group()


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
            out = train(args, ranks)
    except BaseException:
        ranks.close(finished=False)  # a failed rank must not wait for peers that will never come
        raise
    ranks.close()
    return out


def train(args, ranks):
    ckpt = load_resume(args) if args.resume else None
    device = ranks.device
    out = run_dir(args)
    torch.manual_seed(args.seed)
    amp = autocast(device, args.bf16 and bf16_supported(device))  # the CPU trains in fp32
    train_dl, test_dl, cfg, model, method, init_rec = build(args, ckpt, device, amp, ranks)
    spe = len(train_dl)
    total = total_steps(args, spe)
    opt = make_optimizer(model, args.lr, args.weight_decay)
    ema = EMA(model, args.ema_decay) if args.ema_decay else None
    method.shadow = ema.shadow if ema else None
    step = 0
    if ckpt:
        model.load_state_dict(ckpt["model"])
        load_optimizer(opt, ckpt["optimizer"])
        if ema:
            ema.load_state_dict(model, ckpt["ema"])
        method.load_state_dict(ckpt["method"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:  # bidst's noise on CUDA
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
        step = ckpt["step"]
    fwd = ranks.wrap(model, args.compile)
    graphs = args.cuda_graph and ranks.world == 1  # under DDP the step runs eagerly (said in the first line)
    stepper = Stepper(model, method, opt, amp, args.clip_grad, args.label_smoothing, Graph() if graphs else None)
    stepper.fwd = fwd
    env = environment(device)
    end = min(total, args.max_steps or total)
    warm = args.warmup_epochs * spe

    def lr_at(t):
        return args.lr * (t / warm if t <= warm else 0.5 * (1 + math.cos(math.pi * (t - warm) / max(total - warm, 1))))

    def checkpoint():
        if ranks.main:  # every rank holds the same model: one file, from rank 0
            save_checkpoint(os.path.join(out, "checkpoint.pt"), args=asdict(args), cfg=asdict(cfg),
                            heads=model.counts("heads"), mlp=model.counts("mlp"), model=model.state_dict(),
                            optimizer=opt.state_dict(), method=method.state_dict(), step=step,
                            ema=ema.state_dict(model) if ema else None, env=env,
                            rng={"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None})

    # everything that can fail on bad input has run: only now does the run get its folder
    log_path = os.path.join(out, "log.jsonl")
    if ranks.main:
        os.makedirs(out, exist_ok=True)
        if ckpt:  # records written after the checkpoint (a kill mid-epoch) are replayed: drop them
            kept = [r for r in read_log(out) if r["step"] <= step and r["type"] != "summary"] if os.path.exists(log_path) else []
            with open(log_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
    signalled = []  # Ctrl-C / SIGTERM: finish the current step, save, and exit cleanly (all ranks)
    handler = lambda sig, frame: signalled.append(sig)
    old_handlers = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def should_stop(t):
        # under torchrun every rank must stop at the same step: agree on it every 10 steps
        if ranks.world == 1:
            return bool(signalled)
        return t % 10 == 0 and ranks.reduce(bool(signalled), "max") > 0

    log = open(log_path if ranks.main else os.devnull, "a" if ckpt else "w")
    counts = {}
    print(f"{args.method} d={args.dense_frac} {args.pretrained or args.model} on {args.data} ({device}"
          f"{f', {ranks.world} ranks' if ranks.world > 1 else ''}): {sum(p.numel() for p in model.parameters()):,} "
          f"parameters, density {method.density():.4f}, {spe} steps/epoch, {total} steps" + (f", resumed at step {step}" if ckpt else "")
          + (", the step captured as a CUDA graph" if graphs else "; --cuda-graph: under torchrun the step runs eagerly"
             if args.cuda_graph else ""))
    was = (ckpt or {}).get("env") or env  # checkpoints from before the record have none
    changed = [f"{k} {v} (the run had {was.get(k)})" for k, v in env.items() if was.get(k) != v]
    if changed:
        print("resumed with " + ", ".join(changed) + ": it continues correctly, but not bit for bit as a run never stopped")
    if args.method in UNIT_METHODS:
        print("units per block: " + " | ".join(f"{k} " + " ".join(map(str, method.counts(k))) for k in ("heads", "mlp")))
        counts = {k: method.counts(k) for k in ("heads", "mlp")}
    if not ckpt:  # what a reader of the log (plot.py, study.py) needs to know about the run
        log.write(json.dumps({"type": "start", "step": 0, "args": asdict(args), "cfg": asdict(cfg), "init": init_rec,
                              "world": ranks.world, "env": env, "dense": {"heads": cfg.num_heads, "mlp": cfg.mlp_hidden},
                              "counts": counts}) + "\n")
    stop = False
    try:
        while step < end and not stop:
            epoch, first = divmod(step, spe)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t0, n_img, n_steps, loss_sum = time.perf_counter(), 0, 0, torch.zeros((), device=device)
            bar = tqdm(total=min(spe, end - epoch * spe), initial=first, desc=f"epoch {epoch + 1}/{math.ceil(args.epochs)}",
                       leave=False, disable=None if ranks.main else True)
            for x, y in train_dl.epoch(epoch, first):
                step += 1
                set_lr(opt, lr_at(step))
                loss, rec = stepper(x, y, step)
                if ema:  # after the update: the average was resized or masked with the model
                    ema.update(model, step)
                loss_sum += loss
                n_img += len(y) * ranks.world
                n_steps += 1
                bar.update(1)
                if rec is not None:
                    ranks.check_lockstep(rec["counts"], step)
                    stepper.fwd = fwd = ranks.wrap(model, args.compile)
                    tqdm.write(f"[{args.method}] " + show_counts(rec, counts))
                    counts = rec["counts"]
                    log.write(json.dumps({"type": "update", **rec}) + "\n")
                    log.flush()
                stop = should_stop(step)
                if step % 20 == 0 or step == end or stop:
                    shown = ranks.reduce(loss) / ranks.world
                    if not math.isfinite(shown):
                        raise FloatingPointError(f"loss is {shown} at step {step}")
                    bar.set_postfix(loss=f"{shown:.3f}", img_s=f"{n_img / (time.perf_counter() - t0):.0f}")
                if step >= end or stop:
                    break
            sync(device)
            seconds = time.perf_counter() - t0
            bar.close()
            done_epoch = step % spe == 0
            rec = {"type": "epoch" if done_epoch else "partial-epoch", "epoch": epoch + 1, "step": step,
                   "train_loss": ranks.reduce(loss_sum) / ranks.world / max(n_steps, 1), "seconds": seconds,
                   "img_per_s": n_img / seconds, "peak_mem_mb": ranks.reduce(peak_memory_mb(device), "max"),
                   "mem": "cuda-allocator-peak" if device.type == "cuda" else "process-peak-rss",
                   "params": sum(p.numel() for p in model.parameters()), "density": method.density()}
            if not math.isfinite(rec["train_loss"]):
                raise FloatingPointError(f"loss is {rec['train_loss']} in epoch {epoch + 1}")
            rec["test_top1"] = evaluate(fwd, test_dl, amp, ranks)
            if ema:
                with ema.swapped_in(model):
                    rec["test_top1_ema"] = evaluate(fwd, test_dl, amp, ranks)
            tqdm.write(f"epoch {epoch + 1} step {step}: loss {rec['train_loss']:.4f} top-1 {rec['test_top1']:.4f} "
                       + (f"(average {rec['test_top1_ema']:.4f}) " if ema else "") +
                       f"{rec['img_per_s']:.0f} img/s peak {rec['peak_mem_mb']:.0f} MB density {rec['density']:.4f}")
            log.write(json.dumps(rec) + "\n")
            log.flush()
            checkpoint()
        if not stop and ranks.main:
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
    if "final_top1_ema" in s:
        lines.append(f"average of the weights (--ema-decay): test top-1 {s['final_top1_ema']:.4f} (best {s['best_top1_ema']:.4f})")
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
    if torchrun_world() > 1:
        # a torchrun rank whose work is written and whose group is destroyed skips the interpreter's
        # finalization, where gloo's threads still abort a rank now and then ("terminate called
        # without an active exception": seen once in a full test run after the barrier in Ranks.close;
        # pytorch/pytorch#179291 traces such aborts to objects freed while the interpreter finalizes)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
