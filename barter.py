"""
BARTER: structured dynamic sparse training that keeps every tensor compact.

The ViT really has fewer heads and MLP channels. Every `update_every` steps BARTER ranks the units
that exist by their gate-Taylor score and moves capacity between blocks: it PRUNES the weakest units
and CLONES the strongest (a Net2Net split), under fixed global budgets. By default heads and channels
share one budget of weights, so a head may be traded for its weight in channels or back
(`budgets="separate"` keeps the paper's two unit budgets instead). `resize` slices the tensors and
remaps the optimizer state with the same indices, so the next step runs dense kernels on a smaller
model. `Barter.update` is the whole update, in its stages: scores, trade, prune, grow, resize, check.
"""
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from vit import FRESH, KINDS, leaf, resize  # the unit layout, and the slicing that follows it, live next to the model


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
    fractions of all the run's updates add up to `churn`: every swap discards a trained unit, so what
    is budgeted is how much moves over the whole run, not per update. BARTER's updates run from the
    first interval, the lr warmup included, so that the run spends its time in the split it finds;
    the weight-level baselines start after the warmup (`start`, see train.build)."""
    total_steps: int
    update_every: int = 500
    alpha0: float = 0.25
    end_frac: float = 0.75
    start: int = 0  # no update before this step
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
    """Which kind gives weights to the other: +1 turns the `rate` weakest channels into one head, -1 a
    head into `rate` channels, 0 neither. A head's qkv + proj weigh as much as `rate` channels' fc1 +
    fc2, so the kind whose cheapest head's worth costs less to lose gives it up. The scores are mean
    squared gate-Taylor, t^2: the second-order estimate of the loss change of removing a unit
    (Molchanov et al. 2019), which adds over a group of units where |t| does not. The weakest head
    decides both ways (the head given up is the weakest above its block's floor), the weakest channels
    of the model price it. `margin` (a factor 2 in the loss change) keeps the split from flapping: a
    trade throws trained units away. One trade per update at most (docs/ablations.md, "Budgets")."""
    if not head_scores or len(channel_scores) < rate:
        return 0
    head, channels = min(head_scores), sum(sorted(channel_scores)[:rate])
    return 1 if margin * channels < head else -1 if margin * head < channels else 0


def choose(counts, lo, hi, prune, grow, alpha, rate, trade_scores=None):
    """One update's choice for both kinds ({kind: ...} everywhere): the trade, decided by `trade_scores`
    ({kind: [t^2 of every unit that may be pruned]}; None: separate budgets, no trade), then per kind
    the alpha share of its units swapped plus the trade's net change. Returns ({kind: (P, G)}, {kind:
    units given up}, trade); a trade that does not fit the block bounds is dropped. With the trade on,
    heads move by the trade alone, never swapped within their kind: a head swap gives up a head for
    another at no weighed price, and heads are few and dear (docs/ablations.md, "Budgets")."""
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
    and always with separate budgets), each kind holds exactly its start budget. A kind's budget is the
    sum of its counts; nothing else holds it."""
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
# budgets and the method

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
    # A block grows from its own units, so a block left with no head has no attention for the whole run.
    # When d leaves fewer heads than blocks, every block gets one, paid with MLP channels at equal weight
    # (the weight density stays d), if that leaves a channel per block and one density sets both budgets.
    extra, per_head = L - budget["heads"], channels_per_head(cfg)
    if head_frac is None and mlp_frac is None and extra > 0 and extra * per_head <= budget["mlp"] - L:
        budget = {"heads": L, "mlp": budget["mlp"] - extra * per_head}
    for kind, B in budget.items():
        if B < 1:
            raise ValueError(f"density {fracs[kind]} leaves no {kind} in {L} blocks of {dense[kind]}")
    # floors: a head per block when the budget allows it, and a fifth of the mean channels per block,
    # so that no MLP is drained while the budget can spare channels
    lo = {"heads": [1 if budget["heads"] >= L else 0] * L, "mlp": [int(0.2 * budget["mlp"] / L)] * L}
    hi = {k: [dense[k]] * L for k in KINDS}
    return budget, lo, hi


