"""
A Vision Transformer whose blocks each hold their own number of attention heads and MLP hidden
channels, and `resize`, which slices them (weights, optimizer state and an average of the weights through
the same indices). Names follow timm's vision_transformer.py; weights.py reads and writes their weights.

Tensor layout that everything else relies on (resize, masks, statistics):
  attn.qkv.weight  (3*h*hd, D)  rows [q_0 .. q_{h-1} | k_0 .. k_{h-1} | v_0 .. v_{h-1}], hd rows each
  attn.qkv.bias    (3*h*hd,)    same rows
  attn.proj.weight (D, h*hd)    columns [head_0 .. head_{h-1}], hd columns each
  mlp.fc1.weight   (F, D), mlp.fc1.bias (F,)   row c belongs to channel c
  mlp.fc2.weight   (D, F)                      column c belongs to channel c
A head or channel is a "unit". Its INPUT side (qkv rows / fc1 row) computes it, its OUTPUT side
(proj columns / fc2 column) reads it. attn.proj.bias and mlp.fc2.bias belong to no unit.
"""
import math
import warnings
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize


@dataclass(frozen=True)
class ViTConfig:
    img_size: int = 32
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 10
    dim: int = 192
    depth: int = 12
    num_heads: int = 3  # dense heads per block; head_dim = dim // num_heads stays fixed
    mlp_ratio: float = 4.0

    @property
    def head_dim(self):
        return self.dim // self.num_heads

    @property
    def mlp_hidden(self):
        return int(self.dim * self.mlp_ratio)


PRESETS = {
    "micro": ViTConfig(img_size=32, patch_size=8, dim=32, depth=3, num_heads=4, mlp_ratio=2.0),
    "cifar-tiny": ViTConfig(img_size=32, patch_size=4, dim=192, depth=12, num_heads=3),
    # 28 px (MNIST, Fashion-MNIST), 4x4 patches of 7 px: small enough for accuracy studies on a CPU
    "tiny-28": ViTConfig(img_size=28, patch_size=7, in_chans=1, dim=72, depth=6, num_heads=6),
    # 32 px grey images in 8x8 patches of 4 px: four times tiny-28's tokens, so a head costs more time
    "tiny-32": ViTConfig(img_size=32, patch_size=4, in_chans=1, dim=64, depth=6, num_heads=4),
    "deit-tiny": ViTConfig(img_size=224, patch_size=16, num_classes=1000, dim=192, depth=12, num_heads=3),
    "deit-small": ViTConfig(img_size=224, patch_size=16, num_classes=1000, dim=384, depth=12, num_heads=6),
    "deit-base": ViTConfig(img_size=224, patch_size=16, num_classes=1000, dim=768, depth=12, num_heads=12),
    "vit-large": ViTConfig(img_size=224, patch_size=16, num_classes=1000, dim=1024, depth=24, num_heads=16),
}


def linear(n_in, n_out):
    # a block may hold 0 units: nn.Linear warns that initialising an empty tensor is a no-op
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return nn.Linear(n_in, n_out)


class Normalize(torch.autograd.Function):
    """LayerNorm without its affine that keeps its OUTPUT y for backward instead of its input x.
    The linear after it keeps y anyway (for its weight gradient), so a norm costs one saved tensor
    rather than two: nn.LayerNorm keeps the fp32 residual x and the linear a (bf16) copy of its
    output. At low density these norms are most of what BARTER keeps for backward (bench.py says
    how much). Under autocast y is returned, and kept, in the autocast dtype."""

    @staticmethod
    def forward(ctx, x, eps):
        y, _, rstd = torch.native_layer_norm(x, x.shape[-1:], None, None, eps)  # rstd: (..., 1)
        if torch.is_autocast_enabled(x.device.type):
            y = y.to(torch.get_autocast_dtype(x.device.type))
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        y, rstd = ctx.saved_tensors
        y, g = y.to(rstd.dtype), g.to(rstd.dtype)
        # dL/dx = rstd * (g - mean(g) - y * mean(g * y)): LayerNorm's own backward computes the
        # bracket when told that its input is y itself (mean 0, rstd 1)
        zero, one = torch.zeros_like(rstd), torch.ones_like(rstd)
        bracket = torch.ops.aten.native_layer_norm_backward(g, y, y.shape[-1:], zero, one, None, None, [True, False, False])[0]
        return bracket * rstd, None


