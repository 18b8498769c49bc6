"""
Full-tensor, mask-based dynamic sparse training: the methods BARTER is compared against.

Every method keeps the dense ViT and a 0/1 mask per sparse tensor. The mask is multiplied in on
every forward (a torch parametrization, so the gradient reaching the stored weight is masked too),
masked weights and their optimizer state are zeroed at every mask change, and AdamW/SGD then keep
them exactly zero (zero gradient, zero state, decay of zero is zero). `check_zero` asserts it.
Compute and memory are those of the dense model: that is the cost BARTER avoids.

  static  BARTER's compact start (same units, budgets, init), never updated: the control
  masked  structured: head and MLP-channel masks, BARTER's budgets, schedule and prune scores;
          grows masked units by their dense gradient
  rigl    unstructured per linear layer: drop smallest |W|, grow largest dense |grad|
  set     as rigl, random growth
  bidst   unstructured, mask logits learned through the loss, binarized at mask updates
  dense   no sparsity
"""
import math
import time

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from barter import (Barter, accumulate, all_mean, channels_per_head, choose, round_half_up, shares_budget, taylor_scores,
                    uniform, unit_budgets)
from vit import KINDS, leaf, per_row


class Static(Barter):
    """BARTER's compact start, trained with no topology update (and no statistics): the control
    that tells whether moving units helps at all."""

    name = "static"

    def updates_at(self, t):
        return False

    def after_backward(self, optimizer):
        pass

    def after_step(self, optimizer, t):
        return None


class Mask(nn.Module):
    """Parametrization W -> W * mask (+ fill). `mask` is method state, not a buffer of the model.
    With `capture` on, the dense gradient dL/d(W*mask) of the next backward lands in `.grad`."""

    def __init__(self, mask):
        super().__init__()
        self.mask, self.fill, self.capture, self.grad = mask, None, False, None

    def forward(self, w):
        w = w * self.mask
        if self.fill is not None:
            w = w + self.fill
        if self.capture and w.requires_grad:
            w.register_hook(self.keep)
        return w

    def keep(self, g):
        self.grad = g


class MaskedMethod:
    """Shared mechanism: masks on (module, attr) pairs, zeroing of weights and optimizer state."""

    shadow = None  # an average of the weights ({Parameter: tensor}, step.EMA): masked like the weights

    def __init__(self, model, schedule, seed):
        self.model, self.schedule = model, schedule
        self.gen = torch.Generator().manual_seed(seed)
        self.masks = {}  # name -> Mask parametrization

    def updates_at(self, t):
        """Whether step t ends with a mask update (step.Stepper runs such a step eagerly)."""
        return self.schedule.is_update(t)

    def add_mask(self, name, mod, attr, mask):
        p = Mask(mask.to(getattr(mod, attr).device, getattr(mod, attr).dtype))
        parametrize.register_parametrization(mod, attr, p)
        self.masks[name] = (mod, attr, p)

    def weight(self, name):
        mod, attr, _ = self.masks[name]
        return leaf(mod, attr)

    @torch.no_grad()
    def apply_masks(self, optimizer):
        """Zero masked weights, their gradients, every optimizer state tensor of their shape and their
        average (a unit grown back starts its average from zero, as its weights were until then)."""
        for name, (mod, attr, p) in self.masks.items():
            W = leaf(mod, attr)
            W.mul_(p.mask)
            if self.shadow is not None:
                self.shadow[W].mul_(p.mask)
            if W.grad is not None:
                W.grad.mul_(p.mask)
            state = optimizer.state.get(W, {}) if optimizer is not None else {}
            for v in state.values():
                if torch.is_tensor(v) and v.shape == W.shape:
                    v.mul_(p.mask)

    @torch.no_grad()
    def check_zero(self, optimizer):
        for name, (mod, attr, p) in self.masks.items():
            W, off = leaf(mod, attr), p.mask == 0
            assert not W[off].any(), f"{name}: a masked weight is not zero"
            for k, v in optimizer.state.get(W, {}).items():
                if torch.is_tensor(v) and v.shape == W.shape:
                    assert not v[off].any(), f"{name}: masked optimizer state {k} is not zero"
            assert self.shadow is None or not self.shadow[W][off].any(), f"{name}: a masked weight's average is not zero"

    def weight_density(self):
        """Active fraction of the block weights (qkv, proj, fc1, fc2), counted from the masks."""
        on = tot = 0
        for name, (mod, attr, p) in self.masks.items():
            if attr == "weight":
                on += int(p.mask.count_nonzero())
                tot += p.mask.numel()
        return on / tot

    def density(self):
        return self.weight_density()

    def base_state(self):
        return {"masks": {n: p.mask.cpu() for n, (_, _, p) in self.masks.items()}, "gen": self.gen.get_state()}

    def load_base_state(self, sd):
        for n, (_, _, p) in self.masks.items():
            p.mask.copy_(sd["masks"][n])
        self.gen.set_state(sd["gen"])