def shares_budget(budgets):
    """Whether heads and channels share one budget of weights ('shared') or keep two ('separate')."""
    if budgets not in ("shared", "separate"):
        raise ValueError(f"budgets must be 'shared' or 'separate', got {budgets!r}")
    return budgets == "shared"


class Barter:
    name = "barter"
    grows = ("clone", "fresh")  # the ways it may grow (train.py's --grow)
    shadow = None  # an average of the weights ({Parameter: tensor}, step.EMA), resized with them at every update

    def __init__(self, model, schedule, dense_frac=0.1, head_frac=None, mlp_frac=None, eps=1.0, seed=0, grow="clone",
                 budgets="shared"):
        """eps: a split's push (resize), in units of the tensor's median input-row RMS: large enough that
        the two halves become distinct units, not near-duplicates. grow: 'clone' (a Net2Net split of a
        strong unit) or 'fresh' (a new unit with a zero output side in a strong unit's block: the function
        stays exact, for fine-tuning). budgets: 'shared' (one budget of weights; a head's worth may change
        kind at an update, and heads move only that way) or 'separate' (the paper's two fixed unit budgets;
        heads are swapped within their kind like channels)."""
        if grow not in self.grows:
            raise ValueError(f"grow must be one of {self.grows}, got {grow!r}")
        self.start, self.lo, self.hi = unit_budgets(model.cfg, dense_frac, head_frac, mlp_frac)
        self.rate = channels_per_head(model.cfg)
        self.weights = self.start["heads"] * self.rate + self.start["mlp"]  # fixed: the weight density
        self.model, self.schedule, self.eps, self.grow, self.shared = model, schedule, eps, grow, shares_budget(budgets)
        self.gen = torch.Generator().manual_seed(seed)
        self.reset_stats()
        self.fresh = {k: [torch.zeros(n, dtype=torch.bool) for n in model.counts(k)] for k in KINDS}

    def init_model(self, keep=None):
        """Slice the dense model to the units `keep` ({kind: [indices per block]}; default: the first
        units of a dense init, uniform over depth). The masked baseline keeps the same units, so both
        start from the identical function."""
        plan = keep or initial_units(self.model, self.start, self.lo, self.hi)
        resize(self.model, None, plan["heads"], plan["mlp"])
        self.fresh = {k: [torch.zeros(n, dtype=torch.bool) for n in self.model.counts(k)] for k in KINDS}
        self.reset_stats()
        self.check(start=True)

    def reset_stats(self):
        """Zero statistics buffers, one per block and kind, made here and from then on only added into
        in place: a captured step (step.Stepper) keeps writing to the buffers it was captured with. The
        count of steps they hold is kept on the host, by after_step."""
        dev = self.model.head.weight.device
        self.acc = {k: [torch.zeros(n, device=dev) for n in self.model.counts(k)] for k in KINDS}  # sum of |t|: the ranking
        self.acc2 = {k: [torch.zeros(n, device=dev) for n in self.model.counts(k)] for k in KINDS}  # sum of t^2: the trade
        self.nacc = 0

    def updates_at(self, t):
        """Whether step t ends with a topology update (step.Stepper runs such a step eagerly)."""
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
        """One topology update: scores, trade, prune, grow, resize, check."""
        t0, alpha = time.perf_counter(), self.schedule.alpha(t)
        before = {k: self.model.counts(k) for k in KINDS}
        # scores: each unit's mean |t| over the interval ranks it within its kind, mean t^2 prices the trade
        rank, price = self.scores()
        fresh = {k: [f.tolist() for f in self.fresh[k]] for k in KINDS}  # last update's new units: not pruned
        prune = {k: [c for c in rank[k] if not fresh[k][c[1]][c[2]]] for k in KINDS}
        squares = {k: [price[k][b][u] for _, b, u in prune[k]] for k in KINDS}
        # trade, prune, grow: at most one head's worth of weights changes kind, then per kind the alpha_t
        # share of its units is swapped, the weakest pruned and the strongest grown
        sel, net, traded = choose(before, self.lo, self.hi, prune, rank, alpha, self.rate, squares if self.shared else None)
        # resize: per block one index, the units kept and then one per unit grown (its parent, or FRESH)
        plans = {k: self.plan(k, *sel[k]) for k in KINDS}
        new = resize(self.model, optimizer, plans["heads"], plans["mlp"], self.eps, self.gen, self.shadow)
        self.fresh = {k: [f.cpu() if f is not None else torch.zeros(n, dtype=torch.bool)
                          for f, n in zip(new[k], self.model.counts(k))] for k in KINDS}
        # check: bounds and budgets exact (resize checked the optimizer and the average)
        self.reset_stats()
        self.check(before, net)
        return {"step": t, "alpha": round(alpha, 4), "moved": {k: len(sel[k][0]) for k in KINDS}, "traded": traded,
                "counts": {k: self.model.counts(k) for k in KINDS}, "seconds": time.perf_counter() - t0}

    def scores(self):
        """({kind: [(mean |t|, block, unit) for every unit]}, {kind: [[mean t^2 per unit] per block]}),
        averaged over the interval's steps and over the ranks."""
        mean = lambda acc: [(all_mean(a) / max(self.nacc, 1)).cpu().tolist() for a in acc]
        rank = {k: [(s, b, u) for b, sb in enumerate(mean(self.acc[k])) for u, s in enumerate(sb)] for k in KINDS}
        return rank, {k: mean(self.acc2[k]) for k in KINDS}

    def plan(self, kind, P, G):
        """Per block the source index of every unit after the update, or None where nothing changes:
        the units not in P, then one per (block, unit) in G, its parent (clone) or FRESH."""
        pruned, out = set(P), []
        for b, n in enumerate(self.model.counts(kind)):
            kept = [u for u in range(n) if (b, u) not in pruned]
            grown = [u if self.grow == "clone" else FRESH for bb, u in G if bb == b]
            out.append(None if not grown and len(kept) == n else torch.tensor(kept + grown, dtype=torch.long))
        return out

    def check(self, before=None, net=None, start=False):
        """check_units on this method's counts; the start budgets at the start and, with separate
        budgets, always. (The masked baseline uses this same method: it holds the same attributes.)"""
        check_units({k: self.counts(k) for k in KINDS}, self.lo, self.hi, self.rate, self.weights, before, net,
                    self.start if start or not self.shared else None)

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
# the compact start of a fine-tune: which units of a dense pretrained model to keep (a one-time dense cost)

@torch.no_grad()
def widen(model, generator=None):
    """A compact model (a checkpoint of this project) widened to its dense shape with FRESH units, which
    output nothing: the function is unchanged, and every unit of the dense shape can be scored."""
    dense = {"heads": model.cfg.num_heads, "mlp": model.cfg.mlp_hidden}
    plan = {k: [None if n == dense[k] else torch.cat([torch.arange(n), torch.full((dense[k] - n,), FRESH)])
                for n in model.counts(k)] for k in KINDS}
    resize(model, None, plan["heads"], plan["mlp"], generator=generator)
    return model


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


def initial_units(model, budget, lo, hi, batches=None, loss_of=None):
    """{kind: [indices to keep per block]} of a dense model under the budgets: with `batches`, the best
    units by gate-Taylor over them (a fine-tune's start); without, the first units, spread evenly (what
    a run from scratch keeps of its dense init)."""
    if batches is None:
        return {k: [torch.arange(n) for n in uniform(budget[k], len(model.blocks))] for k in KINDS}
    scores = score_units(model, batches, loss_of)
    return {k: keep_top([s.cpu() for s in scores[k]], budget[k], lo[k], hi[k]) for k in KINDS}


def weight_density(cfg, heads, mlp):
    """Active block weights (qkv, proj, fc1, fc2) over those of the dense model."""
    per_head, per_channel = 4 * cfg.dim * cfg.head_dim, 2 * cfg.dim
    dense = cfg.depth * (cfg.num_heads * per_head + cfg.mlp_hidden * per_channel)
    return (sum(heads) * per_head + sum(mlp) * per_channel) / dense
