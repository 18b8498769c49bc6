"""
The training step of any method, and where it runs. One step is forward, backward, the method's
statistics, clipping and AdamW, with no host sync inside, so that on CUDA it can be captured as one
CUDA graph and replayed: a compact model's kernels are short, and on a fast GPU the host's launches,
not the arithmetic, would decide the step. Shapes change only at a topology update, so a step that
updates runs eagerly and the step is captured again after it (Stepper). The same code runs every
method, eager or captured. Below it: the optimizer, an average of the weights, evaluation, and the
processes a run has (one, or the ranks of a torchrun job, Ranks).
"""
import gc
import os
import platform
import resource
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def train_step(model, fwd, method, opt, x, y, amp, clip=0.0, smoothing=0.0):
    """Forward, backward, the method's statistics, clipping and the optimizer step: device work only, no
    host sync and no tensor made from host values, so that it can be captured as one CUDA graph.
    Returns the loss (a device tensor), NaN where the gradient was not finite."""
    with amp:
        loss = F.cross_entropy(fwd(x), y, label_smoothing=smoothing)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    method.after_backward(opt)  # statistics come from this step's gradients, before clipping
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # scales by min(1, clip / norm) on the device
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    opt.step()
    # an inf or NaN gradient (which clipping lets through) spoils the weights while this step's loss is still
    # finite: it makes the returned loss NaN (0 * inf and 0 * NaN are NaN, 0 * a number is 0), so the caller's
    # check of the loss stops the run before a checkpoint holds those weights, with no host sync here
    return loss.detach() + 0 * norm


class Graph:
    """torch.cuda.CUDAGraph as the Stepper uses it (the tests hand it a stand-in with the same methods).
    capture(fn) records fn's kernels without running them and keeps fn's output, whose memory every
    replay() refills. What the graph uses belongs to the model's device, whatever the current device is
    (captured on another, a graph records nothing and every replay does nothing): the side stream that
    warm-up and capture share, as PyTorch's notes on whole-network capture ask, and one memory pool held
    for the whole run. Every capture draws on that pool and the graph before gives its memory back to it,
    so a run that captures again after every update does not grow its reserved memory; a pool handle
    instead dies with its last graph, and capturing into it again while one of its tensors lives (a
    replayed loss, say) trips the allocator. The capture forbids unsafe CUDA calls in this thread only:
    a DataLoader's pin-memory thread keeps calling the CUDA runtime meanwhile. A capture that recorded
    nothing is an error, not torch's warning."""

    def __init__(self, device):
        self.graph = self.out = None  # set before the pool: attributes are freed in the order they were set
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.pool, self.stream = torch.cuda.MemPool(), torch.cuda.Stream()

    @contextmanager
    def side_stream(self):
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                yield
            torch.cuda.current_stream().wait_stream(self.stream)

    def capture(self, fn):
        self.graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()  # no garbage collection inside a capture: a Graph freed there would free CUDA memory mid-capture
        try:
            with torch.cuda.device(self.device), warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                with torch.cuda.graph(self.graph, pool=self.pool.id, stream=self.stream, capture_error_mode="thread_local"):
                    self.out = fn()
        finally:
            if collecting:
                gc.enable()
        for w in seen:
            if "CUDA Graph is empty" in str(w.message):
                self.release()
                raise RuntimeError(f"the captured step recorded no kernel on {self.device}: its replays would do nothing")
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)  # any other warning, as it was

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


# ---- the optimizer, an average of the weights, the device -------------------------------------------

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
    # capturable on CUDA whether or not this run captures: torch refuses to capture the step of an optimizer
    # that is not, and the fused kernel is the same either way (torch's fused AdamW takes the flag for
    # consistency only), so an eager step (warm-up, an update's step, an eager or torchrun run) loses nothing
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


# ---- where the step runs: one process, or the ranks of a torchrun job ------------------------------

def pick_device(name):
    """'auto' is cuda when there is one, else cpu."""
    return torch.device(name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))


def environment(device):
    """What decides a run's numbers beside its arguments: a run repeats bit for bit only under the same
    torch, device and CPU thread count. Plain strings and numbers, so checkpoints load with weights_only."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "cpu_threads": torch.get_num_threads(), "torch": str(torch.__version__)}


def torchrun_world():
    """How many processes torchrun started (1 for a plain run)."""
    return int(os.environ.get("WORLD_SIZE", 1))


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
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # cuda:N or a rank's GPU: what torch makes without a device goes there
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
            # dynamo keeps a few graphs of a function and then runs it eagerly for the rest of the process:
            # a run resized more often would drop to eager unseen. Start afresh at each new set of shapes
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