# ----------------------------------------------------------------------------------------------
# structured masked DST: BARTER's units, budgets, schedule and prune scores on full tensors

class Masked(MaskedMethod):
    name = "masked"

    def __init__(self, model, schedule, dense_frac=0.1, head_frac=None, mlp_frac=None, seed=0, budgets="shared"):
        super().__init__(model, schedule, seed)
        cfg = model.cfg
        self.start, self.lo, self.hi = unit_budgets(cfg, dense_frac, head_frac, mlp_frac)
        self.rate, self.shared = channels_per_head(cfg), shares_budget(budgets)
        self.weights = self.start["heads"] * self.rate + self.start["mlp"]
        dense = {"heads": cfg.num_heads, "mlp": cfg.mlp_hidden}
        # the same first units as BARTER's compact init: both start from the identical function
        self.active = {k: [torch.arange(dense[k]) < n for n in uniform(self.start[k], cfg.depth)] for k in KINDS}
        for i, blk in enumerate(model.blocks):
            for kind in KINDS:
                n, w, tensors = blk.units(kind)
                for mod, attr, dim, side, seg in tensors:
                    self.add_mask(f"blocks.{i}.{kind}.{attr}.{side}", mod, attr, self.unit_mask(i, kind, mod, attr))
        self.fresh = {k: [torch.zeros(dense[k], dtype=torch.bool) for _ in model.blocks] for k in KINDS}
        self.reset_stats()

    def unit_mask(self, i, kind, mod, attr):
        n, w, tensors = self.model.blocks[i].units(kind)
        _, _, dim, side, seg = next(t for t in tensors if t[0] is mod and t[1] == attr)
        rows = per_row(self.active[kind][i].float(), w, seg)
        W = getattr(mod, attr)
        shape = [1] * W.ndim
        shape[dim] = -1
        return rows.view(shape).expand(W.shape).to(W.device, W.dtype).contiguous()

    def counts(self, kind):
        return [int(a.sum()) for a in self.active[kind]]

    check = Barter.check  # BARTER's invariants on the active units

    @torch.no_grad()
    def init_model(self, keep=None):
        """Mask all but the units `keep` ({kind: [indices per block]}; default: BARTER's first units)."""
        if keep is not None:
            for kind in KINDS:
                for i, idx in enumerate(keep[kind]):
                    self.active[kind][i] = torch.zeros_like(self.active[kind][i]).index_fill_(0, idx.cpu(), True)
                    for mod, attr, *_ in self.model.blocks[i].units(kind)[2]:
                        mod.parametrizations[attr][0].mask.copy_(self.unit_mask(i, kind, mod, attr))
        self.check(start=True)
        self.apply_masks(None)

    def reset_stats(self):
        dev = self.model.head.weight.device  # on the device, added into in place (Barter.reset_stats says why)
        self.acc = {k: [torch.zeros(a.numel(), device=dev) for a in self.active[k]] for k in KINDS}
        self.acc2 = {k: [torch.zeros(a.numel(), device=dev) for a in self.active[k]] for k in KINDS}
        self.nacc = 0

    def masks_of(self, i, kind, side):
        blk = self.model.blocks[i]
        return [(mod, attr, dim, seg) for mod, attr, dim, s, seg in blk.units(kind)[2] if s == side]

    @torch.no_grad()
    def before_forward(self, t):
        if not self.updates_at(t):
            return
        # Candidates for growth get a fresh input side (q/k/v rows, fc1 row) drawn like the init,
        # only in this forward: their output side is zero, so the function is unchanged, yet the
        # dense gradient of their output side is real. A grown unit keeps this draw, so a regrown
        # head never starts at q = k = 0 (a saddle it would never leave).
        for i, blk in enumerate(self.model.blocks):
            for kind in KINDS:
                for mod, attr, dim, seg in self.masks_of(i, kind, "in"):
                    p = mod.parametrizations[attr][0]
                    if attr == "weight":
                        W = leaf(mod, attr)
                        draw = torch.nn.init.trunc_normal_(torch.empty(W.shape), std=0.02, generator=self.gen)
                        p.fill = draw.to(W.device, W.dtype) * (1 - p.mask)
                for mod, attr, dim, seg in self.masks_of(i, kind, "out"):
                    mod.parametrizations[attr][0].capture = True

    @torch.no_grad()
    def after_backward(self, optimizer):
        accumulate(self.acc, self.acc2, {kind: taylor_scores(self.model, kind) for kind in KINDS})  # masked units score 0

    @torch.no_grad()
    def after_step(self, optimizer, t):
        self.nacc += 1
        if not self.updates_at(t):
            return None
        t0, alpha, moved, prune, grow, squares = time.perf_counter(), self.schedule.alpha(t), {}, {}, {}, {}
        for kind in KINDS:
            prune[kind], grow[kind], squares[kind] = [], [], []
            for i, blk in enumerate(self.model.blocks):
                n, w, _ = blk.units(kind)
                (mod, attr, dim, seg), = self.masks_of(i, kind, "out")
                g = all_mean(mod.parametrizations[attr][0].grad)  # dense gradient of the output side
                gs = g.abs().float().sum(1 - dim).view(n, w).sum(1).tolist()
                acc = (all_mean(self.acc[kind][i]) / max(self.nacc, 1)).tolist()
                acc2 = (all_mean(self.acc2[kind][i]) / max(self.nacc, 1)).tolist()
                active, fresh = self.active[kind][i].tolist(), self.fresh[kind][i].tolist()
                for u in range(n):
                    if active[u]:
                        if not fresh[u]:
                            prune[kind].append((acc[u], i, u))
                            squares[kind].append(acc2[u])
                    else:
                        grow[kind].append((gs[u], i, u))
        # BARTER's choice, trade included, by the same scores; growth by the dense gradient
        before = {k: self.counts(k) for k in KINDS}
        sel, net, trade = choose(before, self.lo, self.hi, prune, grow, alpha, self.rate, squares if self.shared else None)
        for kind in KINDS:
            P, G = sel[kind]
            self.fresh[kind] = [torch.zeros_like(a) for a in self.active[kind]]
            for i, u in P:
                self.active[kind][i][u] = False
            for i, u in G:
                self.active[kind][i][u] = True
                self.fresh[kind][i][u] = True
            moved[kind] = len(P)
        for i, blk in enumerate(self.model.blocks):  # grown units keep their drawn input side
            for kind in KINDS:
                for mod, attr, dim, seg in self.masks_of(i, kind, "in") + self.masks_of(i, kind, "out"):
                    p = mod.parametrizations[attr][0]
                    was = p.mask.clone()
                    p.mask.copy_(self.unit_mask(i, kind, mod, attr))
                    if p.fill is not None:  # state of a grown unit is zero already: it was masked
                        leaf(mod, attr).add_(p.fill * (p.mask > was))
                    p.fill, p.capture, p.grad = None, False, None
        self.apply_masks(optimizer)
        self.check_zero(optimizer)
        self.check(before, net)
        self.reset_stats()
        return {"step": t, "alpha": round(alpha, 4), "moved": moved, "traded": trade,
                "counts": {k: self.counts(k) for k in KINDS}, "seconds": time.perf_counter() - t0}

    def state_dict(self):
        return {**self.base_state(), "active": self.active, "fresh": self.fresh, "acc": self.acc, "acc2": self.acc2,
                "nacc": self.nacc}

    def load_state_dict(self, sd):
        self.load_base_state(sd)
        self.active, self.fresh, self.nacc = sd["active"], sd["fresh"], sd["nacc"]
        dev = self.model.head.weight.device
        self.acc = {k: [a.to(dev) for a in v] for k, v in sd["acc"].items()}
        # a checkpoint from before t^2 was kept: the trade's statistic starts over
        self.acc2 = {k: [a.to(dev) for a in v] for k, v in sd["acc2"].items()} if "acc2" in sd else \
            {k: [torch.zeros_like(a) for a in v] for k, v in self.acc.items()}


