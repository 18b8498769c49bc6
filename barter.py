"""
BARTER: structured dynamic sparse training that keeps every tensor compact.

The ViT really has fewer heads and MLP channels. Every `update_every` steps BARTER ranks the units
that exist by their gate-Taylor score, PRUNES the k weakest and CLONES the k strongest (Net2Net
split), under a fixed global budget of weights that heads and channels share (a head may be traded
for its weight in channels, or back). `resize` slices the tensors and remaps the optimizer state with
the same indices, so the next step runs dense kernels on a smaller model.
"""
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from vit import leaf, per_row, unit_rows  # the unit layout lives next to the model

KINDS = ("heads", "mlp")


def round_half_up(x):
    return int(math.floor(x + 0.5))


def uniform(budget, depth):
    """`budget` units over `depth` blocks as evenly as possible, the remainder spread over depth."""
    base, r = divmod(budget, depth)
    counts = [base] * depth
    for j in range(r):
        counts[(j * depth) // r] += 1
    return counts


def all_mean(t):
    """t averaged over the ranks of a torchrun job, in place (t itself in a single process). Every
    topology decision is made from numbers that went through here, so every rank makes the same one."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)  # a sum: gloo has no average
        t /= dist.get_world_size()
    return t


# ----------------------------------------------------------------------------------------------
# resize: gather units of every block, parameters and optimizer state through the same indices

# how an optimizer state tensor scales on the INPUT side of a unit split m ways: the copy's input
# gradient is 1/m of the parent's (its output side was divided by m), so 1st moments / m, 2nd / m^2.
# On the OUTPUT side every copy sees the parent's gradient: state is copied as it is.
STATE_POWER = {"exp_avg": 1, "momentum_buffer": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 2}
FRESH = -1  # a source index that asks for a new unit instead of a copy
INIT_STD = 0.02  # the ViT's own init of a linear weight (vit.ViT.__init__)


def sprout(u):
    """The source index that asks for a new unit with unit u's input side and a zero output side."""
    return -2 - u


@torch.no_grad()
def resize(model, optimizer, heads, mlp, eps=0.0, generator=None, shadow=None):
    """Rebuild block i with the source units heads[i] / mlp[i] (LongTensors, None = untouched).
    A source that appears m times is split into m copies: input side copied, its weights perturbed by
    +-eps * s * u (u ~ N(0, 1), opposite signs for the copies, so their mean stays the source; s the
    tensor's median row RMS, not the row's own: each copy's row is longer than the source's, and a push
    in units of the row itself grew a lineage that kept being split by sqrt(1 + eps^2) a split, without
    bound), output side divided by m.
    A source FRESH (-1) is a new unit: input weights drawn like the init, input bias and output side
    zero. A source sprout(u) (-2 - u) is a one-sided split: a new unit whose input side is u's, its
    weights pushed by +eps * s * z (z ~ N(0, 1), a draw of its own), and whose output side is zero; u
    itself is untouched. The function is unchanged for eps = 0 and, when no unit is split in two, for
    any eps; to first order in eps otherwise.
    Optimizer state goes through the same indices (scaled by STATE_POWER on a split's input side);
    a fresh or sprouted unit's state is zero, as a masked baseline's regrown unit's is. With the
    tensor's step count its first Adam steps are larger than its neighbours', and that learned more
    than second moments started at the tensor's mean: +0.27 / +0.60 points on the protocol, +0.35 on
    `micro` (EXPERIMENTS.md, "A fresh unit's Adam state"). `shadow`, an average of the weights keyed by
    Parameter like optimizer.state (train.EMA), goes through the same indices as the weights but
    without the +-eps (so a split leaves the average's function exactly as it was), zero for a fresh
    or sprouted unit. Returns, per block, which units are new: halves of a split, fresh or sprouted."""
    where = {}  # id(param) -> (group, position) in the optimizer
    if optimizer is not None:
        for g in optimizer.param_groups:
            for i, p in enumerate(g["params"]):
                where[id(p)] = (g, i)
    fresh = {}
    for kind, plan in zip(KINDS, (heads, mlp)):
        if plan is None:
            continue
        if len(plan) != len(model.blocks):
            raise ValueError(f"{kind}: need one index tensor (or None) per block, got {len(plan)}")
        fresh[kind] = []
        for blk, idx in zip(model.blocks, plan):
            n, w, tensors = blk.units(kind)
            if idx is None:
                fresh[kind].append(None)
                continue
            dev = tensors[0][0].weight.device
            idx = torch.as_tensor(idx, dtype=torch.long).to(dev)
            if idx.ndim != 1 or (idx.numel() and (idx.min() < sprout(n - 1) or idx.max() >= n)):
                raise ValueError(f"{kind} indices must be a 1-D tensor with values in [0, {n}), {FRESH} "
                                 f"(fresh) or sprout(u) = -2 - u (u < {n})")
            new_unit, sprouted = idx < 0, idx <= sprout(0)  # both: zero output side and optimizer state
            src = torch.where(sprouted, sprout(idx), idx.clamp(min=0))  # a fresh unit gathers unit 0, overwritten
            m = torch.bincount(idx[~new_unit], minlength=n)[src].double() if n else torch.ones(len(idx), device=dev)
            m[new_unit] = 1  # a sprout does not split its parent: the parent keeps its output side and state
            rank = ((idx[:, None] == idx[None, :]) & ~new_unit[:, None]).double().tril(-1).sum(1)  # 0 = the parent
            sign = (m - 1) - 2 * rank  # e.g. +1/-1 for a pair, +2/0/-2 for three: sums to zero
            fresh[kind].append((m > 1) | new_unit)
            for mod, attr, dim, side, seg in tensors:
                old = getattr(mod, attr)
                rows = unit_rows(src, n, w, seg)
                shape = [1] * old.ndim
                shape[dim] = -1
                size = list(old.shape)
                size[dim] = len(rows)
                inv_m = per_row(1.0 / m, w, seg).view(shape).to(old.dtype)
                is_new = per_row(new_unit, w, seg).view(shape)
                is_drawn = per_row(idx == FRESH, w, seg).view(shape)  # a sprout's input side is its parent's

                def gather(t, power, fill, mask=is_new):  # power: how t scales with the input-side split (see above)
                    out = t.index_select(dim, rows) if n else t.new_zeros(size)
                    out = out * inv_m ** power if power else out
                    return torch.where(mask, fill, out) if bool(mask.any()) else out

                wpower = 0 if side == "in" else 1  # a weight (and its average) is divided by m on the output side
                draw = 0.0
                if side == "in" and attr == "weight" and bool(is_drawn.any()):
                    draw = nn.init.trunc_normal_(torch.empty(size), std=INIT_STD, generator=generator).to(old.device, old.dtype)
                new = gather(old, wpower, draw, is_drawn if side == "in" else is_new)
                if side == "in" and attr == "weight" and eps > 0 and bool(((m > 1) | sprouted).any()):
                    typical = old.pow(2).mean(1 - dim).sqrt().median()  # push in units of the tensor's typical row
                    if bool((m > 1).any()):
                        u = torch.randn(old.shape, generator=generator).to(old.device, old.dtype) * typical
                        new += eps * per_row(sign, w, seg).view(shape).to(old.dtype) * u.index_select(dim, rows)
                    if bool(sprouted.any()):  # a draw per new row: two sprouts of one parent are distinct
                        u = torch.randn(size, generator=generator).to(old.device, old.dtype) * typical
                        new += eps * per_row(sprouted, w, seg).view(shape).to(old.dtype) * u
                new = nn.Parameter(new, requires_grad=old.requires_grad)
                setattr(mod, attr, new)
                if shadow is not None:
                    shadow[new] = gather(shadow.pop(old), wpower, 0.0)
                if optimizer is None:
                    continue
                if id(old) not in where:
                    raise RuntimeError(f"{kind} tensor {attr} of shape {tuple(old.shape)} is not in the optimizer")
                g, i = where.pop(id(old))
                g["params"][i] = new
                state = optimizer.state.pop(old, {})
                remapped = {}
                for key, v in state.items():
                    if torch.is_tensor(v) and v.shape == old.shape:
                        if key not in STATE_POWER:
                            raise RuntimeError(f"don't know how optimizer state {key!r} scales on a split")
                        remapped[key] = gather(v, STATE_POWER[key] if side == "in" else 0, 0.0)
                    else:
                        remapped[key] = v  # scalar step and other shape-free entries are kept
                if remapped:
                    optimizer.state[new] = remapped
            blk.set_units(kind, idx.numel())
    if optimizer is not None:
        check_optimizer(model, optimizer)
    if shadow is not None:
        check_shadow(model, shadow)
    return fresh


def check_optimizer(model, optimizer):
    """Every trainable parameter of the model is in exactly one group, and nothing else is there."""
    params = {id(p) for p in model.parameters() if p.requires_grad}
    in_groups = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert len(in_groups) == len(set(in_groups)), "a parameter is in the optimizer twice"
    assert set(in_groups) == params, "optimizer and model disagree on the parameters (stale Parameter?)"
    assert all(id(p) in params for p in optimizer.state), "optimizer state of a stale Parameter"


def check_shadow(model, shadow):
    """An average of the weights holds one tensor of the right shape per trainable parameter, no more."""
    params = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in shadow} == {id(p) for p in params}, "average and model disagree on the parameters"
    assert all(shadow[p].shape == p.shape for p in params), "an averaged tensor has the wrong shape"