def norm_linear(x, norm, W, b):
    """F.linear(norm(x), W, b). With autograd, the norm's affine folded into the linear, so that the linear
    reads (and keeps) Normalize's output: (y*gamma + beta) W^T + b = y (W*gamma)^T + (W beta + b). Without
    (evaluation, inference, export) nothing is kept, and the plain layer norm saves the fold's work.
    Pass W read once: under a mask parametrization every read of lin.weight is a new tensor."""
    if not torch.is_grad_enabled():
        return F.linear(F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps), W, b)
    return F.linear(Normalize.apply(x, norm.eps), W * norm.weight, b + W @ norm.bias)


KINDS = ("heads", "mlp")  # the kinds of unit (Block.units)

# bf16 GEMMs whose width is not a multiple of 8 take a slow path on CUDA (docs/benchmarks.md), and
# BARTER's MLP widths are any integer
GEMM_MULTIPLE = {"cuda": 8}


def patch_linear(img, conv):
    """conv(img) for a convolution whose stride is its kernel (the patch embedding), as (B, N, D) tokens:
    the image cut into patches by a reshape, then one linear with the conv's own weight (D, C, p, p) read
    as (D, C*p*p). One matrix multiply instead of a strided convolution, for every method alike; the
    parameter and the checkpoints stay those of the nn.Conv2d."""
    B, C, H, W = img.shape
    p = conv.kernel_size[0]
    x = img.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // p) * (W // p), C * p * p)
    return F.linear(x, conv.weight.reshape(conv.out_channels, -1), conv.bias)


class Attention(nn.Module):
    def __init__(self, dim, num_heads, head_dim):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.qkv = linear(dim, 3 * num_heads * head_dim)
        self.proj = linear(num_heads * head_dim, dim)

    def forward(self, x, norm):  # x: the residual stream (B, N, D); norm: the block's norm1, folded into qkv
        B, N, _ = x.shape
        qkv = norm_linear(x, norm, self.qkv.weight, self.qkv.bias).view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, h, N, hd) each
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.hidden = hidden
        self.fc1 = linear(dim, hidden)
        self.fc2 = linear(hidden, dim)

    def forward(self, x, norm):
        W1, b1, W2 = self.fc1.weight, self.fc1.bias, self.fc2.weight
        pad = -self.hidden % GEMM_MULTIPLE.get(x.device.type, 1)
        if pad:  # run at a padded width: zero rows in fc1 give channels gelu(0) = 0 that zero columns of fc2 ignore
            W1, b1, W2 = F.pad(W1, (0, 0, 0, pad)), F.pad(b1, (0, pad)), F.pad(W2, (0, pad))
        return F.linear(F.gelu(norm_linear(x, norm, W1, b1)), W2, self.fc2.bias)


class Block(nn.Module):
    def __init__(self, dim, num_heads, head_dim, hidden):
        super().__init__()
        # the norms hold gain, bias and eps under timm's names; norm_linear applies them (never called)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, head_dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, hidden)

    def forward(self, x):
        # a branch with no units adds what a fully masked one outputs, its bias: no norm, no kernels
        x = x + (self.attn(x, self.norm1) if self.attn.num_heads else self.attn.proj.bias)
        x = x + (self.mlp(x, self.norm2) if self.mlp.hidden else self.mlp.fc2.bias)
        return x

    # ---- the one place that says which rows/columns of which tensors a unit owns (KINDS: heads, mlp) ----
    def units(self, kind):
        """For kind 'heads' or 'mlp': (n units, rows per unit w, [(module, attr, dim, side, segments)]).
        Unit u owns rows seg*n*w + u*w + [0, w) along `dim` for seg < segments (see the layout above)."""
        if kind == "heads":
            a = self.attn
            return a.num_heads, a.head_dim, [(a.qkv, "weight", 0, "in", 3), (a.qkv, "bias", 0, "in", 3),
                                             (a.proj, "weight", 1, "out", 1)]
        if kind == "mlp":
            m = self.mlp
            return m.hidden, 1, [(m.fc1, "weight", 0, "in", 1), (m.fc1, "bias", 0, "in", 1),
                                 (m.fc2, "weight", 1, "out", 1)]
        raise ValueError(f"unit kind must be 'heads' or 'mlp', got {kind!r}")

    def set_units(self, kind, n):
        """Record a new unit count after the tensors were replaced (keeps Linear metadata honest)."""
        if kind == "heads":
            self.attn.num_heads = n
            self.attn.qkv.out_features = 3 * n * self.attn.head_dim
            self.attn.proj.in_features = n * self.attn.head_dim
        else:
            self.mlp.hidden = n
            self.mlp.fc1.out_features = n
            self.mlp.fc2.in_features = n


def unit_rows(idx, n, w, segments):
    """Indices along a tensor's unit dim for units idx (n units of w rows, `segments` blocks of n*w)."""
    r = (idx[:, None] * w + torch.arange(w, device=idx.device)).reshape(-1)
    return torch.cat([s * n * w + r for s in range(segments)])


def per_row(values, w, segments):
    """Expand one value per unit to one value per row, in unit_rows' order."""
    return values.repeat_interleave(w).repeat(segments)


def leaf(mod, attr):
    """The trainable tensor behind mod.attr: the original when a mask parametrization sits on it."""
    return mod.parametrizations[attr].original if parametrize.is_parametrized(mod, attr) else getattr(mod, attr)


# ----------------------------------------------------------------------------------------------
# resize: gather the units of every block, parameters and optimizer state through the same indices

# how an optimizer state tensor scales on the INPUT side of a unit split m ways: the copy's input
# gradient is 1/m of the parent's (its output side was divided by m), so 1st moments / m, 2nd / m^2.
# On the OUTPUT side every copy sees the parent's gradient: state is copied as it is.
STATE_POWER = {"exp_avg": 1, "momentum_buffer": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 2}
FRESH = -1  # a source index that asks for a new unit instead of a copy
INIT_STD = 0.02  # the ViT's own init of a linear weight (vit.ViT.__init__)


@torch.no_grad()
def resize(model, optimizer, heads, mlp, eps=0.0, generator=None, shadow=None):
    """Rebuild block i with the source units heads[i] / mlp[i] (1-D LongTensors; None = untouched).
    Source u keeps unit u, or copies it: a source that appears m times is split into m copies (Net2Net),
    input side copied and pushed by +-eps * s * z (z ~ N(0, 1), opposite signs, so the copies' mean is
    the source; s is the tensor's median row RMS, because a push in units of the row itself would make
    a lineage's rows longer at every split, geometrically), output side divided by m: the function is
    the same to first order in eps. A source FRESH is a new unit: input weights drawn like the init,
    input bias, output side and optimizer state zero, so it outputs nothing. Every optimizer state
    tensor goes through the same indices (scaled by STATE_POWER on a split's input side), and so does
    `shadow`, an average of the weights keyed by Parameter (step.EMA), without the push. Returns, per
    kind and block, which units are new (halves of a split, or fresh)."""
    where = {}  # id(param) -> (group, position) in the optimizer
    for g in optimizer.param_groups if optimizer is not None else []:
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
            if idx.ndim != 1 or (idx.numel() and (idx.min() < FRESH or idx.max() >= n)):
                raise ValueError(f"{kind} indices must be a 1-D tensor with values in [0, {n}) or {FRESH} (fresh)")
            new_unit = idx == FRESH
            src = idx.clamp(min=0)  # a fresh unit gathers unit 0, then is overwritten
            m = torch.bincount(idx[~new_unit], minlength=n)[src].double() if n else torch.ones(len(idx), device=dev)
            m[new_unit] = 1
            rank = ((idx[:, None] == idx[None, :]) & ~new_unit[:, None]).double().tril(-1).sum(1)  # 0 = the parent
            sign = (m - 1) - 2 * rank  # e.g. +1/-1 for a pair, +2/0/-2 for three: sums to zero
            fresh[kind].append((m > 1) | new_unit)
            for tensor in tensors:
                resize_tensor(tensor, kind, n, w, src, m, sign, new_unit, eps, generator, shadow, optimizer, where)
            blk.set_units(kind, idx.numel())
    if optimizer is not None:
        check_optimizer(model, optimizer)
    if shadow is not None:
        check_shadow(model, shadow)
    return fresh


def resize_tensor(tensor, kind, n, w, src, m, sign, new_unit, eps, generator, shadow, optimizer, where):
    """One tensor of a block (a row of Block.units) rebuilt from the source units, and its optimizer
    state and average with it (see resize)."""
    mod, attr, dim, side, seg = tensor
    old = getattr(mod, attr)
    rows = unit_rows(src, n, w, seg)
    shape = [1] * old.ndim
    shape[dim] = -1
    size = list(old.shape)
    size[dim] = len(rows)
    inv_m = per_row(1.0 / m, w, seg).view(shape).to(old.dtype)
    is_new = per_row(new_unit, w, seg).view(shape)

    def gather(t, power, fill):  # power: how t scales with the input-side split (STATE_POWER)
        out = t.index_select(dim, rows) if n else t.new_zeros(size)
        out = out * inv_m ** power if power else out
        return torch.where(is_new, fill, out) if bool(is_new.any()) else out

    wpower = 0 if side == "in" else 1  # a weight (and its average) is divided by m on the output side
    draw = 0.0
    if side == "in" and attr == "weight" and bool(new_unit.any()):
        draw = nn.init.trunc_normal_(torch.empty(size), std=INIT_STD, generator=generator).to(old.device, old.dtype)
    new = gather(old, wpower, draw)
    if side == "in" and attr == "weight" and eps > 0 and bool((m > 1).any()):
        typical = old.pow(2).mean(1 - dim).sqrt().median()  # push in units of the tensor's typical row
        u = torch.randn(old.shape, generator=generator).to(old.device, old.dtype) * typical
        new += eps * per_row(sign, w, seg).view(shape).to(old.dtype) * u.index_select(dim, rows)
    new = nn.Parameter(new, requires_grad=old.requires_grad)
    setattr(mod, attr, new)
    if shadow is not None:
        shadow[new] = gather(shadow.pop(old), wpower, 0.0)
    if optimizer is None:
        return
    if id(old) not in where:
        raise RuntimeError(f"{kind} tensor {attr} of shape {tuple(old.shape)} is not in the optimizer")
    g, i = where.pop(id(old))
    g["params"][i] = new
    remapped = {}
    for key, v in optimizer.state.pop(old, {}).items():
        if torch.is_tensor(v) and v.shape == old.shape:
            if key not in STATE_POWER:
                raise RuntimeError(f"don't know how optimizer state {key!r} scales on a split")
            remapped[key] = gather(v, STATE_POWER[key] if side == "in" else 0, 0.0)
        else:
            remapped[key] = v  # the step count and other shape-free entries are kept
    if remapped:
        optimizer.state[new] = remapped


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


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig, heads=None, mlp=None):
        """heads[i], mlp[i]: units of block i (default: dense, cfg.num_heads and cfg.mlp_hidden)."""
        super().__init__()
        if cfg.img_size % cfg.patch_size or cfg.dim % cfg.num_heads:
            raise ValueError(f"img_size must divide by patch_size and dim by num_heads: {cfg}")
        heads = [cfg.num_heads] * cfg.depth if heads is None else list(heads)
        mlp = [cfg.mlp_hidden] * cfg.depth if mlp is None else list(mlp)
        if len(heads) != cfg.depth or len(mlp) != cfg.depth:
            raise ValueError(f"need {cfg.depth} head and mlp counts, got {len(heads)} and {len(mlp)}")
        self.cfg = cfg
        D, N = cfg.dim, (cfg.img_size // cfg.patch_size) ** 2
        self.patch_embed = nn.Conv2d(cfg.in_chans, D, cfg.patch_size, cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D))
        self.pos_embed = nn.Parameter(torch.zeros(1, N + 1, D))
        self.blocks = nn.ModuleList([Block(D, h, cfg.head_dim, f) for h, f in zip(heads, mlp)])
        self.norm = nn.LayerNorm(D, eps=1e-6)
        self.head = nn.Linear(D, cfg.num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def trunk(self, img):
        x = patch_linear(img, self.patch_embed)  # (B, N, D)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return x[:, 0]  # (B, D): only the class token is read

    def features(self, img):
        """What the classifier head reads: the normalised class token (B, D)."""
        return self.norm(self.trunk(img))

    def forward(self, img):
        return norm_linear(self.trunk(img), self.norm, self.head.weight, self.head.bias)  # (B, classes)

    def counts(self, kind):
        return [b.units(kind)[0] for b in self.blocks]

    def flops_per_image(self):
        """Multiply-adds of one forward pass (matmuls only; what the unit counts decide)."""
        c = self.cfg
        N, D, hd = (c.img_size // c.patch_size) ** 2 + 1, c.dim, c.head_dim
        total = N * D * c.in_chans * c.patch_size ** 2 + D * c.num_classes
        for b in self.blocks:
            h, f = b.attn.num_heads, b.mlp.hidden
            total += N * D * 4 * h * hd + 2 * N * N * h * hd + 2 * N * D * f
        return total


def preset(name, **overrides):
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)