# ----------------------------------------------------------------------------------------------
# unstructured DST on every linear layer of the blocks: RigL, SET, BiDST

def erk_densities(shapes, density):
    """Erdos-Renyi densities, d_l proportional to (n_in + n_out) / (n_in * n_out), capped at 1 with the
    surplus given to the other layers, so that sum d_l * numel_l = density * total."""
    numel = [a * b for a, b in shapes]
    raw = [(a + b) / (a * b) for a, b in shapes]
    dense = set()
    while True:
        budget = density * sum(numel) - sum(numel[i] for i in dense)
        free = sum(raw[i] * numel[i] for i in range(len(shapes)) if i not in dense)
        eps = budget / free
        over = [i for i in range(len(shapes)) if i not in dense and eps * raw[i] > 1]
        if not over:
            return [1.0 if i in dense else eps * raw[i] for i in range(len(shapes))]
        dense.update(over)


def random_mask(shape, k, gen):
    m = torch.zeros(math.prod(shape))
    m[torch.randperm(m.numel(), generator=gen)[:k]] = 1
    return m.view(shape)


class Unstructured(MaskedMethod):
    """RigL (grow='gradient') and SET (grow='random')."""

    def __init__(self, model, schedule, dense_frac=0.1, grow="gradient", distribution="erk", seed=0):
        super().__init__(model, schedule, seed)
        if not 0 < dense_frac <= 1:
            raise ValueError(f"density must be in (0, 1], got {dense_frac}")
        if distribution not in ("uniform", "erk"):
            raise ValueError(f"layer density distribution must be 'uniform' or 'erk', got {distribution!r}")
        self.name = {"gradient": "rigl", "random": "set"}[grow]
        self.grow = grow
        layers = [(f"blocks.{i}.{n}", getattr(getattr(blk, p), n)) for i, blk in enumerate(model.blocks)
                  for p, n in (("attn", "qkv"), ("attn", "proj"), ("mlp", "fc1"), ("mlp", "fc2"))]
        shapes = [tuple(m.weight.shape) for _, m in layers]
        dens = erk_densities(shapes, dense_frac) if distribution == "erk" else [dense_frac] * len(shapes)
        self.k = {}
        for (name, mod), s, d in zip(layers, shapes, dens):
            self.k[name] = round_half_up(d * s[0] * s[1])
            self.add_mask(name, mod, "weight", random_mask(s, self.k[name], self.gen))

    @torch.no_grad()
    def init_model(self, magnitude=False):
        """Random masks (drawn in __init__), or for pretrained weights the largest |W| of each layer."""
        if magnitude:
            for name, (mod, attr, p) in self.masks.items():
                top = leaf(mod, attr).abs().view(-1).topk(self.k[name]).indices
                p.mask.zero_().view(-1)[top] = 1
        self.apply_masks(None)

    def before_forward(self, t):
        if self.grow == "gradient" and self.updates_at(t):
            for _, _, p in self.masks.values():
                p.capture = True

    def after_backward(self, optimizer):
        pass

    def grow_scores(self, name, p):
        if self.grow == "gradient":
            return all_mean(p.grad).abs().float()
        return torch.rand(p.mask.shape, generator=self.gen).to(p.mask.device)

    @torch.no_grad()
    def after_step(self, optimizer, t):
        if not self.updates_at(t):
            return None
        t0, alpha, moved = time.perf_counter(), self.schedule.alpha(t), 0
        for name, (mod, attr, p) in self.masks.items():
            W, flat = leaf(mod, attr), p.mask.view(-1)
            n = round_half_up(alpha * self.k[name])
            n = min(n, self.k[name], flat.numel() - self.k[name])
            if n == 0:
                continue
            drop = torch.where(flat > 0, W.abs().view(-1).float(), math.inf).topk(n, largest=False).indices
            flat[drop] = 0
            grow = torch.where(flat > 0, -math.inf, self.grow_scores(name, p).view(-1)).topk(n).indices
            flat[grow] = 1
            W.view(-1)[grow] = 0  # grown weights start at zero, with no optimizer history
            for v in optimizer.state.get(W, {}).values():
                if torch.is_tensor(v) and v.shape == W.shape:
                    v.view(-1)[grow] = 0
            moved += n
        for _, _, p in self.masks.values():  # every layer's dense gradient goes, moved or not (else each step keeps one)
            p.capture, p.grad = False, None
        self.apply_masks(optimizer)
        self.check_zero(optimizer)
        return self.record(t, alpha, moved, t0)

    def record(self, t, alpha, moved, t0):
        assert all(int(p.mask.count_nonzero()) == self.k[n] for n, (_, _, p) in self.masks.items())
        return {"step": t, "alpha": round(alpha, 4), "moved": {"weights": moved},
                "counts": {"weights": [self.k[n] for n in self.masks]}, "seconds": time.perf_counter() - t0}

    def state_dict(self):
        return self.base_state()

    def load_state_dict(self, sd):
        self.load_base_state(sd)