# ----------------------------------------------------------------------------------------------
# statistics, schedule, selection

def taylor_scores(model, kind):
    """Per block, t_u = sum over the unit's output-side weights of W * dL/dW: exactly dL/dgate of a
    gate multiplied into that unit's output. Units with no gradient yet score 0."""
    out = []
    for blk in model.blocks:
        n, w, tensors = blk.units(kind)
        mod, attr, dim, _, _ = next(t for t in tensors if t[3] == "out")
        W = leaf(mod, attr)
        if n == 0 or W.grad is None:
            out.append(torch.zeros(n, device=W.device))
            continue
        out.append((W * W.grad).float().sum(1 - dim).view(n, w).sum(1))  # (n,)
    return out


def accumulate(acc, acc2, scores):
    """acc += |t| and acc2 += t^2, in place, for every block of every kind ({kind: [tensor per block]}):
    one multi-tensor op each, no new buffer, no host sync."""
    for kind, s in scores.items():
        torch._foreach_add_(acc[kind], torch._foreach_abs(s))
        torch._foreach_add_(acc2[kind], torch._foreach_mul(s, s))


@dataclass
class Schedule:
    """When topology updates happen, and the fraction of a budget each one moves: RigL's
    alpha_t = alpha0 * (1 + cos(pi t / T_end)) / 2. With `churn`, alpha0 is derived so that the
    fractions of all the run's updates add up to `churn`. Units are not weights: every swap discards
    a learned unit, and in our study top-1 followed how much moved in all, not per update.
    BARTER's updates run from the first interval, the lr warmup included: the split of heads and
    channels is found by training, and the time spent in it is what pays (issue 9's model, tiny-32 at
    d = 0.3: +1.52 points over updates from the end of the warmup; EXPERIMENTS.md, "Updates from the
    first interval"). RigL's weight swaps are better after it (`start`): see train.py."""
    total_steps: int
    update_every: int = 500
    alpha0: float = 0.25
    end_frac: float = 0.75
    start: int = 0  # no update before this step (the lr warmup, for the weight-level baselines)
    churn: Optional[float] = None

    def __post_init__(self):
        if self.churn is not None:
            shape = sum(self.cosine(t) for t in self.updates())
            self.alpha0 = min(1.0, self.churn / shape) if shape else 0.0

    def updates(self):
        """Every step at which an update happens, in order."""
        return [t for t in range(self.update_every, self.total_steps + 1, self.update_every) if self.is_update(t)]

    def is_update(self, t):
        return t > 0 and t % self.update_every == 0 and self.start <= t < self.end_frac * self.total_steps

    def cosine(self, t):  # RigL's decay shape, 1 at step 0 and 0 at T_end
        return (1 + math.cos(math.pi * t / (self.end_frac * self.total_steps))) / 2

    def alpha(self, t):
        return self.alpha0 * self.cosine(t)


def select(counts, lo, hi, prune, grow, k, net=0):
    """prune, grow: candidate lists of (score, block, unit). Take the k + max(net, 0) lowest prune
    candidates with every block kept >= lo; then the highest grow candidates not pruned, every block
    kept <= hi, until the kind has `net` units fewer than before (net < 0: more). If fewer grow than
    that fit, prune fewer (drop the best-scored prunes); None if the net change itself does not fit.
    Ties break by position."""
    P, left = [], list(counts)
    for s, b, u in sorted(prune):
        if len(P) == k + max(net, 0):
            break
        if left[b] > lo[b]:
            left[b] -= 1
            P.append((b, u))
    grow = sorted(grow, key=lambda c: (-c[0], c[1], c[2]))
    while True:
        if len(P) < net:
            return None
        pruned, size, G = set(P), list(counts), []
        for b, _ in P:
            size[b] -= 1
        for s, b, u in grow:
            if len(G) == len(P) - net:
                break
            if (b, u) not in pruned and size[b] < hi[b]:
                size[b] += 1
                G.append((b, u))
        if len(G) == len(P) - net:
            return P, G
        if len(G) + net < 0:
            return None
        P = P[: len(G) + net]


def exchange(head_scores, channel_scores, rate, margin=4.0):
    """Which kind gives weights to the other: +1 turns the `rate` weakest channels into one head,
    -1 a head into `rate` channels, 0 neither. The weakest head decides both ways, though the head
    `select` gives up is the weakest one above its block's floor (deciding -1 on that head instead
    changed no decision in the 3-epoch study and was level in 8 augmented epochs: EXPERIMENTS.md).
    Likewise the channels that price it are the weakest of the model, though blocks at their MLP floor
    give none (pricing only those the trade can take stopped it 3-4 heads earlier on cifar-tiny at
    d = 0.3 and was level: +0.10 +- 0.12, EXPERIMENTS.md).
    A head's qkv + proj weigh as much as `rate` channels' fc1 + fc2, so the kind whose cheapest
    `rate`-channels' worth costs less to remove gives it up. The scores are squared gate-Taylor
    (mean over steps of t^2: the second-order estimate of the loss change of removing a unit, as in
    Molchanov et al. 2019), because a group's cost adds over its units in t^2 but not in |t|: the
    per-step |t| of 32 weak channels are mostly noise, and their sum overstated the group's cost
    against one head's (tiny-32 at d = 0.3 traded 0 to 3 heads by |t|, 8 or 9 by t^2; EXPERIMENTS.md).
    `margin` keeps the split from flapping (a trade throws a trained head or `rate` trained channels
    away): a factor 2 in the loss change, so 4 in its square. At 2 in the square the split flapped,
    up to 15 heads in and 11 back over 8 augmented epochs (EXPERIMENTS.md). One per update: trading
    as many as the scores asked for rushed from 11 to 24 heads at d = 0.3 within three updates, moved
    half the channels, and learned less."""
    if not head_scores or len(channel_scores) < rate:
        return 0
    head, channels = min(head_scores), sum(sorted(channel_scores)[:rate])
    return 1 if margin * channels < head else -1 if margin * head < channels else 0


def choose(counts, lo, hi, prune, grow, alpha, rate, trade_scores=None):
    """One update's choice for both kinds ({kind: ...} everywhere): the trade (decided by
    `trade_scores`, {kind: [score of every unit that may be pruned]}; None: no trade), then per kind
    the alpha share of its units (the kind's budget: the sum of its counts; for heads none while the
    trade is on, below) swapped plus the trade's net change. Returns ({kind: (P, G)}, {kind: units
    given up}, trade); a trade that does not fit the block bounds is dropped.
    With the trade on, heads move by the trade alone: no head is swapped within its kind. A head swap
    gave up a head 1.3 to 860 times dearer per weight, in t^2, than any channel given up at the same
    update, and where most blocks hold one head at the floor, the weakest head of a block with several:
    up to 51 times the weakest head's t^2, at times the strongest head of the model. Without the swaps
    BARTER gained 0.22 +- 0.11 points on the protocol at d = 0.3 (eleven seeds) and lost 0.35 +- 0.19
    on issue 9's model (sixteen, d = 0.3 and 0.5); over all 66 runs paired with the swaps it is level
    (+0.07 +- 0.12; EXPERIMENTS.md, "Heads moved by the trade alone, over eleven seeds" and the entries
    after it), so it stays as the simpler rule: a head moves only at the trade's price. Without
    the trade (--no-trade) the swaps are the only way heads move, so they stay."""
    t = exchange(trade_scores["heads"], trade_scores["mlp"], rate) if trade_scores else 0
    k = {kind: round_half_up(alpha * sum(counts[kind])) for kind in KINDS}
    if trade_scores:
        k["heads"] = 0
    while True:
        net = {"heads": -t, "mlp": t * rate}
        sel = {kind: select(counts[kind], lo[kind], hi[kind], prune[kind], grow[kind], k[kind], net[kind])
               for kind in KINDS}
        if all(v is not None for v in sel.values()):
            return sel, net, t
        t = 0


def check_units(counts, lo, hi, rate, weights, before=None, net=None, start=None):
    """The invariants of a topology ({kind: per-block counts}): every block within its bounds, the
    weights heads and channels hold together exactly `weights` channels' worth; given the counts
    `before` an update and its `net`, each kind changed by exactly -net; given `start` (at the start,
    and always without a trade), each kind holds exactly its start budget. A kind's budget is the sum
    of its counts; nothing else holds it."""
    for kind in KINDS:
        c = counts[kind]
        assert all(a <= x <= b for x, a, b in zip(c, lo[kind], hi[kind])), f"{kind} bounds: {c}"
        if before is not None:
            assert sum(c) == sum(before[kind]) - net[kind], f"{kind} budget broken: {sum(before[kind])} - {net[kind]} != {sum(c)}"
        if start is not None:
            assert sum(c) == start[kind], f"{kind} budget broken: {sum(c)} != {start[kind]}"
    w = sum(counts["heads"]) * rate + sum(counts["mlp"])
    assert w == weights, f"weight budget broken: {w} != {weights} channels' worth"


# ----------------------------------------------------------------------------------------------
# the method

def channels_per_head(cfg):
    """How many MLP channels weigh as much as one head: a head's qkv rows and proj columns hold
    4 * dim * head_dim weights, a channel's fc1 row and fc2 column 2 * dim."""
    return 2 * cfg.head_dim


def unit_budgets(cfg, dense_frac, head_frac=None, mlp_frac=None):
    """Global budgets B = round(d * L * dense units) and per-block bounds, for heads and channels."""
    L = cfg.depth
    fracs = {"heads": dense_frac if head_frac is None else head_frac,
             "mlp": dense_frac if mlp_frac is None else mlp_frac}
    dense = {"heads": cfg.num_heads, "mlp": cfg.mlp_hidden}
    for kind, f in fracs.items():
        if not 0 < f <= 1:
            raise ValueError(f"{kind} density must be in (0, 1], got {f}")
    budget = {k: round_half_up(fracs[k] * L * dense[k]) for k in KINDS}
    # A block grows from its own units (clone or fresh; only --grow random draws slots anywhere), so a
    # block left with no head has no attention for the whole run (a head transplanted into it, zero output
    # side, trained too little to pay: -0.41 on cifar-tiny at d = 0.1, level on the protocol;
    # EXPERIMENTS.md). When d leaves fewer heads than blocks, give every block one head and pay for the
    # extra heads with MLP channels at equal weight count (a head's qkv + proj weigh as much as 2 *
    # head_dim channels' fc1 + fc2), so the weight density stays d; if that leaves a channel per block,
    # and only when one density sets both budgets. Fashion-MNIST, d = 0.1 (EXPERIMENTS.md): tiny-28 4
    # heads + 173 channels 0.8502, 6 + 125 0.8606 (3 seeds); tiny-32 2 + 154 0.7314, 6 + 26 0.7640 (5
    # seeds; half the channels was the limit before, which kept tiny-32 at 2 heads).
    extra, per_head = L - budget["heads"], channels_per_head(cfg)
    if head_frac is None and mlp_frac is None and extra > 0 and extra * per_head <= budget["mlp"] - L:
        budget = {"heads": L, "mlp": budget["mlp"] - extra * per_head}
    for kind, B in budget.items():
        if B < 1:
            raise ValueError(f"density {fracs[kind]} leaves no {kind} in {L} blocks of {dense[kind]}")
    # keep one head per block when the budget allows it, and a floor of a fifth of the mean channels per
    # block, so no MLP is drained while the budget can spare channels. Under 5 channels per block that
    # floor is 0 and a block's MLP may empty for good (tiny-32 at d = 0.1); a floor of 1 there was level
    # (+0.02 +- 0.05, EXPERIMENTS.md). A floor of 1 instead of the fifth, where the trade ends at the
    # floor (cifar-tiny, d = 0.1), traded one head further and lost 0.20 (2 seeds).
    lo = {"heads": [1 if budget["heads"] >= L else 0] * L, "mlp": [int(0.2 * budget["mlp"] / L)] * L}
    hi = {k: [dense[k]] * L for k in KINDS}
    return budget, lo, hi


class Barter:
    name = "barter"
    grows = ("clone", "sprout", "fresh", "random")  # the ways it may grow (train.py's --grow checks against these)
    shadow = None  # train.py's EMA of the weights ({Parameter: tensor}), resized with them at every update

    def __init__(self, model, schedule, dense_frac=0.1, head_frac=None, mlp_frac=None, eps=1.0, seed=0, grow="clone", trade=True):
        """eps: the clone's symmetry breaking (and a sprout's push), in units of the tensor's median
        input-row RMS. With eps ~ 1e-3 the two halves of a split stay near-duplicates for the whole run
        (measured: half of all channels at d = 0.3), so a clone adds no capacity; with eps = 1 they are
        distinct units from the start. 0.5 lost 0.28 points on the protocol at d = 0.1 and was +0.23 +- 0.24
        on the synthetic set (twenty seeds); a push sized by the interval's lr, or 0.5 for one kind only,
        did not help (EXPERIMENTS.md, "A smaller clone push" and after).
        grow: 'clone' (Net2Net split of a strong unit), 'sprout' (a one-sided split: a new unit with a
        strong unit's input side, pushed by eps, and a zero output side; the parent untouched), 'fresh' (a
        new unit, zero output side, in the block of a strong unit) or 'random' (a fresh unit in an absent
        slot drawn uniformly: no score decides where, the compact twin of masked --grow random, a
        structured SET with BARTER's prune and trade)."""
        if grow not in self.grows:
            raise ValueError(f"grow must be one of {self.grows}, got {grow!r}")
        self.start, self.lo, self.hi = unit_budgets(model.cfg, dense_frac, head_frac, mlp_frac)
        self.rate = channels_per_head(model.cfg)
        self.weights = self.start["heads"] * self.rate + self.start["mlp"]  # fixed: the weight density
        self.model, self.schedule, self.eps, self.grow, self.trade = model, schedule, eps, grow, trade
        self.gen = torch.Generator().manual_seed(seed)
        self.reset_stats()
        self.fresh = {k: [torch.zeros(n, dtype=torch.bool) for n in model.counts(k)] for k in KINDS}

    def init_model(self, keep=None):
        """Slice the dense model to the units `keep` ({kind: [indices per block]}; default: the first
        units of a dense init, uniform over depth). The masked baseline keeps the same units, so both
        start from the identical function."""
        plan = keep or initial_units(self.model, "first", self.start, self.lo, self.hi)
        resize(self.model, None, plan["heads"], plan["mlp"])
        self.fresh = {k: [torch.zeros(n, dtype=torch.bool) for n in self.model.counts(k)] for k in KINDS}
        self.reset_stats()
        self.check(start=True)

    def reset_stats(self):
        """Zero statistics buffers, one per block and kind, made here and from then on only added into
        in place: a captured step (train.Stepper) keeps writing to the buffers it was captured with. The
        count of steps they hold is kept on the host, by after_step."""
        dev = self.model.head.weight.device
        self.acc = {k: [torch.zeros(n, device=dev) for n in self.model.counts(k)] for k in KINDS}  # sum of |t|: ranks units of a kind
        self.acc2 = {k: [torch.zeros(n, device=dev) for n in self.model.counts(k)] for k in KINDS}  # sum of t^2: the trade
        self.nacc = 0

    def updates_at(self, t):
        """Whether step t ends with a topology update (train.Stepper runs such a step eagerly)."""
        return self.schedule.is_update(t)

    def before_forward(self, t):
        pass

    @torch.no_grad()
    def after_backward(self, optimizer):
        """Add |gate-Taylor| and its square of the active units to the buffers: device work only."""
        accumulate(self.acc, self.acc2, {kind: taylor_scores(self.model, kind) for kind in KINDS})

    def after_step(self, optimizer, t):
        self.nacc += 1  # one more step in the buffers (host side: a replayed step runs no Python)
        return self.update(optimizer, t) if self.updates_at(t) else None

    @torch.no_grad()
    def update(self, optimizer, t):
        t0 = time.perf_counter()
        alpha, grow, prune, squares, plans, moved = self.schedule.alpha(t), {}, {}, {}, {}, {}
        for kind in KINDS:
            counts = self.model.counts(kind)
            mean = lambda acc: [(all_mean(a) / max(self.nacc, 1)).cpu().tolist() for a in acc]
            exempt = {(b, u) for b, f in enumerate(self.fresh[kind]) for u in f.nonzero().flatten().tolist()}
            scored = [(s, b, u) for b, sb in enumerate(mean(self.acc[kind])) for u, s in enumerate(sb)]
            prune[kind] = [c for c in scored if (c[1], c[2]) not in exempt]
            if self.grow == "random":  # candidates are the absent slots (index >= the block's count), drawn
                slots = [(b, n + j) for b, n in enumerate(counts) for j in range(self.hi[kind][b] - n)]
                draw = torch.rand(len(slots), generator=self.gen).tolist()  # alike on every rank
                grow[kind] = [(r, b, u) for r, (b, u) in zip(draw, slots)]
            else:  # the best-scored units that exist: their clones, or fresh units in their blocks
                grow[kind] = scored
            sq = mean(self.acc2[kind])
            squares[kind] = [sq[b][u] for _, b, u in prune[kind]]  # the trade weighs the same candidates
        # one head's worth of weights may change kind (heads <-> channels) on top of the swaps
        before = {k: self.model.counts(k) for k in KINDS}
        sel, net, trade = choose(before, self.lo, self.hi, prune, grow, alpha, self.rate, squares if self.trade else None)
        for kind in KINDS:
            P, G = sel[kind]
            pruned = set(P)
            plan = []
            for b, n in enumerate(self.model.counts(kind)):
                kept = [u for u in range(n) if (b, u) not in pruned]
                parents = [u if self.grow == "clone" else sprout(u) if self.grow == "sprout" else FRESH
                           for bb, u in G if bb == b]
                same = len(parents) == 0 and len(kept) == n
                plan.append(None if same else torch.tensor(kept + parents, dtype=torch.long))
            plans[kind], moved[kind] = plan, len(P)
        fresh = resize(self.model, optimizer, plans["heads"], plans["mlp"], self.eps, self.gen, self.shadow)
        for kind in KINDS:
            self.fresh[kind] = [f.cpu() if f is not None else torch.zeros(n, dtype=torch.bool)
                                for f, n in zip(fresh[kind], self.model.counts(kind))]
        self.reset_stats()
        self.check(before, net)
        return {"step": t, "alpha": round(alpha, 4), "moved": moved, "traded": trade,
                "counts": {k: self.model.counts(k) for k in KINDS}, "seconds": time.perf_counter() - t0}

    def check(self, before=None, net=None, start=False):
        """check_units on this method's counts; the start budgets at the start and, without a trade, always.
        (The masked baseline uses this same method: it holds the same budget attributes.)"""
        check_units({k: self.counts(k) for k in KINDS}, self.lo, self.hi, self.rate, self.weights, before, net,
                    self.start if start or not self.trade else None)

    def counts(self, kind):
        return self.model.counts(kind)

    def density(self):
        return weight_density(self.model.cfg, self.counts("heads"), self.counts("mlp"))

    def state_dict(self):
        return {"acc": self.acc, "acc2": self.acc2, "nacc": self.nacc, "fresh": self.fresh, "gen": self.gen.get_state()}

    def load_state_dict(self, sd):
        self.reset_stats()
        for key in ("acc", "acc2"):  # into the buffers; a checkpoint from before t^2 was kept has no acc2
            for kind, bufs in getattr(self, key).items():
                for buf, a in zip(bufs, sd.get(key, {}).get(kind, [None] * len(bufs))):
                    if a is not None:  # None: a block that had no statistic yet (older checkpoints)
                        buf.copy_(a)
        self.nacc, self.fresh = sd["nacc"], sd["fresh"]
        self.gen.set_state(sd["gen"])
        self.check()


# ----------------------------------------------------------------------------------------------
# fine-tuning: which units of a dense pretrained model to keep (a one-time dense cost)

def score_units(model, batches, loss_of):
    """Mean over batches of |gate-Taylor| of every unit of a (dense) model: BARTER's own statistic.
    loss_of(x, y) runs the model and returns the loss."""
    acc, n = {k: None for k in KINDS}, 0
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        loss_of(x, y).backward()
        for kind in KINDS:
            with torch.no_grad():
                s = [t.abs() for t in taylor_scores(model, kind)]
            acc[kind] = s if acc[kind] is None else [a + b for a, b in zip(acc[kind], s)]
        n += 1
    model.zero_grad(set_to_none=True)
    return {k: [a / max(n, 1) for a in v] for k, v in acc.items()}


def magnitude_scores(model):
    """The L2 norm of every weight a unit owns (input and output side)."""
    out = {}
    for kind in KINDS:
        out[kind] = []
        for blk in model.blocks:
            n, w, tensors = blk.units(kind)
            sq = 0
            for mod, attr, dim, side, seg in tensors:
                W = leaf(mod, attr).detach().float()
                rows = W.pow(2) if W.ndim == 1 else W.pow(2).sum(1 - dim)  # one value per row along `dim`
                sq = sq + rows.view(seg, n, w).sum((0, 2))
            out[kind].append(sq.sqrt() if n else torch.zeros(0))
    return out


def keep_top(scores, budget, lo, hi):
    """Per block, the sorted indices of the units to keep: every block its `lo` best first, then the
    best of the rest over all blocks until `budget` is spent, no block above `hi`. Ties: lower block,
    then lower unit first."""
    ranked = [sorted(range(len(s)), key=lambda u: (-float(s[u]), u)) for s in scores]
    keep = [r[:lo_b] for r, lo_b in zip(ranked, lo)]
    rest = sorted(((-float(scores[b][u]), b, u) for b, r in enumerate(ranked) for u in r[lo[b]:]))
    left = budget - sum(map(len, keep))
    for _, b, u in rest:
        if left == 0:
            break
        if len(keep[b]) < hi[b]:
            keep[b].append(u)
            left -= 1
    if left:
        raise ValueError(f"cannot keep {budget} units within the block bounds")
    return [torch.tensor(sorted(k), dtype=torch.long) for k in keep]


def initial_units(model, how, budget, lo, hi, batches=(), loss_of=None):
    """{kind: [indices to keep per block]} of a dense model under the budgets: 'taylor' (gate-Taylor
    over `batches`), 'magnitude' (weight norm) or 'first' (the first units, spread evenly: what a run
    from scratch keeps)."""
    if how == "first":
        return {k: [torch.arange(n) for n in uniform(budget[k], len(model.blocks))] for k in KINDS}
    scores = score_units(model, batches, loss_of) if how == "taylor" else magnitude_scores(model)
    return {k: keep_top([s.cpu() for s in scores[k]], budget[k], lo[k], hi[k]) for k in KINDS}


def weight_density(cfg, heads, mlp):
    """Active block weights (qkv, proj, fc1, fc2) over those of the dense model."""
    per_head, per_channel = 4 * cfg.dim * cfg.head_dim, 2 * cfg.dim
    dense = cfg.depth * (cfg.num_heads * per_head + cfg.mlp_hidden * per_channel)
    return (sum(heads) * per_head + sum(mlp) * per_channel) / dense