class BiDST(Unstructured):
    """Bi-level DST (after Ji et al., "Advancing Dynamic Sparse Training by Exploring Optimization
    Opportunities"), simplified: one logit s per weight, relaxed mask m~ = sigmoid((s + logistic
    noise) / tau), straight-through: the forward uses the binary mask M, the logits get
    dL/ds = (g * W - lr * g^2) * dm~/ds with g = dL/d(W*M). The -lr*g^2 term is the first-order
    implicit gradient (how the loss after the next weight step depends on the mask); it is what lets
    a masked weight (W = 0) win its place back. Logits take a per-layer RMS-normalised SGD step;
    M = top-k of s per layer, only at mask updates. Uniform layer densities; no separate mask data."""

    name = "bidst"

    def __init__(self, model, schedule, dense_frac=0.1, seed=0, tau=1.0, logit_lr=0.01):
        super().__init__(model, schedule, dense_frac, grow="gradient", distribution="uniform", seed=seed)
        self.name, self.tau, self.logit_lr = "bidst", tau, logit_lr
        self.logits = {n: (2 * p.mask - 1).clone() for n, (_, _, p) in self.masks.items()}
        self.logit_grad = {}  # the last dL/ds, kept for inspection
        for _, _, p in self.masks.values():
            p.capture = True  # the logits need the dense gradient on every step

    def init_model(self, magnitude=False):
        super().init_model(magnitude)
        for n, (_, _, p) in self.masks.items():
            self.logits[n].copy_(2 * p.mask - 1)

    def before_forward(self, t):
        pass

    @torch.no_grad()
    def after_backward(self, optimizer):
        lr = optimizer.param_groups[0]["lr"]  # on CUDA a device tensor, which each replay of a captured step reads anew
        for name, (mod, attr, p) in self.masks.items():
            s = self.logits[name]
            g, W = all_mean(p.grad).to(s.dtype), leaf(mod, attr).to(s.dtype)
            u = self.uniform(s).clamp_(1e-6, 1 - 1e-6)
            m = torch.sigmoid((s + torch.log(u) - torch.log1p(-u)) / self.tau)
            ds = (g * W - lr * g * g) * m * (1 - m) / self.tau
            s -= self.logit_lr * ds / (ds.pow(2).mean().sqrt() + 1e-12)
            self.logit_grad[name] = ds

    def uniform(self, s):
        """Noise for the relaxed mask, shaped like s: on the CPU from the method's generator; on CUDA from
        torch's CUDA generator, which a captured step may draw from (each replay draws anew; train.py
        checkpoints its state), with no copy from the host inside the step."""
        if s.is_cuda:
            return torch.rand(s.shape, device=s.device, dtype=s.dtype)
        return torch.rand(s.shape, generator=self.gen, dtype=s.dtype)

    @torch.no_grad()
    def after_step(self, optimizer, t):
        if not self.updates_at(t):
            return None
        t0, moved = time.perf_counter(), 0
        for name, (mod, attr, p) in self.masks.items():
            old = p.mask.clone()
            new = torch.zeros_like(p.mask).view(-1)
            new[self.logits[name].view(-1).topk(self.k[name]).indices] = 1
            p.mask.copy_(new.view(p.mask.shape))
            moved += int((p.mask > old).sum())
        self.apply_masks(optimizer)
        self.check_zero(optimizer)
        return self.record(t, 0.0, moved, t0)

    def state_dict(self):
        return {**self.base_state(), "logits": {n: s.cpu() for n, s in self.logits.items()}}

    def load_state_dict(self, sd):
        self.load_base_state(sd)
        for n, s in sd["logits"].items():
            self.logits[n].copy_(s)


class Dense:
    name = "dense"

    def __init__(self, model, schedule=None, **_):
        self.model = model

    def init_model(self, **_):
        pass

    def updates_at(self, t):
        return False

    def before_forward(self, t):
        pass

    def after_backward(self, optimizer):
        pass

    def after_step(self, optimizer, t):
        return None

    def density(self):
        return 1.0

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass
