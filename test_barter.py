"""
Tests: CPU only, no network, micro models, a few minutes on 2 cores. Every check compares against a
reference computed here: a hand-written ViT forward with explicit gates, a dense model masked by
hand, torchvision's VisionTransformer, index arithmetic written out independently of vit.unit_rows.
"""
import copy
import gc
import inspect
import itertools
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import barter
import data
import runlog
import train
from barter import Barter, Schedule, round_half_up, taylor_scores, unit_budgets
from baselines import BiDST, Masked, Unstructured, erk_densities
from step import EMA, Graph, Ranks, Stepper, autocast, evaluate, load_optimizer, make_optimizer, set_lr, train_step
import vit
import weights
from vit import PRESETS, ViT, leaf, resize
from weights import from_torchvision

REPO = os.path.dirname(os.path.abspath(__file__))  # the CLIs run from here
CFG = PRESETS["micro"]  # 3 blocks, dim 32, 4 heads of 8, 64 MLP channels
HD = CFG.head_dim
# the tests marked with DEVICES also run on a GPU where there is one (`pytest -k cuda` picks those);
# there in fp32, whose kernels differ from the CPU's fp64 reference in rounding only
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def micro(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    m = ViT(replace(CFG, **kw)).to(dtype)
    with torch.no_grad():  # nonzero biases, so that a bias leak would show; norm gains not all 1
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in n:
                p.normal_(1, 0.2)
    return m


def batch(n=4, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g, dtype=dtype), torch.randint(0, 10, (n,), generator=g)


# ---- an independent reference forward: explicit per-head attention, gates on every unit --------

def ref_forward(m, x, head_gates=None, mlp_gates=None):
    """Hand-written forward of our ViT's weights (softmax attention, no SDPA). head_gates[i] (h_i,)
    multiplies each head's output before proj; mlp_gates[i] (f_i,) each channel after the GELU."""
    x = F.conv2d(x, m.patch_embed.weight, m.patch_embed.bias, stride=CFG.patch_size).flatten(2).transpose(1, 2)
    x = torch.cat([m.cls_token.expand(len(x), -1, -1), x], 1) + m.pos_embed
    for i, b in enumerate(m.blocks):
        h, D = b.attn.num_heads, CFG.dim
        y = F.layer_norm(x, (D,), b.norm1.weight, b.norm1.bias, 1e-6)
        qkv = y @ leaf(b.attn.qkv, "weight").T + leaf(b.attn.qkv, "bias")
        outs = []
        for j in range(h):
            q, k, v = (qkv[..., s * h * HD + j * HD: s * h * HD + (j + 1) * HD] for s in range(3))
            a = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(HD), -1) @ v
            outs.append(a * (head_gates[i][j] if head_gates else 1))
        attn = b.attn.proj.bias + (torch.cat(outs, -1) @ leaf(b.attn.proj, "weight").T if h else 0)
        x = x + attn
        y = F.layer_norm(x, (D,), b.norm2.weight, b.norm2.bias, 1e-6)
        f = b.mlp.hidden
        hid = F.gelu(y @ leaf(b.mlp.fc1, "weight").T + leaf(b.mlp.fc1, "bias"))
        if mlp_gates:
            hid = hid * mlp_gates[i]
        x = x + b.mlp.fc2.bias + (hid @ leaf(b.mlp.fc2, "weight").T if f else 0)
    return F.layer_norm(x, (CFG.dim,), m.norm.weight, m.norm.bias, 1e-6)[:, 0] @ m.head.weight.T + m.head.bias


def qkv_rows(heads, h):
    """Rows of qkv owned by the given heads, written out: q block, then k block, then v block."""
    return [s * h * HD + j * HD + r for s in range(3) for j in heads for r in range(HD)]


def head_cols(heads):
    return [j * HD + r for j in heads for r in range(HD)]


def mask_by_hand(m, heads, mlp):
    """Zero every tensor entry of the units NOT in heads[i] / mlp[i] (a dense model, masked)."""
    with torch.no_grad():
        for b, hk, fk in zip(m.blocks, heads, mlp):
            drop_h = [j for j in range(CFG.num_heads) if j not in hk]
            drop_f = [c for c in range(CFG.mlp_hidden) if c not in fk]
            b.attn.qkv.weight[qkv_rows(drop_h, CFG.num_heads)] = 0
            b.attn.qkv.bias[qkv_rows(drop_h, CFG.num_heads)] = 0
            b.attn.proj.weight[:, head_cols(drop_h)] = 0
            b.mlp.fc1.weight[drop_f] = 0
            b.mlp.fc1.bias[drop_f] = 0
            b.mlp.fc2.weight[:, drop_f] = 0


def test_model_matches_hand_written_reference():
    m, x = micro(), batch()[0]
    w = torch.randn(len(x), CFG.num_classes, dtype=torch.float64)
    out, ref = m(x), ref_forward(m, x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    with torch.no_grad():  # without autograd the norms run as plain layer norms, their affine unfolded
        torch.testing.assert_close(m(x), ref, rtol=0, atol=1e-12)
    # gradients too: Normalize's own backward and the norm affine folded into qkv / fc1 / head
    params = list(m.parameters())
    for g, r, (n, _) in zip(torch.autograd.grad((out * w).sum(), params), torch.autograd.grad((ref * w).sum(), params),
                            m.named_parameters()):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12, msg=n)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_keeps_one_bf16_activation_under_autocast(device):
    # nn.LayerNorm + nn.Linear under bf16 autocast keep the fp32 input and a bf16 normalised copy;
    # norm_linear keeps only the bf16 output, and computes the same function
    from vit import norm_linear

    torch.manual_seed(0)
    norm, lin = torch.nn.LayerNorm(32, eps=1e-6).to(device), torch.nn.Linear(32, 24).to(device)
    with torch.no_grad():
        norm.weight.normal_(1, 0.2), norm.bias.normal_(0, 0.1)
    x = torch.randn(4, 9, 32, device=device, requires_grad=True)

    def kept(f):  # distinct storages autograd keeps that are as large as the activations: {dtype}
        big = {}
        def pack(t):
            if t.numel() >= x.numel():
                big[t.untyped_storage().data_ptr()] = t.dtype
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(device, dtype=torch.bfloat16):
            return f(), sorted(map(str, big.values()))

    (out, ours), (ref, theirs) = kept(lambda: norm_linear(x, norm, lin.weight, lin.bias)), kept(lambda: lin(norm(x)))
    assert ours == ["torch.bfloat16"] and theirs == ["torch.bfloat16", "torch.float32"]
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02)
    g = torch.randn_like(out, dtype=torch.float32)
    gx, gref = torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0]
    assert (gx - gref).norm() < 0.02 * gref.norm()


# ---- issue 2, test 1: compact slice == dense with the other units removed by hand --------------

@pytest.mark.parametrize("multiple", [1, 8])  # 8: widths 3 and 22 run padded to 8 and 24, as on CUDA
def test_compact_slice_equals_dense_masked_by_hand(monkeypatch, multiple):
    monkeypatch.setitem(vit.GEMM_MULTIPLE, "cpu", multiple)
    heads = [[2, 0], [], [1, 2, 3]]
    mlp = [[5, 1, 60], list(range(0, 64, 3)), []]
    dense, compact = micro(), micro()
    mask_by_hand(dense, heads, mlp)
    resize(compact, None, [torch.tensor(h, dtype=torch.long) for h in heads],
           [torch.tensor(f, dtype=torch.long) for f in mlp])
    assert compact.counts("heads") == [2, 0, 3] and compact.counts("mlp") == [3, 22, 0]
    x, y = batch()
    for mm in (dense, compact):
        F.cross_entropy(mm(x), y).backward()
    torch.testing.assert_close(compact(x), dense(x), rtol=0, atol=1e-12)
    for i, (bd, bc) in enumerate(zip(dense.blocks, compact.blocks)):
        rows = qkv_rows(heads[i], CFG.num_heads)
        torch.testing.assert_close(bc.attn.qkv.weight.grad if heads[i] else torch.zeros(0, CFG.dim, dtype=torch.float64),
                                   bd.attn.qkv.weight.grad[rows], rtol=0, atol=1e-12)
        torch.testing.assert_close(bc.attn.proj.weight.grad if heads[i] else torch.zeros(CFG.dim, 0, dtype=torch.float64),
                                   bd.attn.proj.weight.grad[:, head_cols(heads[i])], rtol=0, atol=1e-12)
        torch.testing.assert_close(bc.attn.proj.bias.grad, bd.attn.proj.bias.grad, rtol=0, atol=1e-12)
        if mlp[i]:
            torch.testing.assert_close(bc.mlp.fc1.weight.grad, bd.mlp.fc1.weight.grad[mlp[i]], rtol=0, atol=1e-12)
            torch.testing.assert_close(bc.mlp.fc2.weight.grad, bd.mlp.fc2.weight.grad[:, mlp[i]], rtol=0, atol=1e-12)
    torch.testing.assert_close(compact.head.weight.grad, dense.head.weight.grad, rtol=0, atol=1e-12)


def test_empty_branch_adds_only_its_bias_and_backprops():
    m = micro()
    resize(m, None, [torch.zeros(0, dtype=torch.long)] * 3, [torch.zeros(0, dtype=torch.long)] * 3)
    x, y = batch()
    F.cross_entropy(m(x), y).backward()
    torch.testing.assert_close(m(x), ref_forward(m, x), rtol=0, atol=1e-12)
    assert m.blocks[0].attn.proj.bias.grad is not None and m.blocks[0].mlp.fc2.bias.grad is not None
    assert m.blocks[0].attn.qkv.weight.shape == (0, CFG.dim)


# ---- issue 2, test 2: clones preserve the function -------------------------------------------

CLONE_HEADS = [[0, 1, 2, 3, 1, 1], [3, 3, 3], []]  # block 0: head 1 split 3 ways; block 1: one head 3 ways
CLONE_MLP = [list(range(64)) + [7, 7, 9], [0, 0, 1, 2], []]


def clone_plan():
    return ([torch.tensor(h, dtype=torch.long) for h in CLONE_HEADS],
            [torch.tensor(f, dtype=torch.long) for f in CLONE_MLP])


def clone_source():
    """A model whose units outside the clone plan's sources are already removed by hand."""
    m = micro()
    mask_by_hand(m, [[0, 1, 2, 3], [3], []], [list(range(64)), [0, 1, 2], []])
    return m


def test_clone_preserves_logits_exactly():
    m = clone_source()
    x, _ = batch()
    before = m(x)
    resize(m, None, *clone_plan())
    assert m.counts("heads") == [6, 3, 0] and m.counts("mlp") == [67, 4, 0]
    torch.testing.assert_close(m(x), before, rtol=0, atol=1e-12)


def test_clone_perturbation_is_symmetric_to_first_order():
    x, _ = batch()
    before = clone_source()(x)
    diffs = []
    for eps in (1e-4, 2e-4):
        m = clone_source()
        resize(m, None, *clone_plan(), eps=eps, generator=torch.Generator().manual_seed(0))
        assert not torch.equal(m.blocks[0].attn.qkv.weight[HD:2 * HD], m.blocks[0].attn.qkv.weight[4 * HD:5 * HD])
        diffs.append((m(x) - before).abs().max().item())
    # an asymmetric perturbation would change the logits in first order (ratio 2); ours in second (4)
    assert 3.5 < diffs[1] / diffs[0] < 4.5


def test_default_clone_halves_are_distinct_units_around_their_parent():
    src = clone_source()
    m = copy.deepcopy(src)
    resize(m, None, [None, None, None], [torch.tensor([0, 0, 1, 2]), None, None], eps=inspect.signature(Barter).parameters["eps"].default,
           generator=torch.Generator().manual_seed(0))
    w, (a, b) = src.blocks[0].mlp.fc1.weight[0], m.blocks[0].mlp.fc1.weight[:2]
    torch.testing.assert_close((a + b) / 2, w, rtol=0, atol=1e-15)  # the pair's mean is the parent
    typical = src.blocks[0].mlp.fc1.weight.pow(2).mean(1).sqrt().median()
    assert 0.7 < ((a - b) / 2).pow(2).mean().sqrt().item() / typical.item() < 1.4  # +-eps * s * u, eps = 1
    assert abs(F.cosine_similarity(a, b, dim=0).item()) < 0.6  # not near-duplicates


def test_a_lineage_split_again_and_again_does_not_grow_geometrically():
    """The split's push is sized by the tensor's typical row, not by the row being split: a copy's row is
    longer than its source's (|w +- d|^2 = |w|^2 + |d|^2), so a push in units of the row itself would
    lengthen a lineage by sqrt(1 + eps^2) at every split, and the units that kept being split grew
    without bound (measured: a block-0 fc1 row from 0.2 to 1e4 in 16 epochs; training diverged)."""
    m = clone_source()
    g = torch.Generator().manual_seed(0)
    fc1 = m.blocks[0].mlp.fc1
    norms = [fc1.weight[0].norm().item()]
    for _ in range(12):  # split unit 0 again and again: one copy stays at index 0
        n = fc1.weight.shape[0]
        resize(m, None, [None, None, None], [torch.tensor([0, 0] + list(range(2, n))), None, None], eps=1.0, generator=g)
        fc1 = m.blocks[0].mlp.fc1
        norms.append(fc1.weight[0].norm().item())
    typical = clone_source().blocks[0].mlp.fc1.weight.norm(dim=1).median().item()
    # each split adds about |d|^2 = typical^2 to the squared length: ~sqrt(13) typical after 12, not 2^6 |w|
    assert norms[-1] ** 2 < norms[0] ** 2 + 12 * 3 * typical ** 2


def test_churn_sets_what_moves_over_the_whole_run():
    s = Schedule(1404, 50, end_frac=0.75, churn=0.5)
    steps = [t for t in range(1, 1405) if s.is_update(t)]
    assert steps[0] == 50 and steps[-1] == 1050 and sum(s.alpha(t) for t in steps) == pytest.approx(0.5)
    assert s.updates() == steps
    assert Schedule(1404, 100, alpha0=0.3).alpha0 == 0.3  # without churn: RigL's alpha0 as given
    for a0 in (0.0, 0.05, 1.0):  # with churn, alpha0 given does not matter
        assert Schedule(1404, 50, alpha0=a0, end_frac=0.75, churn=0.5).alpha0 == s.alpha0


# ---- issue 2, test 3: optimizer state is remapped with the same indices ------------------------

def trained_micro(make_optimizer=lambda m: make_optimizer(m, 1e-3, 0.05)):
    """micro after two optimizer steps (AdamW unless told), so every parameter has state to remap; with
    its batch."""
    m = micro()
    opt = make_optimizer(m)
    x, y = batch()
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    return m, opt, x, y


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_optimizer_state_remap(opt_name):
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-4)
    m, opt, x, y = trained_micro() if opt_name == "adamw" else trained_micro(sgd)
    blk = m.blocks[0]
    old = {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
           for n, p in blk.named_parameters()}
    groups = [(len(g["params"]), g["weight_decay"]) for g in opt.param_groups]
    heads = [torch.tensor([2, 0, 0]), None, None]  # drop 1 and 3, split 0 in two
    mlp = [torch.tensor([4, 4, 4, 10]), None, None]
    resize(m, opt, heads, mlp)
    assert [(len(g["params"]), g["weight_decay"]) for g in opt.param_groups] == groups
    live = {id(p) for p in m.parameters()}
    assert all(id(p) in live for g in opt.param_groups for p in g["params"])
    assert all(id(p) in live for p in opt.state)
    first, second = ("exp_avg", "exp_avg_sq") if opt_name == "adamw" else ("momentum_buffer", None)
    src = [2, 0, 0]
    m_of = [1, 2, 2]  # copies of each new head's source
    rows = [s * 4 * HD + j * HD + r for s in range(3) for j in src for r in range(HD)]
    rscale = torch.tensor([1 / m_of[k] for s in range(3) for k in range(3) for r in range(HD)], dtype=torch.float64)
    cols = [j * HD + r for j in src for r in range(HD)]
    cscale = torch.tensor([1 / m_of[k] for k in range(3) for r in range(HD)], dtype=torch.float64)
    new_state = {n: opt.state[p] for n, p in blk.named_parameters()}
    for n, p in blk.named_parameters():
        assert p.shape == new_state[n][first].shape
        if opt_name == "adamw":
            assert torch.equal(new_state[n]["step"], old[n][1]["step"])
    W, S = old["attn.qkv.weight"]
    torch.testing.assert_close(blk.attn.qkv.weight.detach(), W[rows], rtol=0, atol=0)
    torch.testing.assert_close(new_state["attn.qkv.weight"][first], S[first][rows] * rscale[:, None], rtol=0, atol=1e-15)
    if second:
        torch.testing.assert_close(new_state["attn.qkv.weight"][second], S[second][rows] * rscale[:, None] ** 2, rtol=0, atol=1e-18)
    W, S = old["attn.proj.weight"]
    torch.testing.assert_close(blk.attn.proj.weight.detach(), W[:, cols] * cscale, rtol=0, atol=1e-15)
    torch.testing.assert_close(new_state["attn.proj.weight"][first], S[first][:, cols], rtol=0, atol=0)
    W, S = old["mlp.fc1.bias"]
    torch.testing.assert_close(new_state["mlp.fc1.bias"][first], S[first][[4, 4, 4, 10]] * torch.tensor([1 / 3] * 3 + [1.0], dtype=torch.float64), rtol=0, atol=1e-15)
    W, S = old["mlp.fc2.weight"]
    torch.testing.assert_close(blk.mlp.fc2.weight.detach(), W[:, [4, 4, 4, 10]] * torch.tensor([1 / 3] * 3 + [1.0], dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(new_state["mlp.fc2.weight"][first], S[first][:, [4, 4, 4, 10]], rtol=0, atol=0)
    assert blk.attn.proj.bias is old["attn.proj.bias"][0] or torch.equal(blk.attn.proj.bias, old["attn.proj.bias"][0])
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    opt.step()  # one more step runs on the resized tensors
    assert torch.isfinite(m(x)).all()


def test_average_is_the_warmed_up_exponential_average():
    m = micro()
    ema = EMA(m, 0.8)
    ref = {n: p.detach().clone() for n, p in m.named_parameters()}
    g = torch.Generator().manual_seed(3)
    for t in range(1, 12):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        ema.update(m, t)
        d = min(0.8, (1 + t) / (10 + t))  # TensorFlow's num_updates warmup: 0.18 at step 1, 0.8 from step 26
        ref = {n: d * ref[n] + (1 - d) * p.detach() for n, p in m.named_parameters()}
    for n, p in m.named_parameters():
        torch.testing.assert_close(ema.shadow[p], ref[n], rtol=0, atol=1e-12)


def test_average_goes_through_a_resize_like_the_weights():
    """After pruning and splitting, the compact average computes what the dense average computes with
    the pruned units masked by hand: it was gathered through the weights' indices, and a split takes no
    +-eps in it (the live weights do), so the average's function is unchanged by a split."""
    m, x = micro(), batch()[0]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ema = EMA(m, 0.7)
    for t in range(1, 6):
        opt.zero_grad()
        F.cross_entropy(m(x), batch()[1]).backward()
        opt.step()
        ema.update(m, t)
    dense_avg = copy.deepcopy(m)
    with torch.no_grad():
        for p, q in zip(dense_avg.parameters(), m.parameters()):
            p.copy_(ema.shadow[q])
    heads, mlp = [[0, 0, 2], [3], [1, 3, 3]], [list(range(10, 30)) + [10, 11], [5, 1, 63], list(range(64))]
    mask_by_hand(dense_avg, [sorted(set(h)) for h in heads], [sorted(set(f)) for f in mlp])
    resize(m, opt, [torch.tensor(h) for h in heads], [torch.tensor(f) for f in mlp], eps=1.0,
           generator=torch.Generator().manual_seed(0), shadow=ema.shadow)
    vit.check_shadow(m, ema.shadow)
    live = m(x)
    with ema.swapped_in(m):
        torch.testing.assert_close(m(x), dense_avg(x), rtol=0, atol=1e-12)
        qkv = m.blocks[0].attn.qkv.weight  # the average's halves of head 0 are equal; the live ones differ
        assert torch.equal(qkv[:HD], qkv[HD:2 * HD])
    assert not torch.equal(m.blocks[0].attn.qkv.weight[:HD], m.blocks[0].attn.qkv.weight[HD:2 * HD])
    torch.testing.assert_close(m(x), live, rtol=0, atol=0)  # the model's own weights are back
    _, meth, _, _, recs = run("barter", ema_decay=0.9)  # and in training: every update checks the average
    assert recs and meth.shadow is not None
    vit.check_shadow(meth.model, meth.shadow)


def test_fresh_units_leave_the_function_and_start_with_zero_adam_state():
    m, opt, x, y = trained_micro()
    resize(m, None, [None, None, torch.tensor([], dtype=torch.long)], None)  # block 2 loses its heads
    opt = make_optimizer(m, 1e-3, 0.05)
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    opt.step()
    pruned = copy.deepcopy(m)  # the same units without the fresh ones
    resize(pruned, None, [torch.tensor([2, 0]), None, None], [torch.tensor([5, 7]), None, None])
    blk = m.blocks[0]
    old = {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for n, p in blk.named_parameters()}
    fresh = resize(m, opt, [torch.tensor([2, -1, 0]), None, torch.tensor([-1])], [torch.tensor([5, -1, -1, 7]), None, None],
                   generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(m(x), pruned(x), rtol=0, atol=1e-12)  # zero output side: no change of function
    assert [f.tolist() for f in fresh["heads"] if f is not None] == [[False, True, False], [True]]
    assert fresh["mlp"][0].tolist() == [False, True, True, False]
    assert m.counts("heads") == [3, 4, 1] and m.counts("mlp")[0] == 4
    W, S = old["attn.qkv.weight"]
    new_rows = [s * 3 * HD + HD + r for s in range(3) for r in range(HD)]  # q, k, v rows of new head 1
    kept = [s * 3 * HD + j * HD + r for s in range(3) for j in (0, 2) for r in range(HD)]
    src = [s * 4 * HD + j * HD + r for s in range(3) for j in (2, 0) for r in range(HD)]
    qkv, st = blk.attn.qkv.weight.detach(), opt.state[blk.attn.qkv.weight]
    assert torch.equal(qkv[kept], W[src]) and torch.equal(st["exp_avg"][kept], S["exp_avg"][src])
    assert 0.01 < qkv[new_rows].std() < 0.03 and not blk.attn.qkv.bias[new_rows].any()
    assert S["exp_avg_sq"].all() and torch.equal(st["exp_avg_sq"][kept], S["exp_avg_sq"][src])
    assert not st["exp_avg"][new_rows].any() and not st["exp_avg_sq"][new_rows].any()  # as a regrown masked unit
    assert not blk.attn.proj.weight[:, HD:2 * HD].any()
    proj_state = opt.state[blk.attn.proj.weight]
    assert not proj_state["exp_avg"][:, HD:2 * HD].any() and not proj_state["exp_avg_sq"][:, HD:2 * HD].any()
    assert torch.equal(proj_state["exp_avg_sq"][:, [0, 2 * HD]], old["attn.proj.weight"][1]["exp_avg_sq"][:, [2 * HD, 0]])
    assert not m.blocks[2].attn.proj.weight.any() and m.blocks[2].attn.qkv.weight.abs().sum() > 0  # from 0 units
    assert m.blocks[2].attn.qkv.weight not in opt.state  # it never had a gradient: Adam starts it afresh
    W, S = old["mlp.fc2.weight"]
    assert torch.equal(blk.mlp.fc2.weight[:, [0, 3]].detach(), W[:, [5, 7]]) and not blk.mlp.fc2.weight[:, 1:3].any()
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    opt.step()  # the new units learn: their output side moves off zero
    assert blk.mlp.fc2.weight[:, 1:3].abs().sum() > 0 and blk.attn.proj.weight[:, HD:2 * HD].abs().sum() > 0


def test_gate_taylor_equals_gate_gradient():
    m = micro()
    resize(m, None, [torch.tensor([0, 1, 2, 3]), torch.tensor([1]), torch.tensor([], dtype=torch.long)],
           [torch.arange(64), torch.arange(10), torch.arange(5)])
    x, y = batch()
    F.cross_entropy(m(x), y).backward()
    scores = {k: taylor_scores(m, k) for k in ("heads", "mlp")}
    hg = [torch.ones(h, dtype=torch.float64, requires_grad=True) for h in m.counts("heads")]
    fg = [torch.ones(f, dtype=torch.float64, requires_grad=True) for f in m.counts("mlp")]
    F.cross_entropy(ref_forward(m, x, hg, fg), y).backward()
    assert any(s.abs().sum() > 0 for s in scores["heads"])
    for s, g in zip(scores["heads"] + scores["mlp"], hg + fg):
        if g.numel() == 0:  # a block with no units: nothing to score
            assert s.numel() == 0 and g.grad is None
            continue
        torch.testing.assert_close(s.double(), g.grad, rtol=1e-5, atol=1e-9)


# ---- issue 2, test 5: hundreds of random updates keep budgets and bounds ----------------------

@pytest.mark.parametrize("frac,split", [(0.2, True), (0.2, False), (0.5, False)])
def test_random_updates_keep_budgets_exact(frac, split):
    """split: heads and channels given as two densities, so no block-floor transfer and (at 0.2) 2
    heads over 3 blocks with a minimum of 0. Otherwise 0.2 gives every block a head (3 heads, 38 - 16
    channels). Heads and channels trade, but the weights they hold together stay exact."""
    m = micro(dtype=torch.float32)
    sched = Schedule(total_steps=10**6, update_every=1, alpha0=0.5, end_frac=1.0)
    kw = {"head_frac": frac, "mlp_frac": frac} if split else {}
    b = Barter(m, sched, dense_frac=frac, seed=0, **kw)
    b.init_model()
    opt = make_optimizer(m, 1e-3, 0.05)
    g = torch.Generator().manual_seed(0)
    B_h, B_f = round(frac * 12 + 1e-9), round(frac * 192 + 1e-9)
    lo_h = 1 if B_h >= 3 else 0
    if not split and B_h < 3:
        B_h, B_f, lo_h = 3, B_f - (3 - B_h) * 16, 1  # a micro head (head_dim 8) weighs 16 channels
    lo_f = int(0.2 * B_f / 3)
    rate = 2 * m.cfg.head_dim
    moved, trades = 0, set()
    for t in range(1, 301):
        head_scale = 30.0 if t % 3 == 0 else 1.0  # so that heads also look worth their weight at times
        b.acc = {k: [torch.rand(n, generator=g) * (head_scale if k == "heads" else 1) for n in m.counts(k)]
                 for k in ("heads", "mlp")}
        b.acc2 = {k: [a * a for a in v] for k, v in b.acc.items()}
        b.nacc = 1
        rec = b.update(opt, int(torch.randint(1, 10**6, (1,), generator=g)))
        moved += rec["moved"]["mlp"]
        trades.add(rec["traded"])
        h, f = m.counts("heads"), m.counts("mlp")
        assert sum(h) * rate + sum(f) == B_h * rate + B_f
        assert all(lo_h <= n <= 4 for n in h) and all(lo_f <= n <= 64 for n in f)
        assert rec["counts"] == {"heads": h, "mlp": f}
        assert rec["moved"]["heads"] == (rec["traded"] == -1)  # a head is given up only by a trade
        assert [p.shape[0] for p in (blk.attn.qkv.weight for blk in m.blocks)] == [3 * 8 * n for n in h]
    assert moved > 0 and trades - {0}  # some update traded heads for channels or back
    train_x, train_y = batch(dtype=torch.float32)
    F.cross_entropy(m(train_x), train_y).backward()  # still a working model
    opt.step()


def test_budget_rounding_and_errors():
    budget, lo, hi = unit_budgets(PRESETS["cifar-tiny"], 0.1)
    # 8 more heads would cost 1024 channels, more than the 922: no block floor, blocks may have no head
    assert budget == {"heads": 4, "mlp": 922} and lo["heads"] == [0] * 12 and hi["mlp"] == [768] * 12
    # 4 more heads cost 4 * 32 of the 154 channels and leave at least one per block: paid
    budget, lo, hi = unit_budgets(PRESETS["tiny-32"], 0.1)
    assert budget == {"heads": 6, "mlp": 154 - 4 * 32} and lo["heads"] == [1] * 6 and lo["mlp"] == [0] * 6
    assert unit_budgets(PRESETS["micro"], 0.1)[0] == {"heads": 1, "mlp": 19}  # 2 more heads: 32 > 19 - 3
    cfg = PRESETS["tiny-28"]  # 6 blocks of 6 heads (head_dim 12) and 288 channels
    budget, lo, hi = unit_budgets(cfg, 0.1)
    assert budget == {"heads": 6, "mlp": 173 - 2 * 24} and lo["heads"] == [1] * 6
    same = barter.weight_density(cfg, [1] * 6, [125 // 6] * 5 + [125 - 5 * (125 // 6)])
    assert same == barter.weight_density(cfg, [1, 1, 1, 1, 0, 0], [173 // 6] * 5 + [173 - 5 * (173 // 6)])
    assert unit_budgets(cfg, 0.1, head_frac=0.1, mlp_frac=0.1)[0] == {"heads": 4, "mlp": 173}
    with pytest.raises(ValueError):
        unit_budgets(PRESETS["micro"], 0.01)  # no head left
    with pytest.raises(ValueError):
        unit_budgets(PRESETS["micro"], 1.5)


def test_check_units_catches_each_broken_invariant():
    lo, hi = {"heads": [1, 1], "mlp": [2, 2]}, {"heads": [4, 4], "mlp": [8, 8]}
    before = {"heads": [2, 1], "mlp": [4, 6]}  # 3 heads * 4 + 10 channels = 22 channels' worth
    barter.check_units(before, lo, hi, 4, 22)
    traded = {"heads": [2, 2], "mlp": [3, 3]}  # a head bought with 4 channels
    barter.check_units(traded, lo, hi, 4, 22, before, {"heads": -1, "mlp": 4})
    for counts, net, weights in [({"heads": [2, 2], "mlp": [3, 3]}, {"heads": 0, "mlp": 0}, 22),  # net not as said
                                 ({"heads": [3, 0], "mlp": [5, 5]}, {"heads": 0, "mlp": 0}, 22),  # a block below lo
                                 ({"heads": [2, 1], "mlp": [9, 1]}, {"heads": 0, "mlp": 0}, 22),  # above hi / below lo
                                 (before, {"heads": 0, "mlp": 0}, 23)]:  # weights not the budget
        with pytest.raises(AssertionError):
            barter.check_units(counts, lo, hi, 4, weights, before, net)
    barter.check_units(before, lo, hi, 4, 22, start={"heads": 3, "mlp": 10})
    with pytest.raises(AssertionError):  # at equal weights, but not the start's split (as separate budgets need)
        barter.check_units(traded, lo, hi, 4, 22, start={"heads": 3, "mlp": 10})


def test_select_and_exchange():
    # the weakest head (0.1) costs more than two channels' worth of the weakest channels (0.03): trade
    assert barter.exchange([0.5, 0.2], [0.01, 0.02, 1.0], rate=2) == 1
    # the margin is a factor 2 in the loss change, 4 in the squared scores the trade weighs
    assert barter.exchange([0.1], [0.02, 0.02], rate=2) == 0 and barter.exchange([0.1], [0.02, 0.02], rate=2, margin=2) == 1
    assert barter.exchange([0.01], [1.0, 1.0, 0.5], rate=2) == -1
    assert barter.exchange([0.1], [0.04, 0.05], rate=2) == 0  # within the margin
    assert barter.exchange([], [0.1, 0.1], rate=2) == 0 and barter.exchange([1.0], [0.1], rate=2) == 0
    cand = [(0.3, 0, 0), (0.1, 0, 1), (0.2, 1, 0), (0.9, 1, 1), (0.5, 1, 2)]
    P, G = barter.select([2, 3], [1, 1], [4, 4], cand, cand, k=1, net=1)  # 2 prunes, 1 clone
    assert P == [(0, 1), (1, 0)] and G == [(1, 1)]
    P, G = barter.select([2, 3], [1, 1], [4, 4], cand, cand, k=0, net=-2)  # 2 clones, no prune
    assert P == [] and G == [(1, 1), (0, 0)]  # block 1 is full (4) after its first clone
    assert barter.select([2, 3], [1, 1], [2, 3], cand, cand, k=0, net=-1) is None  # every block full
    assert barter.select([1, 1], [1, 1], [4, 4], cand, cand, k=0, net=1) is None  # every block at its floor


def test_heads_move_by_the_trade_alone():
    """With the trade on, an alpha share that swaps channels and would swap two of 8 heads swaps no
    head: heads move only when the trade buys or sells one. Without the trade the swaps are the only
    way heads move, so the same share swaps two."""
    counts = {"heads": [4, 4], "mlp": [20, 20]}
    lo, hi = {"heads": [1, 1], "mlp": [2, 2]}, {"heads": [6, 6], "mlp": [40, 40]}
    g = torch.Generator().manual_seed(0)
    cand = {k: [(float(torch.rand(1, generator=g)), b, u) for b, n in enumerate(c) for u in range(n)]
            for k, c in counts.items()}
    alpha = 0.25  # 2 of 8 heads, 10 of 40 channels
    sel, net, t = barter.choose(counts, lo, hi, cand, cand, alpha, rate=4)
    assert t == 0 and len(sel["heads"][0]) == 2 and len(sel["mlp"][0]) == 10
    even = {"heads": [1.0] * 8, "mlp": [1.0] * 40}  # within the margin: no trade
    sel, net, t = barter.choose(counts, lo, hi, cand, cand, alpha, rate=4, trade_scores=even)
    assert t == 0 and sel["heads"] == ([], []) and len(sel["mlp"][0]) == 10
    heavy = {"heads": [10.0] * 8, "mlp": [0.01] * 40}  # a head is worth far more than 4 channels: buy one
    sel, net, t = barter.choose(counts, lo, hi, cand, cand, alpha, rate=4, trade_scores=heavy)
    assert t == 1 and sel["heads"][0] == [] and len(sel["heads"][1]) == 1 and len(sel["mlp"][0]) == 10 + 4
    light = {"heads": [0.01] * 8, "mlp": [10.0] * 40}  # sell one
    sel, net, t = barter.choose(counts, lo, hi, cand, cand, alpha, rate=4, trade_scores=light)
    assert t == -1 and len(sel["heads"][0]) == 1 and sel["heads"][1] == [] and len(sel["mlp"][1]) == 10 + 4


def test_trade_weighs_squared_scores():
    """The trade compares a head with its weight in channels by mean t^2 (a group's removal cost adds
    over its units in t^2, not in |t|). Here |t| would keep the split (head 1.0 against 16 channels'
    1.6) and t^2 trades 16 channels for a head (1.0 against 0.16), and the budgets stay exact."""
    m = micro(dtype=torch.float32)
    b = Barter(m, Schedule(total_steps=100, update_every=10, alpha0=0.0), dense_frac=0.3, seed=0)
    b.init_model()
    opt = make_optimizer(m, 1e-3, 0.05)
    rate = b.rate
    assert rate == 16 and barter.exchange([1.0], [0.1] * rate, rate) == 0
    b.acc = {"heads": [torch.ones(n) for n in m.counts("heads")], "mlp": [torch.full((n,), 0.1) for n in m.counts("mlp")]}
    b.acc2 = {k: [a * a for a in v] for k, v in b.acc.items()}
    b.nacc = 1
    heads, mlp = sum(m.counts("heads")), sum(m.counts("mlp"))
    rec = b.update(opt, 10)
    assert rec["traded"] == 1
    assert sum(m.counts("heads")) == heads + 1 and sum(m.counts("mlp")) == mlp - rate
    # the same scores given to t^2 unsquared, as |t| would weigh them: no trade
    b.acc = {"heads": [torch.ones(n) for n in m.counts("heads")], "mlp": [torch.full((n,), 0.1) for n in m.counts("mlp")]}
    b.acc2, b.nacc = {k: [a.clone() for a in v] for k, v in b.acc.items()}, 1
    assert b.update(opt, 20)["traded"] == 0


# ---- issue 2, test 6: our ViT == torchvision's VisionTransformer ------------------------------

def test_matches_torchvision_vit():
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    tv = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32,
                           mlp_dim=64, num_classes=7).double().eval()
    with torch.no_grad():
        for p in tv.parameters():
            p.normal_(0, 0.2)
    ours = from_torchvision(tv).double().eval()
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    torch.testing.assert_close(ours(x), tv(x), rtol=1e-9, atol=1e-10)


# ---- issue 2, test 7 and issue 3, test 5: every method trains ----------------------------------

def run(method, steps=40, frac=0.3, seed=0, update_every=8, ema_decay=None, grow=None):
    m = micro(seed=seed, dtype=torch.float32)
    sched = Schedule(total_steps=steps, update_every=update_every, alpha0=0.3, end_frac=0.9)
    meth = train.make_method(method, m, sched, frac, seed=seed, grow=grow)
    meth.init_model()
    opt = make_optimizer(m, 2e-3, 0.05)
    ema = EMA(m, ema_decay) if ema_decay else None  # as train.train wires it: meth.shadow is its dict
    meth.shadow = ema.shadow if ema else None
    x, y = batch(64, seed=5, dtype=torch.float32)
    losses, recs, step = [], [], Stepper(m, meth, opt, nullcontext(), clip=1.0)
    for t in range(1, steps + 1):
        loss, rec = step(x, y, t)
        if ema:
            ema.update(m, t)
        losses.append(float(loss))
        recs += [rec] if rec else []
    return m, meth, opt, losses, recs


def test_barter_trains_moves_units_and_is_deterministic():
    m, meth, opt, losses, recs = run("barter")
    assert losses[-1] < 0.7 * losses[0]
    assert len(recs) >= 4
    start = {"heads": [2, 1, 1], "mlp": [20, 19, 19]}  # uniform allocation of 4 heads, 58 channels
    assert any(r["counts"] != start for r in recs), "no unit moved between blocks"
    # heads and channels may trade, a micro head (head_dim 8) for 16 channels: the weights stay exact
    assert all(16 * sum(r["counts"]["heads"]) + sum(r["counts"]["mlp"]) == 16 * 4 + 58 for r in recs)
    m2, _, _, losses2, recs2 = run("barter")
    assert losses == losses2 and recs2[-1]["counts"] == recs[-1]["counts"]
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("method", ["masked", "rigl", "set", "bidst", "dense"])
def test_baselines_train(method):
    m, meth, opt, losses, recs = run(method)
    assert losses[-1] < 0.7 * losses[0]
    if method != "dense":
        assert len(recs) >= 4 and all({"step", "moved", "counts"} <= set(r) for r in recs)


# ---- issue 3 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_masked_equals_compact(device):
    """Same active units: the structured masked model and the compact BARTER model agree."""
    heads, mlp = [[0, 3], [2], [0, 1, 2, 3]], [list(range(10, 30)), [1, 5, 63], list(range(64))]
    dtype = torch.float64 if device == "cpu" else torch.float32
    tol = dict(rtol=0, atol=1e-12) if device == "cpu" else dict(rtol=1e-4, atol=1e-6)
    dense, compact = micro().to(device, dtype), micro().to(device, dtype)
    resize(compact, None, [torch.tensor(h) for h in heads], [torch.tensor(f) for f in mlp])
    meth = Masked(dense, Schedule(100), dense_frac=0.5)
    for i in range(3):
        meth.active["heads"][i] = torch.tensor([j in heads[i] for j in range(4)])
        meth.active["mlp"][i] = torch.tensor([c in mlp[i] for c in range(64)])
        for kind in ("heads", "mlp"):
            for mod, attr, *_ in dense.blocks[i].units(kind)[2]:
                mod.parametrizations[attr][0].mask = meth.unit_mask(i, kind, mod, attr)
    x, y = (t.to(device) for t in batch(dtype=dtype))
    ld, lc = F.cross_entropy(dense(x), y), F.cross_entropy(compact(x), y)
    torch.testing.assert_close(dense(x), compact(x), **tol)
    ld.backward()
    lc.backward()
    for i, (bd, bc) in enumerate(zip(dense.blocks, compact.blocks)):
        rows = qkv_rows(heads[i], 4)
        torch.testing.assert_close(leaf(bd.attn.qkv, "weight").grad[rows], bc.attn.qkv.weight.grad, **tol)
        torch.testing.assert_close(leaf(bd.attn.proj, "weight").grad[:, head_cols(heads[i])], bc.attn.proj.weight.grad, **tol)
        torch.testing.assert_close(leaf(bd.mlp.fc1, "bias").grad[mlp[i]], bc.mlp.fc1.bias.grad, **tol)
        torch.testing.assert_close(leaf(bd.mlp.fc2, "weight").grad[:, mlp[i]], bc.mlp.fc2.weight.grad, **tol)


@pytest.mark.parametrize("method", ["masked", "rigl", "set", "bidst"])
def test_masked_weights_and_state_stay_zero(method):
    m, meth, opt, losses, recs = run(method, steps=50, update_every=6, ema_decay=0.9)
    assert len(recs) >= 5
    for name, (mod, attr, p) in meth.masks.items():
        W, off = leaf(mod, attr), p.mask == 0
        assert off.any()
        assert torch.count_nonzero(W[off]) == 0, name
        for k, v in opt.state[W].items():
            if v.shape == W.shape:
                assert torch.count_nonzero(v[off]) == 0, (name, k)
        avg = meth.shadow[W]  # the average of the weights: as sparse as they are, and not a copy of them
        assert torch.count_nonzero(avg[off]) == 0 and not torch.equal(avg[~off], W[~off]), name


@pytest.mark.parametrize("method", ["masked", "rigl", "set"])
def test_no_layer_keeps_a_dense_gradient_after_an_update(method):
    """A method that grows by the dense gradient takes it at an update step only: after every step no mask
    holds one, nor the hook that makes each backward keep one, a layer that moved nothing included."""
    m = micro(dtype=torch.float32)
    sched = Schedule(total_steps=40, update_every=4, alpha0=0.01, end_frac=0.9)  # late updates move few weights
    meth = train.make_method(method, m, sched, 0.3)
    meth.init_model()
    step = Stepper(m, meth, make_optimizer(m, 1e-3, 0.05), nullcontext(), clip=1.0)
    for t in range(1, 41):
        step(*batch(16, seed=t, dtype=torch.float32), t)
        held = [n for n, (_, _, p) in meth.masks.items() if p.capture or p.grad is not None]
        assert not held, (t, held)
    if method != "masked":  # the case that kept them: an update at which some layer moved nothing, others some
        moves = [[round_half_up(sched.alpha(t) * k) for k in meth.k.values()] for t in range(1, 41) if sched.is_update(t)]
        assert any(0 in n and max(n) > 0 for n in moves)


def test_structured_density_from_masks():
    m, meth, opt, _, _ = run("masked", steps=30)
    for i, b in enumerate(m.blocks):  # count units from the masks themselves
        proj = b.attn.proj.parametrizations.weight[0].mask
        heads_on = int(proj[0].view(4, HD)[:, 0].sum())
        assert heads_on == meth.counts("heads")[i]
        assert int(b.mlp.fc1.parametrizations.weight[0].mask[:, 0].sum()) == meth.counts("mlp")[i]
    assert 16 * sum(meth.counts("heads")) + sum(meth.counts("mlp")) == 16 * 4 + 58  # heads and channels trade
    expect = (4 * 4 * 32 * HD + 58 * 2 * 32) / (3 * (4 * 32 * 32 + 2 * 32 * 64))
    assert meth.density() == pytest.approx(expect, abs=1e-12)


@pytest.mark.parametrize("dist", ["uniform", "erk"])
def test_unstructured_density(dist):
    m = micro(dtype=torch.float32)
    meth = Unstructured(m, Schedule(100), 0.2, "gradient", dist)
    shapes = [(96, 32), (32, 32), (64, 32), (32, 64)] * 3
    dens = [0.2] * 12 if dist == "uniform" else erk_densities(shapes, 0.2)
    assert all(0 < d <= 1 for d in dens)
    total = sum(a * b for a, b in shapes)
    on = 0
    for (name, (mod, attr, p)), (a, b), d in zip(meth.masks.items(), shapes, dens):
        nnz = int(p.mask.count_nonzero())
        assert abs(nnz - d * a * b) <= 0.5  # within rounding of each layer
        on += nnz
    assert abs(on - 0.2 * total) <= len(shapes) / 2
    assert meth.density() == on / total


def test_erk_caps_at_one_and_keeps_the_global_density():
    shapes = [(4, 4), (1000, 1000), (8, 8)]
    d = erk_densities(shapes, 0.5)
    assert d[0] == 1.0 and d[2] == 1.0
    assert sum(x * a * b for x, (a, b) in zip(d, shapes)) == pytest.approx(0.5 * sum(a * b for a, b in shapes))


def layer(model, name):
    """'blocks.1.fc1' -> model.blocks[1].mlp.fc1"""
    _, i, sub = name.split(".")
    return getattr(getattr(model.blocks[int(i)], "attn" if sub in ("qkv", "proj") else "mlp"), sub)


def test_bidst_logits_get_the_loss_gradient_and_binarize_exactly():
    m, ref = micro(), micro()  # the same init
    meth = BiDST(m, Schedule(total_steps=100, update_every=3, end_frac=1.0), 0.3)
    meth.init_model()
    masks = {n: p.mask.clone() for n, (_, _, p) in meth.masks.items()}
    with torch.no_grad():  # the reference: a plain model with the same weights masked by hand
        for name, msk in masks.items():
            layer(ref, name).weight.mul_(msk)
    logits0 = {n: s.clone() for n, s in meth.logits.items()}
    noise = torch.Generator()
    noise.set_state(meth.gen.get_state())
    opt = make_optimizer(m, 1e-3, 0.0)
    x, y = batch()
    step = Stepper(m, meth, opt, nullcontext())
    step(x, y, 1)
    F.cross_entropy(ref(x), y).backward()
    lr = opt.param_groups[0]["lr"]
    for name in meth.masks:  # dL/ds = (g W - lr g^2) dm~/ds, with the same logistic noise
        g, W = layer(ref, name).weight.grad, layer(ref, name).weight.detach()
        u = torch.rand(g.shape, generator=noise, dtype=torch.float64).clamp_(1e-6, 1 - 1e-6)
        mt = torch.sigmoid(logits0[name] + torch.log(u) - torch.log1p(-u))
        torch.testing.assert_close(meth.logit_grad[name], (g * W - lr * g * g) * mt * (1 - mt), rtol=1e-9, atol=1e-15)
        off = masks[name] == 0
        assert (meth.logit_grad[name][off] <= 0).all() and (meth.logit_grad[name][off] < 0).any()
        assert not torch.equal(meth.logits[name], logits0[name])
    with torch.no_grad():  # push logits across the threshold, then binarize: density stays exact
        for s in meth.logits.values():
            s.add_(torch.randn(s.shape, generator=torch.Generator().manual_seed(1), dtype=s.dtype) * 3)
    for t in (2, 3):
        rec = step(x, y, t)[1]
    assert rec is not None and rec["moved"]["weights"] > 0
    for name, (mod, attr, p) in meth.masks.items():
        assert int(p.mask.count_nonzero()) == meth.k[name]


# ---- issue 4: train.py end to end --------------------------------------------------------------

def targs(tmp_path, **kw):
    base = dict(model="micro", data="synthetic", batch_size=64, epochs=2, warmup_epochs=0, update_every=10,
                dense_frac=0.3, out_dir=str(tmp_path / "run"), device="cpu")
    return train.Args(**{**base, **kw})


def read_log(path):
    with open(os.path.join(path, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("method", train.METHODS)
def test_main_smoke_every_method(tmp_path, method):
    a = targs(tmp_path, method=method, max_steps=22)
    model, meth, _ = train.main(a)
    log = read_log(a.out_dir)
    ep = [r for r in log if r["type"] in ("epoch", "partial-epoch")]
    assert len(ep) == 1 and ep[0]["step"] == 22 and ep[0]["type"] == "partial-epoch"  # 78 steps per epoch
    for key in ("train_loss", "test_top1", "img_per_s", "peak_mem_mb", "params", "density"):
        assert key in ep[-1] and ep[-1][key] == ep[-1][key]
    assert 0 <= ep[-1]["data_wait"] < 1  # the share of the epoch the loop waited for batches
    ups = [r for r in log if r["type"] == "update"]
    assert len(ups) == (0 if method in ("dense", "static") else 2)
    ck = torch.load(os.path.join(a.out_dir, "checkpoint.pt"), weights_only=True)
    assert ck["step"] == 22 and ck["format"] == weights.CKPT_FORMAT
    # the finished run is published as model/, a masked run compacted to its units: the same logits either way
    pub = weights.from_pretrained(os.path.join(a.out_dir, "model"))
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    x, _ = batch(6, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(pub(x), model.eval()(x), rtol=0, atol=1e-6)
    units = meth.counts if method in train.UNIT_METHODS else model.counts
    assert config["heads"] == pub.counts("heads") == units("heads") and config["mlp"] == pub.counts("mlp") == units("mlp")
    assert config["method"] == method and sorted(os.listdir(tmp_path / "run" / "model")) == ["config.json", "model.safetensors"]
    if method == "masked":
        assert sum(pub.counts("mlp")) < sum(model.counts("mlp")) == 3 * CFG.mlp_hidden


def test_a_run_says_which_blocks_start_without_a_head(tmp_path, capsys):
    # cifar-tiny at d = 0.1: 4 heads for 12 blocks, and a head's 128 channels more than the channels can spare
    budget, _, _ = unit_budgets(PRESETS["cifar-tiny"], 0.1)
    assert budget["heads"] == 4
    train.main(targs(tmp_path, model="cifar-tiny", dense_frac=0.1, batch_size=32, max_steps=1))
    assert "8 of 12 blocks start without a head" in capsys.readouterr().out
    train.main(targs(tmp_path, max_steps=1, out_dir=str(tmp_path / "micro")))  # micro at d = 0.3: a head in each
    assert "without a head" not in capsys.readouterr().out


def test_fractional_epochs_end_the_run_and_its_schedules_mid_epoch(tmp_path):
    # study.py's equal-time runs train for a fraction of an epoch more: the lr must reach zero and the
    # topology updates stop by --end-frac of the shortened run, not of the next whole epoch
    a = targs(tmp_path, batch_size=500, epochs=1.4, update_every=2, warmup_epochs=1)  # 10 steps an epoch
    _, method, opt = train.main(a)
    log = read_log(a.out_dir)
    assert [(r["type"], r["step"]) for r in log if r["type"] != "update"] == [
        ("start", 0), ("epoch", 10), ("partial-epoch", 14), ("summary", 14)]
    assert log[-1]["total_steps"] == 14 and method.schedule.total_steps == 14
    assert opt.param_groups[0]["lr"] == 0.0  # the cosine ends at the run's last step
    ups = [r["step"] for r in log if r["type"] == "update"]
    assert ups == [s for s in range(2, 14, 2) if s < method.schedule.end_frac * 14] and ups
    import plot  # the curves put the last, partial epoch at its fraction

    assert plot.epoch_positions(plot.load_run(a.out_dir)["epochs"]) == [1.0, 1.4]


@pytest.mark.parametrize("device", DEVICES)  # on CUDA in bf16; the CPU run keeps this test from rotting unseen
def test_training_run_moves_units(tmp_path, device):
    a = targs(tmp_path, device=device, max_steps=40)
    model, _, _ = train.main(a)
    log = read_log(a.out_dir)
    assert next(model.parameters()).device.type == device and a.bf16
    ups = [r for r in log if r["type"] == "update"]
    assert len(ups) == 4 and sum(r["moved"]["heads"] + r["moved"]["mlp"] for r in ups) > 0
    ep = log[-2]  # the epoch cut short by --max-steps; the last record is the run's summary
    assert ep["type"] == "partial-epoch" and log[-1]["type"] == "summary"
    assert math.isfinite(ep["train_loss"]) and ep["peak_mem_mb"] > 0
    assert ep["mem"] == ("cuda-allocator-peak" if device == "cuda" else "process-peak-rss")


@pytest.fixture
def counting_compile(monkeypatch):
    """torch.compile with a backend that runs dynamo's graphs as they are (fast, and the ops of eager
    mode), listing each graph it is handed; where dynamo would give up on a function and run it
    eagerly for good (its limit of graphs per function), fail instead. dynamo's own config.patch
    restores its settings (pytest's monkeypatch cannot: the config module keeps its keys elsewhere)."""
    compile, graphs = torch.compile, []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile(model, backend=backend, **kw))
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=torch._dynamo.config.recompile_limit):
        yield graphs


def test_compiled_run_stays_compiled_through_every_resize(tmp_path, counting_compile):
    graphs = counting_compile
    a = targs(tmp_path, compile=True, update_every=2, max_steps=40, churn=10.0)
    model, _, _ = train.main(a)
    shapes = {json.dumps(r["counts"]) for r in read_log(a.out_dir) if r["type"] == "update"}
    assert len(shapes) > torch._dynamo.config.recompile_limit  # more shapes than dynamo keeps graphs for
    assert len(graphs) >= len(shapes)  # each one compiled, none left to eager mode
    eager, _, _ = train.main(replace(a, compile=False, out_dir=str(tmp_path / "eager")))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager.parameters()))


@pytest.mark.parametrize("method", ["barter", "masked", "bidst"])
def test_resume_is_exact(tmp_path, method):
    whole = targs(tmp_path, method=method, max_steps=100, ema_decay=0.9, out_dir=str(tmp_path / "whole"))
    m1, _, _ = train.main(whole)
    part = targs(tmp_path, method=method, max_steps=45, ema_decay=0.9, out_dir=str(tmp_path / "part"))
    train.main(part)
    ck = torch.load(os.path.join(part.out_dir, "checkpoint.pt"), weights_only=True)
    if method == "barter":  # the checkpoint holds resized blocks, not the uniform start
        assert ck["heads"] != [2, 1, 1] or ck["mlp"] != [20, 19, 19]
    m2, _, _ = train.main(replace(part, max_steps=100, resume=os.path.join(part.out_dir, "checkpoint.pt")))
    assert m1.counts("heads") == m2.counts("heads") and m1.counts("mlp") == m2.counts("mlp")
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k
    e1, e2 = (torch.load(os.path.join(a.out_dir, "checkpoint.pt"), weights_only=True)["ema"] for a in (whole, part))
    assert e1.keys() == s1.keys() and all(torch.equal(e1[k], e2[k]) for k in e1)
    ups = [r["step"] for r in read_log(part.out_dir) if r["type"] == "update"]
    assert ups == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]


def test_checkpoints_from_before_budgets_and_masked_growth_were_named_resume(tmp_path):
    # --no-trade (recorded as trade: False) is --budgets separate now; masked recorded a --grow of its own,
    # which is no longer a choice: both resume
    a = targs(tmp_path, method="masked", max_steps=5, budgets="separate")
    train.main(a)
    path = os.path.join(a.out_dir, "checkpoint.pt")
    ck = torch.load(path, weights_only=True)
    assert ck["args"]["budgets"] == "separate" and ck["args"]["grow"] is None
    del ck["args"]["budgets"]
    ck["args"].update(trade=False, grow="gradient")
    torch.save(ck, path)
    train.main(replace(a, max_steps=8, resume=path))
    assert read_log(a.out_dir)[-1]["step"] == 8
    with pytest.raises(train.ArgError, match="--budgets 'separate' \\(now 'shared'\\)"):
        train.main(replace(a, max_steps=11, resume=path, budgets="shared"))


def test_run_records_its_environment_and_a_resume_under_another_says_so(tmp_path, capsys):
    # the same run on one CPU thread or two differs in the last digits: a resume under another thread
    # count must say it is not bit for bit, and the log must say what the run ran under
    a = targs(tmp_path, max_steps=5)
    train.main(a)
    start = read_log(a.out_dir)[0]
    ck = torch.load(os.path.join(a.out_dir, "checkpoint.pt"), weights_only=True)
    n = torch.get_num_threads()
    assert start["env"] == ck["env"] == {"device": platform.processor() or "cpu", "cpu_threads": n, "torch": torch.__version__}
    resume = replace(a, max_steps=8, resume=os.path.join(a.out_dir, "checkpoint.pt"))
    capsys.readouterr()
    train.main(resume)
    assert "not bit for bit" not in capsys.readouterr().out
    other = 1 if n > 1 else 2
    torch.set_num_threads(other)
    try:
        train.main(replace(resume, max_steps=11))
    finally:
        torch.set_num_threads(n)
    assert f"resumed with cpu_threads {other} (the run had {n}): it continues correctly, but not bit for bit" in capsys.readouterr().out
    del ck["env"]  # a checkpoint written before the record: resumed without a word
    torch.save(ck, tmp_path / "old.pt")
    capsys.readouterr()
    train.main(replace(resume, resume=str(tmp_path / "old.pt")))
    assert "resumed with" not in capsys.readouterr().out


def test_weight_baselines_update_after_the_warmup(tmp_path):
    # barter and masked update from the first interval; rigl's swaps wait for the end of the lr warmup
    # (78 steps an epoch here), then follow --update-every until --end-frac
    for method, first in (("rigl", [80, 90]), ("masked", [10, 20, 30, 40, 50, 60, 70, 80, 90])):
        a = targs(tmp_path, method=method, warmup_epochs=1, max_steps=90, out_dir=str(tmp_path / method))
        train.main(a)
        assert [r["step"] for r in read_log(a.out_dir) if r["type"] == "update"] == first


@pytest.mark.parametrize("change, message", [
    (dict(dense_frac=0.0), "dense-frac"), (dict(dense_frac=1.5), "dense-frac"), (dict(head_frac=-1.0), "head-frac"),
    (dict(epochs=0), "epochs"), (dict(epochs=0.001), "less than one step"), (dict(batch_size=-4), "batch-size"),
    (dict(update_every=0), "update-every"),
    (dict(max_steps=0), "max-steps"), (dict(model="deit-huge"), "model"), (dict(dense_frac=0.01), "no heads"),
    (dict(data="folder", data_dir="/nonexistent/imagenet"), "not a folder"),
    (dict(data="folder", data_dir="."), "needs train/ and val/"),
    (dict(data="cifar10", data_dir="/nonexistent/deep/data"), "not there"),
    (dict(lr=0.0), "--lr"), (dict(device="cuda:7"), "not available"), (dict(end_frac=0.0), "end-frac"),
    # a DST run whose schedule holds no update would silently be the static control
    (dict(end_frac=0.05), "never update"), (dict(method="rigl", update_every=10_000), "never update"),
    (dict(method="rigl", warmup_epochs=2), "never update.*lr warmup"),
    (dict(ema_decay=1.0), "ema-decay"),
    (dict(grow="gradient"), "not a way barter grows"),
])
def test_bad_arguments_fail_before_any_work(tmp_path, change, message):
    a = targs(tmp_path, **change)
    with pytest.raises(train.ArgError, match=message):
        train.main(a)
    assert not os.path.exists(a.out_dir)


def test_bad_resume_files(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    other = tmp_path / "other.pt"
    torch.save({"hello": 1}, other)
    for path, message in ((tmp_path / "missing.pt", "no such file"), (junk, "not a readable torch file"),
                          (other, "not a checkpoint of this project")):
        with pytest.raises(train.ArgError, match=message):
            train.main(targs(tmp_path, resume=str(path)))
    a = targs(tmp_path, max_steps=3)
    train.main(a)
    with pytest.raises(train.ArgError, match="holds a checkpoint already"):
        train.main(a)  # a fresh run never overwrites a checkpoint
    with pytest.raises(train.ArgError, match="--dense-frac 0.3"):
        train.main(replace(a, dense_frac=0.5, resume=os.path.join(a.out_dir, "checkpoint.pt")))


def test_cli_bad_value_exits_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--dense-frac", "2", "--data", "synthetic"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip() == "error: --dense-frac must be in (0, 1], got 2.0"


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--model", "micro", "--data", "synthetic", "--epochs", "500",
           "--batch-size", "64", "--device", "cpu", "--out-dir", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=REPO)
    deadline = time.time() + 120
    while not (out / "checkpoint.pt").exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)  # wait for the first epoch's checkpoint: training is under way
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    assert "interrupted: checkpoint at step" in stdout
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ck["step"] > 78  # later than the first epoch's checkpoint: saved on the signal


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    real, steps = train_step, []

    def poisoned(model, *args, **kw):
        loss = real(model, *args, **kw)
        steps.append(1)
        if len(steps) > 90:  # in the second epoch
            with torch.no_grad():
                model.head.weight.fill_(float("nan"))
        return loss

    monkeypatch.setattr(sys.modules["step"], "train_step", poisoned)
    a = targs(tmp_path, max_steps=150)
    with pytest.raises(SystemExit) as e:
        train.main(a)
    assert e.value.code == 1
    ck = torch.load(os.path.join(a.out_dir, "checkpoint.pt"), weights_only=True)
    assert ck["step"] == 78 and torch.isfinite(ck["model"]["head.weight"]).all()


def test_nonfinite_gradient_stops_before_a_checkpoint_holds_its_weights(tmp_path, monkeypatch, capsys):
    real, steps = train_step, []

    def poisoned(model, *args, **kw):  # step 156 ends epoch 2 (78 steps each), between two checks of the loss
        steps.append(1)
        if len(steps) != 156:
            return real(model, *args, **kw)
        hook = model.head.weight.register_hook(lambda g: g * float("inf"))  # this step's loss stays finite
        try:
            return real(model, *args, **kw)
        finally:
            hook.remove()

    monkeypatch.setattr(sys.modules["step"], "train_step", poisoned)
    a = targs(tmp_path, epochs=3)
    with pytest.raises(SystemExit) as e:
        train.main(a)
    assert e.value.code == 1 and len(steps) == 156
    assert "a gradient is not finite in epoch 2" in capsys.readouterr().err
    ck = torch.load(os.path.join(a.out_dir, "checkpoint.pt"), weights_only=True)
    assert ck["step"] == 78 and all(torch.isfinite(v).all() for v in ck["model"].values())


def test_synthetic_data_is_learnable_and_fixed_by_seed():
    tr, te, info = data.load("synthetic", "data", 50, "cpu")
    assert (info.in_chans, info.img_size, info.num_classes) == (3, 32, 10)
    x1, y1 = next(tr.epoch(3, 2))
    x2, y2 = next(tr.epoch(3, 2))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x3, _ = next(tr.epoch(4, 2))
    assert not torch.equal(x1, x3)
    # a resumed epoch sees the batches it would have seen; two ranks' shares make up one process's batch,
    # augmented alike (the epoch's draws are made up front, for whole batches)
    whole = list(tr.epoch(3))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(tr.epoch(3, 2), whole[2:]))
    ranks = [data.load("synthetic", "data", 50, "cpu", rank=r, world=2)[0] for r in (0, 1)]
    for k, (p0, p1) in enumerate(zip(ranks[0].epoch(3), ranks[1].epoch(3))):
        assert torch.equal(torch.cat([p0[0], p1[0]]), whole[k][0]) and torch.equal(torch.cat([p0[1], p1[1]]), whole[k][1])
    assert k == len(whole) - 1
    # a nearest-class-mean classifier on raw pixels is far above chance: the set is learnable
    (xtr, ytr), (xte, yte) = data.synthetic_set()
    means = torch.stack([xtr[ytr == c].float().mean(0) for c in range(10)]).flatten(1)
    pred = torch.cdist(xte.float().flatten(1), means).argmin(1)
    assert (pred == yte).float().mean() > 0.5


# ---- the step: no host sync inside, captured as one CUDA graph between topology updates ------------

STEP_METHODS = ["barter", "static", "masked", "rigl", "set", "bidst", "dense"]


def method_on_micro(method, device="cpu", update_every=8, steps=40, seed=0):
    m = micro(seed=seed, dtype=torch.float32).to(device)
    sched = Schedule(total_steps=steps, update_every=update_every, alpha0=0.3, end_frac=0.9)
    meth = train.make_method(method, m, sched, 0.3, seed=seed)
    meth.init_model()
    return m, meth


SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


def tripwire(monkeypatch):
    """Make every way a tensor's value reaches the host raise (what would stall a GPU step, and what a
    captured step cannot do)."""
    def boom(name):
        def f(*a, **k):
            raise AssertionError(f"Tensor.{name} inside the step: a host sync")
        return f
    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, boom(name))


@pytest.mark.parametrize("method", STEP_METHODS)
def test_the_step_makes_no_host_sync(method, monkeypatch):
    m, meth = method_on_micro(method)
    opt = make_optimizer(m, 1e-3, 0.05, fused=True)  # as on CUDA: the fused kernel, a tensor lr
    x, y = batch(16, dtype=torch.float32)
    step = Stepper(m, meth, opt, nullcontext(), clip=1.0, smoothing=0.1)
    step(x, y, 1)  # the optimizer state is made at the first step, as before a capture
    with monkeypatch.context() as mp:
        tripwire(mp)
        with pytest.raises(AssertionError, match="host sync"):  # the wire is live
            bool(torch.ones(()))
        set_lr(opt, 5e-4)
        losses = [train_step(m, m, meth, opt, x, y, nullcontext(), clip=clip, smoothing=0.1) for clip in (1.0, 0.0)]
    assert all(torch.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("method", ["barter", "masked"])
def test_statistics_buffers_keep_their_storage_and_equal_sums_by_hand(method):
    m, meth = method_on_micro(method, update_every=1000)
    opt = make_optimizer(m, 1e-3, 0.05)
    step = Stepper(m, meth, opt, nullcontext(), clip=1.0)
    where = [b.data_ptr() for k in ("heads", "mlp") for bufs in (meth.acc[k], meth.acc2[k]) for b in bufs]
    absum = {k: [torch.zeros(n, dtype=torch.float64) for n in m.counts(k)] for k in ("heads", "mlp")}
    sqsum = {k: [torch.zeros(n, dtype=torch.float64) for n in m.counts(k)] for k in ("heads", "mlp")}
    dense = {"heads": CFG.num_heads, "mlp": CFG.mlp_hidden}
    for t in range(1, 5):
        x, y = batch(16, seed=t, dtype=torch.float32)
        # by hand, from the same weights: t_u = sum over the unit's output-side columns of W * dL/dW
        ref = copy.deepcopy(m)
        F.cross_entropy(ref(x), y).backward()
        for i, blk in enumerate(ref.blocks):
            for kind, (mod, w) in {"heads": (blk.attn.proj, HD), "mlp": (blk.mlp.fc2, 1)}.items():
                W = leaf(mod, "weight")
                n = W.shape[1] // w
                for u in range(n):
                    cols = slice(u * w, (u + 1) * w)
                    s = float((W[:, cols].detach().double() * W.grad[:, cols].double()).sum())
                    absum[kind][i][u] += abs(s)
                    sqsum[kind][i][u] += s * s
        step(x, y, t)
    assert meth.nacc == 4
    assert [b.data_ptr() for k in ("heads", "mlp") for bufs in (meth.acc[k], meth.acc2[k]) for b in bufs] == where
    for kind in ("heads", "mlp"):
        for i in range(3):
            if method == "masked":  # full-size buffers: the masked units score exactly zero
                assert len(meth.acc[kind][i]) == dense[kind]
            torch.testing.assert_close(meth.acc[kind][i].double(), absum[kind][i], rtol=1e-4, atol=1e-9)
            torch.testing.assert_close(meth.acc2[kind][i].double(), sqsum[kind][i], rtol=1e-4, atol=1e-12)


def test_a_tensor_lr_gives_the_parameters_of_the_float_it_holds():
    lrs = [3e-3 * (t + 1) / 7 for t in range(6)]  # a warmup: the lr changes at every step
    runs = {}
    for form in ("tensor", "float"):
        m, meth = method_on_micro("barter")
        opt = make_optimizer(m, 1e-3, 0.05, fused=True)
        if form == "float":  # the same optimizer with a Python float, holding the float32 value the tensor holds
            for g in opt.param_groups:
                g["lr"] = float(g["lr"])
        step = Stepper(m, meth, opt, nullcontext(), clip=1.0)
        for t, lr in enumerate(lrs, 1):
            set_lr(opt, float(torch.tensor(lr)) if form == "float" else lr)
            step(*batch(16, seed=t, dtype=torch.float32), t)
        runs[form] = (m, opt)
    (a, opt), (b, _) = runs["tensor"], runs["float"]
    assert torch.is_tensor(opt.param_groups[0]["lr"]) and opt.param_groups[0]["lr"].dim() == 0
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # a checkpoint of the default CPU optimizer (float lr, no fused kernel) loads into this one and keeps
    # its tensor lr and kernel; and the other way round
    m2, _ = method_on_micro("barter")
    cpu = make_optimizer(m2, 1e-3, 0.05)
    load_optimizer(opt, cpu.state_dict())
    assert torch.is_tensor(opt.param_groups[0]["lr"]) and opt.param_groups[0]["fused"]
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-3)
    fresh = make_optimizer(a, 1e-3, 0.05)
    load_optimizer(fresh, opt.state_dict())
    assert not torch.is_tensor(fresh.param_groups[0]["lr"]) and not fresh.param_groups[0]["fused"]


def test_patch_linear_equals_the_convolution():
    g = torch.Generator().manual_seed(0)
    for C, p, size in ((3, 4, 32), (1, 7, 28), (3, 16, 64)):
        conv = torch.nn.Conv2d(C, 24, p, p).double()
        img = torch.randn(5, C, size, size, generator=g, dtype=torch.float64)
        ref = conv(img).flatten(2).transpose(1, 2)  # (B, N, D), tokens in row-major patch order
        out = vit.patch_linear(img, conv)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        gr = torch.autograd.grad(ref.square().sum(), conv.weight)[0]
        go = torch.autograd.grad(out.square().sum(), conv.weight)[0]
        torch.testing.assert_close(go, gr, rtol=1e-12, atol=1e-12)


class StandInGraph:
    """Graph's interface on the CPU: capture keeps the function without running it, replay runs it,
    release forgets it (a replay after a release fails, as a freed graph must not run)."""

    def __init__(self, model):
        self.model, self.fn, self.captured_at, self.replays = model, None, [], 0
        self.side_stream = nullcontext

    def capture(self, fn):
        self.fn = fn
        self.captured_at.append([tuple(p.shape) for p in self.model.parameters()])

    def replay(self):
        self.replays += 1
        return self.fn()

    def release(self):
        self.fn = None


@pytest.mark.parametrize("method", STEP_METHODS)
def test_capture_once_per_topology_and_update_steps_eager(method):
    steps, every = 36, 8  # updates at 8, 16, 24, 32 (end_frac 0.9)
    runs = {}
    for mode in ("eager", "graph"):
        m, meth = method_on_micro(method, update_every=every, steps=steps)
        opt = make_optimizer(m, 2e-3, 0.05)
        graph = StandInGraph(m) if mode == "graph" else None
        step = Stepper(m, meth, opt, nullcontext(), clip=1.0, graph=graph)
        eager, recs = [], []
        for t in range(1, steps + 1):
            before = graph.replays if graph else 0
            loss, rec = step(*batch(16, seed=t, dtype=torch.float32), t)
            eager.append(graph is None or graph.replays == before)
            recs += [rec["counts"]] if rec else []
        runs[mode] = (m, meth, graph, eager, recs, step)
    (me, _, _, _, re, _), (mg, meth, graph, eager, rg, step) = runs["eager"], runs["graph"]
    updates = [t for t in range(1, steps + 1) if meth.updates_at(t)]
    assert re == rg and len(rg) == len(updates) == (0 if method in ("static", "dense") else 4)  # the same decisions
    assert all(torch.equal(p, q) for p, q in zip(me.parameters(), mg.parameters()))
    W = Stepper.WARMUP
    # eager: every update step, and the warm-up steps at the start and after each update; the rest replayed
    expect = set(updates) | {u + k for u in [0] + updates for k in range(1, W + 1)}
    assert {t for t, e in enumerate(eager, 1) if e} == expect
    assert step.captures == len(graph.captured_at) == len(updates) + 1  # once per topology
    if method == "barter":  # the graph was captured on the shapes of its interval
        assert len({tuple(s) for s in graph.captured_at}) > 1


def test_a_batch_of_another_shape_is_captured_anew():
    m, meth = method_on_micro("barter", update_every=1000)
    graph = StandInGraph(m)
    step = Stepper(m, meth, make_optimizer(m, 1e-3, 0.05), nullcontext(), graph=graph)
    sizes = [16] * 5 + [8] * 5
    for t, n in enumerate(sizes, 1):
        step(*batch(n, seed=t, dtype=torch.float32), t)
    # each shape: 2 eager warm-up steps, then a capture and 3 replays (the capture step's included)
    assert step.captures == 2 and graph.replays == 6 and Stepper.WARMUP == 2
    assert meth.nacc == len(sizes)


class FakeCuda:
    """The pieces of torch.cuda that step.Graph uses, on the CPU: each records the device that was current
    when it was made or used. warn: what every capture warns on its way out (as torch does for a graph that
    recorded nothing)."""

    def __init__(self, monkeypatch, warn=None):
        self.current, self.made, self.captures = 0, [], []
        fake = self

        @contextmanager
        def device(d):
            prev = fake.current
            fake.current = torch.device(d).index if torch.device(d).index is not None else prev
            try:
                yield
            finally:
                fake.current = prev

        class Made:
            def __init__(self, kind):
                self.kind, self.device, self.id = kind, fake.current, (0, len(fake.made) + 1)
                fake.made.append((kind, fake.current))

            def wait_stream(self, other):
                pass

        @contextmanager
        def graph(g, pool=None, stream=None, capture_error_mode="global"):
            fake.captures.append(dict(graph=g, pool=pool, stream=stream, mode=capture_error_mode, device=fake.current,
                                      collecting=gc.isenabled()))
            yield
            if warn:
                warnings.warn(warn)

        for name, value in dict(device=device, graph=graph, MemPool=lambda: Made("pool"), Stream=lambda: Made("stream"),
                                CUDAGraph=lambda: Made("graph"), current_stream=lambda: Made("current"),
                                stream=lambda s: device(s.device), set_device=lambda d: fake.made.append(("set", d))).items():
            monkeypatch.setattr(torch.cuda, name, value)


def test_graph_belongs_to_the_model_device_and_keeps_one_pool(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    g = Graph(torch.device("cuda", 1))  # the model on cuda:1, the current device cuda:0
    assert cuda.made == [("pool", 1), ("stream", 1)] and cuda.current == 0
    with g.side_stream():  # the warm-up steps
        assert cuda.current == 1
    for k in range(3):  # a capture after each update: one pool, one stream, a new graph, all on cuda:1
        g.capture(lambda: torch.tensor(k))
        assert int(g.out) == k  # the function ran inside the capture, its output kept
        g.release()
    assert [c["device"] for c in cuda.captures] == [1, 1, 1] and cuda.current == 0
    assert all(c["pool"] == g.pool.id and c["stream"] is g.stream for c in cuda.captures)
    assert all(c["mode"] == "thread_local" for c in cuda.captures)  # a pin-memory thread may call CUDA meanwhile
    assert not any(c["collecting"] for c in cuda.captures) and gc.isenabled()  # no garbage collection in a capture
    assert len({id(c["graph"]) for c in cuda.captures}) == 3


def test_an_empty_capture_is_an_error_and_other_warnings_pass(monkeypatch):
    FakeCuda(monkeypatch, warn="The CUDA Graph is empty. This usually means that the graph was attempted to be "
                               "captured on wrong device or stream.")
    g = Graph(torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="recorded no kernel on cuda:0"):
        g.capture(lambda: None)
    assert g.graph is None and g.out is None
    FakeCuda(monkeypatch, warn="something else")
    with pytest.warns(UserWarning, match="something else"):
        Graph(torch.device("cuda", 0)).capture(lambda: None)


@pytest.mark.parametrize("name, sets", [("cuda:1", "cuda:1"), ("cuda", None), ("cpu", None)])
def test_an_indexed_cuda_device_becomes_the_current_one(monkeypatch, name, sets):
    cuda = FakeCuda(monkeypatch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert Ranks(name).device == torch.device(name)
    assert cuda.made == ([("set", torch.device(sets))] if sets else [])


def test_graph_capture_without_a_gpu_is_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--cuda-graph", "--data", "synthetic", "--model", "micro",
                        "--device", "cpu", "--out-dir", str(tmp_path / "run")], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--cuda-graph needs a CUDA device" in r.stderr
    assert not (tmp_path / "run").exists()


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (.ci/gpu runs these)")


@pytest.fixture
def exact_attention():
    """Attention by its math kernel on CUDA: the fused kernels' backward adds with atomics in an order that
    changes from run to run, so two runs that should agree would differ in their last bits, grown by every step."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


@cuda_only
@pytest.mark.filterwarnings("error:.*CUDA [Gg]raph:UserWarning")
@pytest.mark.parametrize("method", STEP_METHODS)
def test_cuda_every_method_captured_equals_eager(method, exact_attention):
    """Each method's step replayed from a CUDA graph for 60 steps over two updates (24 and 48) against the eager
    step: the same topology decisions and weights. bidst draws its noise from CUDA's generator, which a graph
    advances otherwise than eager steps do: its loss curve alike, its weights not compared."""
    steps, runs = 60, {}
    for graph in (False, True):
        m, meth = method_on_micro(method, device="cuda", update_every=24, steps=steps)
        step = Stepper(m, meth, make_optimizer(m, 2e-3, 0.05), nullcontext(), clip=1.0,
                       graph=Graph(torch.device("cuda")) if graph else None)
        torch.cuda.manual_seed(0)
        losses, recs = [], []
        for t in range(1, steps + 1):
            loss, rec = step(*(v.cuda() for v in batch(16, seed=t, dtype=torch.float32)), t)
            losses.append(float(loss))
            recs += [rec["counts"]] if rec else []
        runs[graph] = (m, losses, recs, step)
    (me, le, re, _), (mg, lg, rg, sg) = runs[False], runs[True]
    assert len(re) == len(rg) == (0 if method in ("static", "dense") else 2) and sg.captures == len(re) + 1
    assert all(math.isfinite(v) for v in lg) and len(set(lg)) > steps // 2  # every replay a step of its own
    if method == "bidst":
        tail = statistics.mean(le[-10:])
        assert abs(statistics.mean(lg[-10:]) - tail) < 0.1 * tail, (le[-10:], lg[-10:])
    else:
        assert re == rg
        for p, q in zip(me.parameters(), mg.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)


@cuda_only
def test_cuda_an_empty_capture_is_an_error():
    with pytest.raises(RuntimeError, match="recorded no kernel"):
        Graph(torch.device("cuda")).capture(lambda: None)


@cuda_only
def test_cuda_graph_trains_from_an_image_folder(tmp_path, exact_attention):
    """The DataLoader's pin-memory thread calls CUDA while the step is captured: the capture forbids unsafe
    calls in its own thread only, and the run repeats the eager one."""
    a = targs(tmp_path, data="folder", data_dir=image_folder(tmp_path / "imgs"), batch_size=4, workers=2, epochs=2,
              update_every=6, device="cuda", bf16=False)  # 9 steps an epoch, updates at 6 and 12
    eager, _, _ = train.main(a)
    graph, _, _ = train.main(replace(a, cuda_graph=True, out_dir=str(tmp_path / "graph")))
    ups = lambda d: [r["counts"] for r in read_log(d) if r["type"] == "update"]
    assert len(ups(a.out_dir)) == 2 and ups(str(tmp_path / "graph")) == ups(a.out_dir)
    for p, q in zip(eager.parameters(), graph.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)


@cuda_only
def test_cuda_graph_run_resumed_mid_epoch_equals_one_never_stopped(tmp_path, exact_attention):
    whole = targs(tmp_path, device="cuda", bf16=False, cuda_graph=True, max_steps=100, out_dir=str(tmp_path / "whole"))
    m1, _, _ = train.main(whole)
    part = replace(whole, max_steps=45, out_dir=str(tmp_path / "part"))  # 78 steps an epoch: stopped mid-epoch
    train.main(part)
    m2, _, _ = train.main(replace(part, max_steps=100, resume=os.path.join(part.out_dir, "checkpoint.pt")))
    assert m1.counts("heads") == m2.counts("heads") and m1.counts("mlp") == m2.counts("mlp")
    for (k, p), q in zip(m1.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=k)


@cuda_only
def test_cuda_prepared_folder_batches_equal_the_cpu_ones(tmp_path):
    """On CUDA the batches come through pinned buffers, a copy stream and events: the same batches."""
    out = str(tmp_path / "out")
    head = data.prepare(image_folder(tmp_path / "imgs"), out, 20, workers=0)
    batches = {dev: list(data.PreparedLoader(out, head, "train", 16, 8, True, seed=3, device=dev).epoch(1)) for dev in ("cpu", "cuda")}
    assert len(batches["cuda"]) == len(batches["cpu"]) == 4
    for (x, y), (cx, cy) in zip(batches["cpu"], batches["cuda"]):
        assert torch.equal(cy.cpu(), y)
        torch.testing.assert_close(cx.cpu(), x, rtol=1e-5, atol=1e-4)


@cuda_only
def test_cuda_captured_run_equals_the_eager_run(tmp_path, exact_attention):
    a = targs(tmp_path, device="cuda", bf16=False, max_steps=36, update_every=10, dense_frac=0.1)
    eager, _, _ = train.main(a)
    graph, _, _ = train.main(replace(a, cuda_graph=True, out_dir=str(tmp_path / "graph")))
    ups = lambda d: [r["counts"] for r in read_log(d) if r["type"] == "update"]
    assert len(ups(a.out_dir)) == 3 and ups(a.out_dir) == ups(str(tmp_path / "graph"))
    for p, q in zip(eager.parameters(), graph.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


@cuda_only
def test_cuda_reserved_memory_stays_flat_over_captures():
    torch.manual_seed(0)
    m = ViT(PRESETS["cifar-tiny"]).cuda()
    meth = train.make_method("barter", m, Schedule(total_steps=60, update_every=6, end_frac=1.0), 0.1)
    meth.init_model()
    step = Stepper(m, meth, make_optimizer(m, 1e-3, 0.05), autocast(torch.device("cuda"), True),
                   clip=1.0, graph=Graph(torch.device("cuda")))
    x, y = torch.randn(32, 3, 32, 32, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    reserved, kept = [], None
    for t in range(1, 37):
        before = step.captures
        loss, _ = step(x, y, t)
        kept = loss if kept is None and step.captures else kept  # a replayed loss, held past every later capture
        if step.captures > before:
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
    assert len(reserved) >= 5
    assert max(reserved[1:]) <= reserved[1] * 1.05 + 2**21, [r / 2**20 for r in reserved]


@cuda_only
def test_cuda_step_is_clean_under_sync_debug_mode():
    m, meth = method_on_micro("barter", device="cuda", update_every=1000)
    opt = make_optimizer(m, 1e-3, 0.05)
    step = Stepper(m, meth, opt, autocast(torch.device("cuda"), True), clip=1.0, graph=Graph(torch.device("cuda")))
    x, y = (t.cuda() for t in batch(16, dtype=torch.float32))
    for t in range(1, Stepper.WARMUP + 2):  # warm-up, then the capture
        step(x, y, t)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        set_lr(opt, 5e-4)
        step(x, y, Stepper.WARMUP + 2)  # a replay
        train_step(m, m, meth, opt, x, y, autocast(torch.device("cuda"), True), clip=1.0)  # eager
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert step.captures == 1 and meth.nacc == Stepper.WARMUP + 2


# ---- issue 5: bench.py -------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_bench_smoke_writes_every_field(tmp_path, device):
    import bench

    out = tmp_path / "bench.json"
    modes = (False, True) if device == "cuda" else (False,)  # eager and captured steps, interleaved
    res = bench.main(bench.Args(models=("micro",), densities=(0.3,), steps=1, rounds=2, warmup=1,
                                device=device, profile=True, cuda_graph=modes, out=str(out)))
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(res["rows"])) and saved["machine"]["cuda_graph"] == list(modes)
    assert {r["method"] for r in saved["rows"]} == {"dense", "masked", "rigl", "barter"} and len(saved["rows"]) == 4 * len(modes)
    common = {"model", "method", "density", "cuda_graph", "batch_size", "step_ms", "step_ms_min", "step_ms_max",
              "img_per_s", "flops_per_img", "density_measured", "peak_mem_mb", "act_mb_per_img", "act_by_op"}
    if device == "cuda":  # what the host launched per step (and, where the profiler sees them, kernels and GPU time)
        common |= {"launches_per_step"}
    for r in saved["rows"]:
        assert common <= set(r), common - set(r)
        assert r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"] and r["peak_mem_mb"] > 0
        if r["method"] != "dense":
            assert {"speedup_vs_masked", "ideal_speedup", "mem_vs_masked"} <= set(r)
        if device == "cuda" and not r["cuda_graph"]:
            assert r["kernels_per_step"] > 10 and r["gpu_busy_ms"] > 0 and r["launches_per_step"] > 10
        if r["cuda_graph"]:  # a replay is one launch; its update cost counts the capture again
            assert r["launches_per_step"] <= 2 and "speedup_vs_eager_masked" in r
            assert r["method"] != "barter" or r["capture_ms"] >= 0
        else:
            assert "capture_ms" not in r
    barter = next(r for r in saved["rows"] if r["method"] == "barter")
    assert 0 < barter["update_share"] < 1 and barter["update_ms"] > 0
    # the ideal speedup is computed from the actual unit counts (4 heads, 58 channels at d = 0.3)
    c = PRESETS["micro"]
    n = (32 // 8) ** 2 + 1
    def flops(heads, mlp):
        return (n * c.dim * 3 * 64 + c.dim * 10 + heads * (n * c.dim * 4 * HD + 2 * n * n * HD) + mlp * 2 * n * c.dim)
    assert barter["ideal_speedup"] == pytest.approx(flops(12, 192) / flops(4, 58))
    assert "| micro | barter | 0.3 |" in bench.table(saved)
    assert "micro, density 0.3: MB per image that autograd keeps for backward" in bench.table(saved)
    assert [p.split(",")[0] for p in saved["profiles"]] == [f"micro {m}{' (graph)' if g else ''} d=0.3"
                                                           for m in ("masked", "barter") for g in modes]
    assert all("aten::" in p for p in saved["profiles"])
    plot = pytest.importorskip("plot")  # the bench figure, with the memory panel drawn (the GPU machines lack tyro)

    shape, colours = decoded(plot.main(plot.Args(paths=(str(out),), out=str(tmp_path / "bench.png"))))
    assert shape == (int(3.8 * 80), 11 * 80, 3) and colours > 20


def test_bench_times_the_loaders_beside_the_step(tmp_path, monkeypatch, capsys):
    import bench

    monkeypatch.setattr(bench, "LOADER_IMAGES", 24)
    res = bench.main(bench.Args(models=("micro",), batch_size=8, densities=(0.3,), steps=1, rounds=1, warmup=1,
                                loaders=True, out=str(tmp_path / "loaders.json")))
    assert json.loads((tmp_path / "loaders.json").read_text())["rows"] == res["rows"]
    assert [r["pipeline"] for r in res["rows"]] == ["pil", "gather", "augment"] and res["img_size"] == 32
    for r in res["rows"]:
        assert r["img_per_s_per_core"] > 0
        assert r["cores_to_feed_step"] == pytest.approx(res["step_img_per_s"] / r["img_per_s_per_core"])
    assert "Host work per image" in capsys.readouterr().out


def test_bench_keeps_every_configuration_compiled(tmp_path, counting_compile):
    import bench

    graphs, limit = counting_compile, torch._dynamo.config.recompile_limit
    res = bench.main(bench.Args(models=("micro",), densities=(0.1, 0.3, 0.5, 0.7), compile=True, memory=False,
                                steps=1, rounds=1, warmup=1, batch_size=4, out=str(tmp_path / "bench.json")))
    assert len(res["rows"]) == 13 > limit  # dense once, 3 methods x 4 densities: more than dynamo keeps
    assert len(graphs) >= len(res["rows"])


def test_activation_count_matches_saved_tensor_hooks():
    # bench walks the autograd graph and names the op behind each saved tensor; the saved-tensor hooks
    # see every tensor saved, without names. Both must count the same bytes per image.
    import bench

    def hooked(c, n):
        params, kept = {p.untyped_storage().data_ptr() for p in c.model.parameters()}, {}
        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            F.cross_entropy(c.model(c.x[:n]), c.y[:n])
        return sum(kept.values())

    for method in ("masked", "barter"):
        c = bench.Config("micro", method, 0.3, 6, torch.device("cpu"), False, False)
        by_op = bench.activation_mb(c)
        assert sum(by_op.values()) == pytest.approx((hooked(c, 6) - hooked(c, 1)) / 5 / 2**20, rel=1e-9)
        assert {"Addmm", "Gelu"} <= set(by_op), by_op


def test_converts_vit_b_16_layout():
    from torchvision.models import vit_b_16

    torch.manual_seed(0)
    tv = vit_b_16(weights=None).eval()  # the real architecture, random weights: no download
    with torch.no_grad():  # torchvision initialises the head at zero: logits would all be 0
        tv.heads.head.weight.normal_(0, 0.05)
        tv.heads.head.bias.normal_(0, 0.05)
    ours = from_torchvision(tv).eval()
    assert ours.cfg.dim == 768 and ours.cfg.depth == 12 and ours.cfg.num_heads == 12 and ours.cfg.mlp_hidden == 3072
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        ref = tv(x)
        assert ref.std() > 0.1
        torch.testing.assert_close(ours(x), ref, rtol=1e-4, atol=1e-4)


def test_failed_download_names_the_folder_and_the_offline_option(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    def offline(*a, **kw):
        raise OSError("network unreachable")

    monkeypatch.setattr(tvd, "CIFAR10", offline)
    with pytest.raises(data.DataError, match="--data synthetic") as e:
        data.load("cifar10", str(tmp_path / "cifar"), 32, "cpu")
    assert str(tmp_path / "cifar") in str(e.value)


def image_folder(root):
    """An ImageNet-layout folder of random 40x48 PNGs: 3 classes, 12 training and 4 validation images each."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 12), ("val", 4)):
        for c in ("cat", "dog", "eel"):
            os.makedirs(root / split / c)
            for k in range(n):
                px = (torch.rand(40, 48, 3, generator=g) * 255).to(torch.uint8).numpy()
                Image.fromarray(px).save(root / split / c / f"{k}.png")
    return str(root)


def test_image_folder_trains_through_main(tmp_path):
    image_folder(tmp_path / "imgs")
    tr, te, info = data.load("folder", str(tmp_path / "imgs"), 8, "cpu", img_size=32, workers=0)
    assert (info.in_chans, info.img_size, info.num_classes) == (3, 32, 3) and len(tr) == 4 and len(te) == 2
    x, y = next(tr.epoch(0))
    assert x.shape == (8, 3, 32, 32) and y.shape == (8,)
    a = targs(tmp_path, data="folder", data_dir=str(tmp_path / "imgs"), batch_size=8, workers=1, epochs=1, update_every=2)
    model, _, _ = train.main(a)
    assert model.head.out_features == 3
    assert [r["type"] for r in read_log(a.out_dir)] == ["start", "update", "epoch", "summary"]  # 4 steps, an update at 2


def test_image_folder_resumes_mid_epoch_with_the_same_augmented_batches(tmp_path):
    root = image_folder(tmp_path / "imgs")
    whole = list(data.FolderLoader(root, 32, 8, True, seed=0, workers=0).epoch(1))
    assert len(whole) == 4  # 36 images, batches of 8, the last partial one dropped
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    for workers in (0, 2):  # the resumed part, with or without worker processes
        rest = list(data.FolderLoader(root, 32, 8, True, seed=0, workers=workers).epoch(1, start=2))
        assert len(rest) == 2
        for (x, y), (wx, wy) in zip(rest, whole[2:]):
            assert torch.equal(x, wx) and torch.equal(y, wy), workers
    assert torch.equal(torch.get_rng_state(), rng)  # loading left the caller's RNG alone
    # the augmentation is random all the same: the same images get other crops in another epoch
    other = list(data.FolderLoader(root, 32, 8, True, seed=0, workers=0).epoch(2))
    first = torch.cat([x for x, _ in whole]).flatten(1)
    assert not any(torch.equal(a, b) for a in first for b in torch.cat([x for x, _ in other]).flatten(1))


# ---- issue 85: an image folder prepared once, read through a memory map, augmented on the device ------

def awkward_folder(root):
    """An image folder with what ImageNet holds: a grey JPEG, a CMYK JPEG, a PNG named .JPEG, a truncated
    JPEG, and a class with a single image; sizes that are neither square nor alike."""
    from PIL import Image

    g = torch.Generator().manual_seed(5)
    img = lambda h, w: Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())
    for d in ("train/ant", "train/bee", "val/ant", "val/bee"):
        os.makedirs(root / d)
    img(30, 40).convert("L").save(root / "train/ant/grey.JPEG", "JPEG")
    img(50, 36).convert("CMYK").save(root / "train/ant/cmyk.JPEG", "JPEG")
    img(24, 24).save(root / "train/ant/png.JPEG", "PNG")
    img(41, 33).save(root / "train/ant/ok.jpg", "JPEG")
    img(40, 40).save(root / "train/ant/zz-truncated.JPEG", "JPEG")
    with open(root / "train/ant/zz-truncated.JPEG", "r+b") as f:
        f.truncate(200)
    img(35, 45).save(root / "train/bee/only.png")
    img(20, 28).save(root / "val/ant/a.png")
    img(28, 20).save(root / "val/bee/b.jpg", "JPEG")
    return str(root)


def pil_square(path, S):
    """The reference, written out with PIL alone: RGB, short side to S (bilinear), the centre S x S."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        w2, h2 = (S, int(S * h / w)) if w <= h else (int(S * w / h), S)
        im = im.resize((w2, h2), Image.BILINEAR)
        top, left = int(round((h2 - S) / 2)), int(round((w2 - S) / 2))
        return torch.frombuffer(bytearray(im.crop((left, top, left + S, top + S)).tobytes()), dtype=torch.uint8).view(S, S, 3)


def test_prepare_converts_as_pil_does_and_lists_what_it_cannot_read(tmp_path, capsys):
    src = awkward_folder(tmp_path / "src")
    head = data.prepare(src, str(tmp_path / "out"), 16, workers=2)
    assert head["classes"] == ["ant", "bee"] and head["counts"] == {"train": 6, "val": 2} and head["size"] == 16
    assert "1 files could not be read" in capsys.readouterr().out
    (bad,) = head["unreadable"]["train"]
    assert bad["file"] == os.path.join("train", "ant", "zz-truncated.JPEG") and bad["error"] and not head["unreadable"]["val"]
    tr = data.PreparedLoader(str(tmp_path / "out"), head, "train", 16, 2, True)
    assert tr.keep.tolist() == [i for i in range(6) if i != bad["index"]]  # left out of every epoch
    for split in ("train", "val"):
        files = data.listing(src, split, head["classes"])
        ld = data.PreparedLoader(str(tmp_path / "out"), head, split, 16, 2, split == "train")
        assert ld.y.tolist() == [label for _, label in files] == sorted(ld.y.tolist())
        for i in ld.keep.tolist():
            assert torch.equal(ld.x[i], pil_square(os.path.join(src, files[i][0]), 16)), files[i]
    assert data.prepare(src, str(tmp_path / "out"), 16)["counts"] == head["counts"]  # done: nothing to do again


def test_prepare_continues_after_an_interruption(tmp_path, monkeypatch):
    src = awkward_folder(tmp_path / "src")
    whole = data.prepare(src, str(tmp_path / "whole"), 12, workers=0)
    monkeypatch.setattr(data, "CHUNK", 2)  # 3 + 1 chunks
    real, calls = data.convert_chunk, []

    def interrupted(task):
        calls.append(task[1:3])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(data, "convert_chunk", interrupted)
    out = str(tmp_path / "out")
    with pytest.raises(data.DataError, match="interrupted .* run the same command again"):
        data.prepare(src, out, 12, workers=0)
    assert not os.path.exists(os.path.join(out, data.HEADER)) and "has not finished" in data.folder_problem(out)
    monkeypatch.setattr(data, "convert_chunk", real)
    head = data.prepare(src, out, 12, workers=0)
    assert head["unreadable"] == whole["unreadable"] and not os.path.exists(os.path.join(out, data.PROGRESS))
    for f in ("train.u8", "train.labels", "val.u8", "val.labels"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "whole" / f).read_bytes(), f
    with pytest.raises(data.DataError, match="another preparation"):
        data.prepare(src, out, 8, workers=0)


def test_prepare_refuses_bad_sources_in_one_line(tmp_path):
    (tmp_path / "none").mkdir()
    os.makedirs(tmp_path / "empty/train/ant")
    os.makedirs(tmp_path / "empty/val")
    os.makedirs(tmp_path / "noclass/train")
    os.makedirs(tmp_path / "noclass/val")
    awkward_folder(tmp_path / "extra")
    os.makedirs(tmp_path / "extra/val/cat")
    for src, message in (("none", "needs train/ and val/"), ("empty", "train/ holds no image file"),
                         ("noclass", "train/ has no class folders"), ("extra", "val/ has classes train/ lacks: cat")):
        with pytest.raises(data.DataError, match=message):
            data.prepare(str(tmp_path / src), str(tmp_path / "out"), 16, workers=0)
    good = awkward_folder(tmp_path / "good")
    (tmp_path / "file").write_text("")
    for out, size, workers, message in (("file", 16, 0, "is a file, not a folder"), ("file/sub", 16, 0, "cannot be made"),
                                        ("o", 16, -1, "--workers at least 0"), ("o", 0, 0, "--size must be positive")):
        with pytest.raises(data.DataError, match=message):
            data.prepare(good, str(tmp_path / out), size, workers=workers)
    r = subprocess.run([sys.executable, "data.py", "--src", str(tmp_path / "none"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "needs train/ and val/" in r.stderr


def test_batched_crop_equals_torchvision_resized_crop():
    import torchvision.transforms.v2.functional as TF2

    g = torch.Generator().manual_seed(0)
    x = torch.rand(7, 3, 20, 24, generator=g, dtype=torch.float64)
    # boxes: enlarged (the prepared path's case), at the edges, the whole image, shrunk; flipped or not
    boxes = torch.tensor([[0, 0, 5, 7, 0], [15, 17, 5, 7, 1], [3, 2, 11, 9, 1], [0, 0, 20, 24, 0], [4, 6, 1, 1, 0],
                          [2, 1, 18, 22, 1], [7, 3, 9, 16, 0]], dtype=torch.float64)
    for out in (16, 9):
        got = data.crop_resize(x, boxes, out)
        for img, (t, l, h, w, f), o in zip(x, boxes.tolist(), got):
            ref = TF2.resized_crop(img, int(t), int(l), int(h), int(w), [out, out], antialias=False)
            torch.testing.assert_close(o, TF2.horizontal_flip(ref) if f else ref, rtol=0, atol=1e-12)
    flipped = data.crop_resize(x, torch.cat([boxes[:, :4], 1 - boxes[:, 4:]], 1), 16)
    assert torch.equal(flipped, data.crop_resize(x, boxes, 16).flip(-1))  # a flip mirrors exactly


def test_random_boxes_are_random_resized_crops():
    b = data.random_boxes(4000, 40, torch.Generator().manual_seed(1))
    top, left, h, w, flip = b.unbind(1)
    assert torch.equal(b, data.random_boxes(4000, 40, torch.Generator().manual_seed(1)))  # a function of the seed
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 40).all() and (left + w <= 40).all()
    assert (h >= 1).all() and (w >= 1).all() and (b == b.round()).all()
    frac, aspect = h * w / 1600, w / h
    assert frac.min() > 0.06 and frac.max() <= 1 and aspect.min() > 0.7 and aspect.max() < 1.45  # rounding's slack
    assert 0.45 < flip.mean() < 0.55 and 0.4 < frac.mean() < 0.7  # uniform area fraction in [0.08, 1]: mean 0.54


def test_prepared_folder_batches_resume_and_split_over_ranks(tmp_path):
    out = str(tmp_path / "out")
    head = data.prepare(image_folder(tmp_path / "imgs"), out, 20, workers=0)
    make = lambda **kw: data.PreparedLoader(out, head, "train", 16, 8, True, seed=3, **kw)
    whole = list(make().epoch(1))
    assert len(whole) == 4 and all(x.shape == (8, 3, 16, 16) for x, _ in whole)
    rest = list(make().epoch(1, start=2))
    assert all(torch.equal(x, wx) and torch.equal(y, wy) for (x, y), (wx, wy) in zip(rest, whole[2:])) and len(rest) == 2
    shares = [list(make(rank=r, world=2).epoch(1)) for r in (0, 1)]
    for (x0, y0), (x1, y1), (x, y) in zip(*shares, whole):  # disjoint halves that make up each batch
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y) and len(y0) == len(y1) == 4
    other = list(make().epoch(2))
    assert not torch.equal(torch.cat([x for x, _ in other]), torch.cat([x for x, _ in whole]))
    # evaluation: every image once, the PIL path's centre crop, normalised with ImageNet's statistics
    val = data.PreparedLoader(out, head, "val", 16, 5, False)
    xs, ys = zip(*val.epoch(0))
    assert [len(y) for y in ys] == [5, 5, 2] and torch.cat(ys).tolist() == val.y.tolist()
    raw = val.x.permute(0, 3, 1, 2).double() / 255
    c, t = round(20 * 7 / 8), int(round((20 - round(20 * 7 / 8)) / 2))
    import torchvision.transforms.v2.functional as TF2
    ref = TF2.normalize(TF2.resized_crop(raw, t, t, c, c, [16, 16], antialias=False), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    torch.testing.assert_close(torch.cat(xs).double(), ref, rtol=0, atol=1e-5)


def test_prepared_folder_trains_through_main(tmp_path, capsys):
    out = str(tmp_path / "out")
    data.prepare(image_folder(tmp_path / "imgs"), out, 24, workers=0)
    data.load("folder", out, 8, "cpu", img_size=16)
    assert "24 px images, more than --img-size 16" in capsys.readouterr().out
    a = targs(tmp_path, data="folder", data_dir=out, batch_size=8, epochs=2, update_every=2, img_size=32)
    model, _, _ = train.main(a)
    assert "more than --img-size" not in capsys.readouterr().out
    log = read_log(a.out_dir)
    ep = [r for r in log if r["type"] == "epoch"]
    assert model.head.out_features == 3 and len(ep) == 2 and all(0 <= r["data_wait"] < 1 for r in ep)
    os.remove(os.path.join(out, data.HEADER))
    (tmp_path / "out" / data.PROGRESS).write_text("{}")
    with pytest.raises(train.ArgError, match="has not finished"):
        train.validate(replace(a, out_dir=str(tmp_path / "again")))


# ---- issue 9: static control, Fashion-MNIST offline, no flipped digits, study.py -------------------

def write_idx(path, t):
    """A gzipped IDX file of uint8 `t`, as the MNIST release and Debian's package ship them."""
    import gzip

    head = bytes([0, 0, 8, t.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in t.shape)
    with gzip.open(path, "wb") as f:
        f.write(head + t.numpy().tobytes())


def debian_like_folder(path, n_train=40, n_test=12):
    g = torch.Generator().manual_seed(3)
    os.makedirs(path)
    sets = {}
    for train_split, n in ((True, n_train), (False, n_test)):
        x = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
        y = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
        for name, t in zip(data.IDX_FILES[train_split], (x, y)):
            write_idx(os.path.join(path, name), t)
        sets[train_split] = (x, y)
    return sets


def test_fashion_mnist_is_found_where_the_debian_package_puts_it(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    sets = debian_like_folder(tmp_path / "fashion-mnist")
    monkeypatch.setattr(data, "PACKAGED", {"fashion-mnist": (str(tmp_path / "fashion-mnist"), "dataset-fashion-mnist")})

    def no_download(root, train, download):  # what torchvision does offline when the files are not in root
        raise (RuntimeError("Dataset not found") if not download else AssertionError("tried to download"))

    monkeypatch.setattr(tvd, "FashionMNIST", no_download)
    tr, te, info = data.load("fashion-mnist", str(tmp_path / "empty"), 8, "cpu", img_size=28)
    assert (info.in_chans, info.img_size, info.num_classes) == (1, 28, int(sets[True][1].max()) + 1)
    assert torch.equal(tr.x[:, 0], sets[True][0]) and torch.equal(te.y, sets[False][1].long())
    x, y = next(te.epoch(0))
    assert x.shape == (8, 1, 28, 28)
    # resized on the device to the model's image size
    _, te32, info32 = data.load("fashion-mnist", str(tmp_path / "empty"), 8, "cpu", img_size=32)
    assert next(te32.epoch(0))[0].shape == (8, 1, 32, 32) and info32.img_size == 32
    # the release's files in --data-dir itself (as a GPU machine gets them, carried), the package absent
    monkeypatch.setattr(data, "PACKAGED", {"fashion-mnist": (str(tmp_path / "nowhere"), "dataset-fashion-mnist")})
    tr2, _, _ = data.load("fashion-mnist", str(tmp_path / "fashion-mnist"), 8, "cpu", img_size=28)
    assert torch.equal(tr2.x, tr.x) and torch.equal(tr2.y, tr.y)
    # neither there nor downloadable: the error names the package
    monkeypatch.setattr(tvd, "FashionMNIST", lambda root, train, download: (_ for _ in ()).throw(OSError("offline")))
    with pytest.raises(data.DataError, match="apt-get install dataset-fashion-mnist"):
        data.load("fashion-mnist", str(tmp_path / "empty"), 8, "cpu")


def test_corrupt_idx_file_is_a_clear_error(tmp_path):
    import gzip

    with gzip.open(tmp_path / "bad.gz", "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + (100).to_bytes(4, "big") + b"short")
    with pytest.raises(data.DataError, match="truncated"):
        data.read_idx(str(tmp_path / "bad.gz"))


@pytest.mark.parametrize("name, flipped", [("mnist", False), ("fashion-mnist", True)])
def test_digits_are_never_flipped(monkeypatch, name, flipped):
    # bright left half, dark right half: a random crop shifts it by at most 4 px, a flip mirrors it
    x = torch.zeros(256, 1, 28, 28, dtype=torch.uint8)
    x[..., :14] = 255
    monkeypatch.setattr(data, "torchvision_set", lambda n, root, train: (x, torch.arange(256) % 10))
    tr, _, _ = data.load(name, "data", 256, "cpu")
    b, _ = next(tr.epoch(0))
    left_brighter = b[..., :8].mean((1, 2, 3)) > b[..., -8:].mean((1, 2, 3))
    assert bool(left_brighter.all()) != flipped  # fashion-mnist: about half of them flipped


def test_failed_data_leaves_no_run_folder(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    monkeypatch.setattr(tvd, "CIFAR10", lambda *a, **kw: (_ for _ in ()).throw(OSError("offline")))
    a = targs(tmp_path, data="cifar10", data_dir=str(tmp_path))
    with pytest.raises(data.DataError):
        train.main(a)
    assert not os.path.exists(a.out_dir)


def test_arguments_a_run_does_not_read_are_named(tmp_path, capsys):
    assert train.ignored(targs(tmp_path, method="barter", grow="fresh", churn=0.2, budgets="separate")) is None  # barter reads them all
    assert train.ignored(targs(tmp_path, method="rigl", grow="clone", churn=0.2, init_batches=3)) == \
        "note: ignored: --grow, --churn (not read by --method rigl); --init-batches (read only with --pretrained)"
    assert train.ignored(targs(tmp_path, method="masked", grow="fresh")) == "note: ignored: --grow (not read by --method masked)"
    assert train.ignored(targs(tmp_path, method="dense")) == \
        "note: ignored: --dense-frac, --update-every (not read by --method dense)"
    assert train.ignored(targs(tmp_path, method="masked", pretrained="w.pt", init_batches=3, pretrained_heads=6)) is None
    assert train.ignored(targs(tmp_path, pretrained="torchvision:vit_b_16", pretrained_heads=6)) == \
        "note: ignored: --pretrained-heads (torchvision's model gives its own head count)"
    train.main(targs(tmp_path, method="static", grow="fresh", max_steps=2))
    assert "note: ignored: --grow, --update-every (not read by --method static)" in capsys.readouterr().out


def test_static_trains_with_no_topology_update(tmp_path):
    logs = {}
    for method, extra in (("static", []), ("barter", []), ("separate", ["--budgets", "separate"])):  # barter does move units
        out = tmp_path / method
        r = subprocess.run([sys.executable, "train.py", "--method", method.replace("separate", "barter"), *extra,
                            "--model", "micro", "--data", "synthetic",
                            "--epochs", "1", "--max-steps", "30", "--update-every", "10", "--warmup-epochs", "1",
                            "--batch-size", "64", "--dense-frac", "0.3", "--device", "cpu", "--out-dir", str(out)],
                           capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 0, r.stderr
        logs[method] = read_log(out)
    assert not [r for r in logs["static"] if r["type"] == "update"]
    fixed = [r for r in logs["separate"] if r["type"] == "update"]
    assert len(fixed) == 3 and all(r["traded"] == 0 and sum(r["counts"]["heads"]) == 4 and sum(r["counts"]["mlp"]) == 58
                                   for r in fixed)
    line = runlog.show_counts({"step": 5, "moved": {"heads": 0, "mlp": 16}, "traded": 1,
                              "counts": {"heads": [2, 2], "mlp": [9, 9]}}, {"heads": [2, 1], "mlp": [17, 17]})
    assert line == "step 5: moved 0 heads, 16 mlp, channels traded for a head | heads 2 2(+1) | mlp 9(-8) 9(-8)"
    assert [r["step"] for r in logs["barter"] if r["type"] == "update"] == [10, 20, 30]  # inside the lr warmup (78 steps)
    start, summary = logs["static"][0], logs["static"][-1]
    assert start["type"] == "start" and summary["type"] == "summary"
    assert summary["counts"] == start["counts"] == {"heads": [2, 1, 1], "mlp": [20, 19, 19]}


def study_args(tmp_path, **kw):
    import study

    base = dict(methods=("static", "masked"), densities=(0.3,), seeds=(0, 1), equal_time=("static",),
                out=str(tmp_path / "study"),
                train=targs(tmp_path, batch_size=500, epochs=2, update_every=4))  # 10 steps an epoch
    return study.Args(**{**base, **kw})


def test_study_table_resume_and_equal_time(tmp_path, monkeypatch, capsys):
    import study

    a = study_args(tmp_path)
    # an interrupted run: 7 of its 20 steps done, a checkpoint left behind
    part = os.path.join(a.out, "masked-d0.3-s1")
    train.main(replace(a.train, method="masked", dense_frac=0.3, seed=1, out_dir=part, max_steps=7))
    capsys.readouterr()
    res, eq = study.main(a)
    # no terminal under pytest, so no bar: one line per run that ended, counted over the whole grid
    ends = [line.split(" runs done")[0] for line in capsys.readouterr().out.splitlines() if " runs done (" in line]
    assert ends == ["[study] 1/4", "[study] 2/4", "[study] 3/4", "[study] 4/4", "[equal time] 1/2", "[equal time] 2/2"]
    text = open(os.path.join(a.out, "results.md")).read()
    assert "| static | 0.3 |" in text and "| masked | 0.3 |" in text and "| 0.3 |" in text.split("Equal wall-clock")[1]
    assert [len(res[("static", 0.3)]), len(res[("masked", 0.3)]), len(eq[("static", 0.3)])] == [2, 2, 2]
    # the paired column, against the runs: mean and standard error of masked - static by seed
    top = {(m, r["seed"]): r["final_top1"] for m in ("static", "masked") for r in res[(m, 0.3)]}
    d = [top[("masked", s)] - top[("static", s)] for s in (0, 1)]
    row = next(line for line in text.splitlines() if line.startswith("| masked | 0.3 |"))
    cell = f"{(d[0] + d[1]) / 2:+.4f} +- {abs(d[0] - d[1]) / 2:.4f} ({min(d):+.4f}-{max(d):+.4f})"
    assert row.split(" | ")[4] == cell
    # runs with --ema-decay get a second table: the average against the model's own and static's average
    ema = {k: [{**r, "final_top1_ema": r["final_top1"] + 0.01 * (r["seed"] + 1)} for r in v] for k, v in res.items()}
    below = study.tables(a, ema).split("The average of the weights")[1]
    row = next(line for line in below.splitlines() if line.startswith("| masked | 0.3 |")).split(" | ")
    assert row[3:5] == ["+0.0150 +- 0.0050 (+0.0100-+0.0200)", cell + " |"]
    # a DST method's row is also paired with masked's, and says how many heads its runs ended with
    moved = {**res, ("barter", 0.3): [{**r, "final_top1": top[("masked", r["seed"])] + 0.01 * (r["seed"] + 1),
                                       "counts": {"heads": [2, r["seed"] + 1, 1], "mlp": [1, 1, 1]}}
                                      for r in res[("static", 0.3)]]}
    grid = study.tables(replace(a, methods=("static", "masked", "barter")), moved).split("\n\n")[1]
    row = next(line for line in grid.splitlines() if line.startswith("| barter | 0.3 |")).split(" | ")
    assert row[5:7] == ["+0.0150 +- 0.0050 (+0.0100-+0.0200)", "4-5"]
    row = next(line for line in grid.splitlines() if line.startswith("| masked | 0.3 |")).split(" | ")
    assert row[4] == cell and row[5] == "-"  # masked is not paired with itself
    log = read_log(part)
    assert [r["type"] for r in log].count("start") == 1 and log[-1]["step"] == 20  # resumed, not restarted
    epochs = json.load(open(os.path.join(a.out, "equal_time.json")))["static-d0.3"]
    mean = {m: statistics.mean(r["train_seconds"] for r in res[(m, 0.3)]) for m in ("static", "masked")}
    fits = 2 * mean["masked"] / mean["static"]  # the epochs at static's pace in masked's time
    assert epochs == 2 if fits < 2 else fits - 0.01 < epochs <= fits  # never more than masked's time
    assert all(r["step"] == round(10 * epochs) for r in eq[("static", 0.3)])
    curves = json.load(open(os.path.join(a.out, "curves.json")))
    assert len(curves["static-d0.3-s0"]) == 2 and "test_top1" in curves["static-d0.3-s0"][0]
    # each run's clock of evaluations ends at its summary: the whole training time and the final top-1
    for r in res[("masked", 0.3)] + eq[("static", 0.3)]:
        assert r["clock"][-1] == (pytest.approx(r["train_seconds"]), r["final_top1"])
        assert [s for s, _ in r["clock"]] == sorted(s for s, _ in r["clock"])
    # the cut at masked's time: the last evaluation within the same seed's masked time, minus its top-1
    runs = [{"seed": 0, "clock": [(10.0, 0.50), (20.0, 0.60), (30.0, 0.70)]}, {"seed": 1, "clock": [(10.0, 0.50)]}]
    ref = [{"seed": 0, "train_seconds": 25.0, "final_top1": 0.55}, {"seed": 1, "train_seconds": 5.0, "final_top1": 0.4}]
    assert study.within(runs, ref) == [pytest.approx(0.05)]  # seed 1 had no evaluation in its 5 s
    row = next(line for line in text.split("Equal wall-clock")[1].splitlines() if line.startswith("| 0.3 |")).split(" | ")
    cut = study.within(eq[("static", 0.3)], res[("masked", 0.3)])
    assert row[-2:] == [study.paired_cell(cut), f"{len(cut)} of 2 |"]
    # a second start runs nothing: every run is finished
    calls = []
    monkeypatch.setattr(train, "main", lambda args: calls.append(args))
    study.main(a)
    assert calls == []


def test_equal_time_epochs_never_overrun_masked(tmp_path):
    import study

    a = study_args(tmp_path, methods=("masked", "barter"), equal_time=("barter",))
    res = {("masked", 0.3): [{"train_seconds": 17.0}, {"train_seconds": 19.07}],
           ("barter", 0.3): [{"train_seconds": 10.0}, {"train_seconds": 10.0}]}
    runs, chosen = study.equal_time_runs(a, res)
    # 2 epochs x 18.035 / 10 = 3.607: rounded down to a hundredth, at most masked's time (not 3.61, not 4)
    assert chosen == {"barter-d0.3": 3.6}
    assert [(name, r.epochs, r.seed) for name, r in runs] == [("barter-d0.3-s0-eq", 3.6, 0), ("barter-d0.3-s1-eq", 3.6, 1)]
    res[("barter", 0.3)] = [{"train_seconds": 30.0}] * 2  # slower than masked: the method's own epochs, no fewer
    assert study.equal_time_runs(replace(a, out=str(tmp_path / "other")), res)[1] == {"barter-d0.3": 2}


def test_study_run_whose_study_died_exits_quietly(monkeypatch):
    # `timeout` signals a whole process group: a study.main driven without study.py's handler dies at
    # once, and its runs, having saved, must end without a BrokenPipeError traceback each
    import study

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "execute", interrupted)
    rx, tx = torch.multiprocessing.Pipe(duplex=False)
    rx.close()
    study.child(tx, None)  # raised BrokenPipeError before
    rx, tx = torch.multiprocessing.Pipe(duplex=False)
    study.child(tx, None)
    assert rx.recv() == "interrupted"


@pytest.mark.parametrize("jobs", [1, 2])
def test_study_sigterm_stops_every_run_and_resumes(tmp_path, jobs):
    # a scheduler's SIGTERM to study.py alone: no queued run starts, no run's process outlives the
    # study, the running ones save a checkpoint, and the same command finishes the study
    out = tmp_path / "study"
    cmd = [sys.executable, "study.py", "--methods", "static", "--densities", "0.3", "--seeds", "0", "1", "2",
           "--equal-time", "--jobs", str(jobs), "--out", str(out), "--train.model", "micro", "--train.data",
           "synthetic", "--train.batch-size", "500", "--train.epochs", "8", "--train.warmup-epochs", "0",
           "--train.device", "cpu"]  # 10 steps an epoch
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    started = [out / f"static-d0.3-s{s}" / "checkpoint.pt" for s in range(jobs)]
    deadline = time.time() + 120
    while not all(c.exists() for c in started) and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)  # the first epoch's checkpoint of every run started: training is under way
    with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:  # the runs' processes (not the resource tracker)
        children = [c for c in f.read().split() if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
    assert len(children) == (jobs if jobs > 1 else 0)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    p.send_signal(signal.SIGTERM)  # an impatient second one, while the runs save: they still do, cleanly
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "interrupted: finished runs are kept" in err, err
    assert "Traceback" not in err, err  # no BrokenPipeError from a run whose study exited under it
    assert not any(os.path.exists(f"/proc/{c}") for c in children)  # a run's process, joined
    assert not (out / "static-d0.3-s2").exists()  # queued, never started
    for s in range(jobs):
        log = read_log(out / f"static-d0.3-s{s}")
        ck = torch.load(started[s], weights_only=True)
        assert log[-1]["type"] != "summary" and 10 <= ck["step"] < 80
    if jobs == 2:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr
        for s in range(3):
            log = read_log(out / f"static-d0.3-s{s}")
            assert [x["type"] for x in log].count("start") == 1 and log[-1]["type"] == "summary" and log[-1]["step"] == 80


def test_study_bad_arguments(tmp_path):
    import study

    with pytest.raises(train.ArgError, match="unknown method"):
        study.main(study_args(tmp_path, methods=("static", "magic")))
    with pytest.raises(train.ArgError, match="add masked"):
        study.main(study_args(tmp_path, methods=("static",)))
    # by default the equal-time runs follow --methods: barter's when masked runs, none without it
    assert study_args(tmp_path, methods=("static", "barter"), equal_time=None).equal_time == ()
    assert study_args(tmp_path, equal_time=None).equal_time == ("barter",)
    study.validate(study_args(tmp_path, methods=("static", "barter"), equal_time=None))  # no error
    # each method is checked as itself: a density that leaves no head stops the unit methods, not rigl or dense
    with pytest.raises(train.ArgError, match="no heads"):
        study.main(study_args(tmp_path, densities=(0.01,), equal_time=()))
    assert not os.path.exists(tmp_path / "study")
    study.validate(study_args(tmp_path, methods=("rigl", "dense"), densities=(0.01,), equal_time=()))  # no error
    # a weights file that is not there stops the study once, before any run (not once per run)
    with pytest.raises(train.ArgError, match="no such file"):
        study.main(study_args(tmp_path, train=targs(tmp_path, pretrained=str(tmp_path / "missing.pt"))))
    assert not os.path.exists(tmp_path / "study")


# ---- issue 12: plot.py and the end-of-run summary ---------------------------------------------------

@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plot")
    outs = []
    for method in ("barter", "masked"):
        a = targs(tmp, method=method, epochs=2, update_every=15, out_dir=str(tmp / method))
        train.main(a)
        outs.append(a.out_dir)
    return tmp, outs


def decoded(path):
    """(H, W, channels) of a PNG and how many distinct colours it holds."""
    import numpy as np
    from PIL import Image

    img = np.asarray(Image.open(path).convert("RGB"))
    return img.shape, len(np.unique(img.reshape(-1, 3), axis=0))


def test_plot_runs_writes_a_real_picture(two_runs):
    import plot

    tmp, outs = two_runs
    png = plot.main(plot.Args(paths=tuple(outs), out=str(tmp / "runs.png")))
    shape, colours = decoded(png)
    rows = 2 + 2  # one allocation map per barter/masked run, then curves, then bars
    assert shape == (int(3.2 * rows * 80), 12 * 80, 3) and colours > 50


def test_allocation_map_data_equals_the_update_records(two_runs):
    import plot

    _, outs = two_runs
    recs = read_log(outs[0])
    steps, counts = plot.allocation(recs)
    ups = [r for r in recs if r["type"] == "update"]
    assert steps == [0] + [r["step"] for r in ups] and len(ups) >= 5
    for kind in ("heads", "mlp"):
        assert counts[kind] == [recs[0]["counts"][kind]] + [r["counts"][kind] for r in ups]
    assert counts["mlp"][0] == [20, 19, 19] and any(c != counts["mlp"][0] for c in counts["mlp"])


def test_plot_bench_and_bad_inputs(two_runs, tmp_path):
    import bench

    tmp, outs = two_runs
    res = bench.main(bench.Args(models=("micro",), densities=(0.3, 0.5), steps=1, rounds=1, warmup=0,
                                device="cpu", memory=False, out=str(tmp_path / "bench.json")))
    assert {r["method"] for r in res["rows"]} == {"dense", "masked", "rigl", "barter"}

    def plot(*paths):
        return subprocess.run([sys.executable, "plot.py", *map(str, paths)], capture_output=True, text=True, cwd=REPO)

    r = plot(tmp_path / "bench.json", "-o", tmp_path / "bench.png")
    assert r.returncode == 0, r.stderr
    shape, colours = decoded(tmp_path / "bench.png")
    assert shape == (int(3.8 * 80), 11 * 80, 3) and colours > 20
    # a run still in its first epoch: what it has is plotted
    young = tmp_path / "young"
    young.mkdir()
    with open(young / "log.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in read_log(outs[0]) if r["type"] in ("start", "update"))
    assert plot(young).returncode == 0 and (young / "runs.png").exists()
    (tmp_path / "empty").mkdir()
    (tmp_path / "notbench.json").write_text('{"hello": 1}')
    for bad, says in ((tmp_path / "empty", "no log.jsonl"), (tmp_path / "notbench.json", "not a bench.py result"),
                      (tmp_path / "missing", "is not a folder")):
        r = plot(bad)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr and "Traceback" not in r.stderr


def test_bench_times_a_runs_end_split(two_runs, tmp_path):
    import bench

    tmp, outs = two_runs
    barter_run, masked_run = outs
    res = bench.main(bench.Args(runs=(barter_run,), steps=1, rounds=1, warmup=0, device="cpu",
                                out=str(tmp_path / "bench.json")))
    start = read_log(barter_run)[0]["counts"]
    trained = weights.load(os.path.join(barter_run, "checkpoint.pt"))
    masked, begin, end = res["rows"]  # only the run's group: --runs and no --models
    assert {r["model"] for r in res["rows"]} == {f"micro {barter_run}"} and masked["method"] == "masked"
    assert (begin["method"], begin["split"], end["method"], end["split"]) == ("barter", "start", "barter", "end")
    # the start is the run's start, the end is the architecture the checkpoint loads back as
    assert begin["units"] == start and end["units"] == {k: trained.counts(k) for k in ("heads", "mlp")} != start
    assert end["flops_per_img"] == trained.flops_per_image()
    # same weights in another split (the trade keeps the weight budget), each against the same masked
    assert end["density_measured"] == pytest.approx(begin["density_measured"])
    assert end["speedup_vs_masked"] == pytest.approx(masked["step_ms"] / end["step_ms"])
    assert all(r["peak_mem_mb"] > 0 for r in res["rows"])
    u = end["units"]
    assert f"| barter (end: {sum(u['heads'])} heads + {sum(u['mlp'])} channels) | 0.3 |" in bench.table(res)
    import plot

    shape, colours = decoded(plot.main(plot.Args(paths=(str(tmp_path / "bench.json"),), out=str(tmp_path / "b.png"))))
    assert shape == (int(3.8 * 80), 11 * 80, 3) and colours > 20
    for bad, says in ((masked_run, "is a masked run"), (str(tmp_path / "nowhere"), "no such file")):
        with pytest.raises(SystemExit, match=says):
            bench.main(bench.Args(runs=(bad,), steps=1, rounds=1, device="cpu", memory=False))


def test_run_ends_with_a_summary(two_runs):
    _, outs = two_runs
    recs = read_log(outs[0])
    s, ep = recs[-1], [r for r in recs if r["type"] == "epoch"]
    assert s["type"] == "summary" and s["step"] == s["total_steps"] == 156
    assert s["final_top1"] == ep[-1]["test_top1"] and s["best_top1"] == max(r["test_top1"] for r in ep)
    assert s["train_seconds"] == pytest.approx(sum(r["seconds"] for r in ep))
    assert s["counts"] == [r for r in recs if r["type"] == "update"][-1]["counts"]


# ---- issue 10: fine-tuning from pretrained weights, loading a trained model -------------------------

def test_timm_deit_tiny_converts_to_the_same_logits(tmp_path):
    import timm

    torch.manual_seed(0)
    t = timm.models.vision_transformer.VisionTransformer(img_size=224, patch_size=16, embed_dim=192, depth=12,
                                                         num_heads=3, num_classes=1000).eval()
    with torch.no_grad():  # random biases and gains, so that a bias or norm mapped wrong would show
        for n, p in t.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.normal_(1.0 if "norm" in n and n.endswith("weight") else 0.0, 0.1)
    torch.save({"model": t.state_dict()}, tmp_path / "deit.pth")  # the DeiT release files' wrapping
    ours, kind = weights.load_pretrained(str(tmp_path / "deit.pth"))
    assert kind == "timm" and ours.cfg == replace(PRESETS["deit-tiny"], num_classes=1000)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), t(x), rtol=1e-5, atol=1e-5)


def test_torchvision_state_dict_at_another_shape_converts(tmp_path):
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    tv = VisionTransformer(image_size=48, patch_size=12, num_layers=2, num_heads=3, hidden_dim=48, mlp_dim=80,
                           num_classes=5).eval()
    with torch.no_grad():
        tv.heads.head.weight.normal_(0, 0.1)
    torch.save(tv.state_dict(), tmp_path / "tv.pt")
    ours, kind = weights.load_pretrained(str(tmp_path / "tv.pt"), num_heads=3)
    c = ours.cfg
    assert kind == "torchvision" and (c.img_size, c.patch_size, c.dim, c.depth, c.num_heads, c.mlp_hidden) == (48, 12, 48, 2, 3, 80)
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), tv(x), rtol=1e-5, atol=1e-5)


def test_pos_embed_resampling_matches_timm():
    from timm.layers import resample_abs_pos_embed

    pos = torch.randn(1, 1 + 14 * 14, 192)
    new = weights.resample_pos_embed(pos, 8)  # 224 px in patches of 16 -> 32 px in patches of 4
    assert new.shape == (1, 1 + 8 * 8, 192) and torch.equal(new[:, 0], pos[:, 0])
    torch.testing.assert_close(new, resample_abs_pos_embed(pos, [8, 8]))
    assert weights.resample_pos_embed(pos, 14) is pos


def test_bad_weight_files_fail_with_one_line(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"no")
    torch.save({"conv1.weight": torch.zeros(2)}, tmp_path / "resnet.pt")
    for path, says in ((tmp_path / "junk.pt", "not a readable torch file"), (tmp_path / "resnet.pt", "accepted:"),
                       (tmp_path / "missing.pt", "no such file")):
        r = subprocess.run([sys.executable, "train.py", "--pretrained", str(path), "--data", "synthetic",
                            "--out-dir", str(tmp_path / "run")], capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
        assert not (tmp_path / "run").exists()
    for path, says in ((tmp_path / "junk.pt", "not a readable torch file"), (tmp_path / "resnet.pt", "not a checkpoint")):
        r = subprocess.run([sys.executable, "train.py", "--eval-only", "--resume", str(path)],
                           capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


class RunsCode:
    """What a weights file can hold: unpickling it calls os.system (here: makes a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_file_that_would_run_code_is_refused_everywhere_and_never_run(tmp_path, monkeypatch):
    import argparse

    import bench

    marker, evil = tmp_path / "pwned", tmp_path / "evil.pth"
    torch.save({"model": RunsCode(marker)}, evil)
    runs_dir = tmp_path / "evil-run"
    runs_dir.mkdir()
    torch.save({"format": weights.CKPT_FORMAT, "model": RunsCode(marker)}, runs_dir / "checkpoint.pt")
    cli = {"--pretrained": ["--pretrained", str(evil), "--data", "synthetic", "--out-dir", str(tmp_path / "run")],
           "--resume": ["--resume", str(evil), "--data", "synthetic", "--model", "micro", "--out-dir", str(tmp_path / "run")],
           "--eval-only": ["--eval-only", "--resume", str(evil)]}
    for flag, argv in cli.items():
        r = subprocess.run([sys.executable, "train.py", *argv], capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (flag, r.stderr)
        assert "refused: it names posix.system" in r.stderr and "weights.convert_trusted" in r.stderr, r.stderr
    with pytest.raises(weights.WeightsError, match="refused"):
        weights.load(str(evil))
    with pytest.raises(SystemExit, match="refused"):
        bench.main(bench.Args(runs=(str(runs_dir),), memory=False, out=str(tmp_path / "b.json")))
    assert not marker.exists()  # nothing ran, on any path
    # a timm-style training checkpoint that pickles its argparse.Namespace: refused, then converted by a
    # user who trusts it, and read the safe way
    m = micro(dtype=torch.float32)
    sd = {k.replace("patch_embed.", "patch_embed.proj."): v for k, v in m.state_dict().items()}
    torch.save({"model": sd, "args": argparse.Namespace(lr=1e-3, model="deit")}, tmp_path / "timm.pth")
    with pytest.raises(weights.WeightsError, match="argparse.Namespace"):
        weights.load_pretrained(str(tmp_path / "timm.pth"))
    weights.convert_trusted(str(tmp_path / "timm.pth"), str(tmp_path / "safe.pth"))
    ours, kind = weights.load_pretrained(str(tmp_path / "safe.pth"), num_heads=4)
    x = batch(2, dtype=torch.float32)[0]
    assert kind == "timm" and torch.equal(ours(x), m(x))
    # checkpoints from before this change held torch's version as a TorchVersion object: they still load
    # (that str subclass is allowed while reading, nowhere else)
    a = targs(tmp_path, max_steps=3)
    train.main(a)
    path = os.path.join(a.out_dir, "checkpoint.pt")
    ck = torch.load(path, weights_only=True)
    assert type(ck["env"]["torch"]) is str  # what is written now is plain
    ck["env"]["torch"] = torch.__version__
    torch.save(ck, path)
    assert weights.read_checkpoint(path)["env"]["torch"] == str(torch.__version__)
    with pytest.raises(Exception, match="TorchVersion"):
        torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def trained_torchvision(tmp_path_factory):
    """A micro-shaped torchvision ViT trained a few hundred steps on the synthetic set, saved as a file."""
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    tv = VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=10)
    tr, _, _ = data.load("synthetic", "data", 64, "cpu")
    opt = torch.optim.AdamW(tv.parameters(), lr=2e-3)
    for epoch in range(4):
        for x, y in tr.epoch(epoch):
            opt.zero_grad()
            F.cross_entropy(tv(x), y).backward()
            opt.step()
    path = tmp_path_factory.mktemp("tv") / "tv_micro.pt"
    torch.save(tv.state_dict(), path)
    return str(path)


def start(tmp_path, path, **kw):
    a = targs(tmp_path, pretrained=path, pretrained_heads=4, init_batches=3, **kw)
    torch.manual_seed(0)
    return train.build(a, None, torch.device("cpu"), nullcontext())


def test_importance_selection_keeps_the_top_units(tmp_path, trained_torchvision):
    tr, _, cfg, masked_model, masked, rec = start(tmp_path, trained_torchvision, method="masked")
    # the gate-Taylor scores, computed here with explicit gates in the hand-written forward
    dense, _ = weights.load_pretrained(trained_torchvision, num_heads=4)
    dense = dense.double()
    hs, fs = [torch.zeros(4, dtype=torch.float64) for _ in range(3)], [torch.zeros(64, dtype=torch.float64) for _ in range(3)]
    batches = list(itertools.islice(tr.epoch(0), 3))
    for x, y in batches:
        hg = [torch.ones(4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
        fg = [torch.ones(64, dtype=torch.float64, requires_grad=True) for _ in range(3)]
        F.cross_entropy(ref_forward(dense, x.double(), hg, fg), y, label_smoothing=0.1).backward()
        hs = [a + g.grad.abs() / 3 for a, g in zip(hs, hg)]
        fs = [a + g.grad.abs() / 3 for a, g in zip(fs, fg)]
    budget, lo, hi = unit_budgets(cfg, 0.3)
    for kind, scores in (("heads", hs), ("mlp", fs)):
        kept = [set(a.nonzero().flatten().tolist()) for a in masked.active[kind]]
        assert sum(map(len, kept)) == budget[kind] and all(len(k) >= l for k, l in zip(kept, lo[kind]))
        # every kept unit is either among its block's `lo` best or scores above every unit left out
        for b, k in enumerate(kept):
            best = set(sorted(range(len(scores[b])), key=lambda u: -scores[b][u])[:lo[kind][b]])
            assert best <= k
        top_extra = min(scores[b][u] for b, k in enumerate(kept) for u in k
                        if u not in sorted(range(len(scores[b])), key=lambda u: -scores[b][u])[:lo[kind][b]])
        left_out = max(scores[b][u] for b, k in enumerate(kept) for u in range(len(scores[b])) if u not in k)
        assert top_extra >= left_out - 1e-9
    # barter starts from the identical function; its step-0 loss beats a random choice of units
    _, _, _, barter_model, barter, brec = start(tmp_path, trained_torchvision, method="barter")
    x, y = batches[0]
    with torch.no_grad():
        torch.testing.assert_close(barter_model(x), masked_model(x), rtol=1e-5, atol=1e-6)
    assert brec["loss_start"] == pytest.approx(rec["loss_start"], rel=1e-5)
    g = torch.Generator().manual_seed(0)
    rand = copy.deepcopy(dense).float()
    resize(rand, None, [torch.randperm(4, generator=g)[:n].sort().values for n in barter_model.counts("heads")],
           [torch.randperm(64, generator=g)[:n].sort().values for n in barter_model.counts("mlp")])
    with torch.no_grad():
        rand_loss = sum(float(F.cross_entropy(rand(x), y, label_smoothing=0.1)) for x, y in batches) / 3
    assert brec["loss_start"] < rand_loss
    assert rec["loss_dense"] < brec["loss_start"]


def test_finetune_runs_and_new_classes_get_a_fitted_head(tmp_path, trained_torchvision):
    import timm

    t = timm.models.vision_transformer.VisionTransformer(img_size=64, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                                         mlp_ratio=2, num_classes=7)
    torch.save(t.state_dict(), tmp_path / "timm.pt")
    _, _, cfg, model, meth, rec = start(tmp_path, str(tmp_path / "timm.pt"), method="barter")
    assert (cfg.img_size, cfg.num_classes, model.pos_embed.shape[1]) == (64, 10, 1 + 8 * 8)  # data resized to the weights'
    tr, _, cfg, model, meth, rec = start(tmp_path, str(tmp_path / "timm.pt"), method="barter", img_size=32)
    assert (cfg.img_size, model.pos_embed.shape[1], next(tr.epoch(0))[0].shape[-1]) == (32, 1 + 4 * 4, 32)  # resampled
    assert model.head.weight.abs().sum() > 0 and rec["loss_dense"] < math.log(10)  # fitted, better than chance
    import shutil

    weights = shutil.copy(trained_torchvision, tmp_path / "weights.pt")
    a = targs(tmp_path, pretrained=str(weights), pretrained_heads=4, init_batches=2, max_steps=12, out_dir=str(tmp_path / "ft"))
    train.main(a)
    start_rec = read_log(a.out_dir)[0]
    assert start_rec["init"]["batches"] == 2 and start_rec["init"]["loss_start"] > 0
    # a fine-tune's defaults move fewer units and grow fresh ones; from scratch, or when given, they are as set
    assert (start_rec["args"]["churn"], start_rec["args"]["grow"]) == (0.1, "fresh")
    scratch = train.derived(targs(tmp_path))
    assert (scratch.churn, scratch.grow) == (0.5, "clone")
    assert train.derived(replace(a, churn=0.3, grow="clone")) == replace(a, churn=0.3, grow="clone")
    os.remove(weights)  # a resumed run takes shape and weights from its checkpoint alone
    m2, _, _ = train.main(replace(a, max_steps=20, resume=os.path.join(a.out_dir, "checkpoint.pt")))
    log = read_log(a.out_dir)
    assert [r["type"] for r in log].count("start") == 1 and log[-1]["step"] == 20


def test_load_rebuilds_a_trained_compact_model_in_a_fresh_process(tmp_path):
    a = targs(tmp_path, max_steps=25)
    model, _, _ = train.main(a)
    path = os.path.join(a.out_dir, "checkpoint.pt")
    x, _ = batch(3, dtype=torch.float32)
    torch.save(x, tmp_path / "x.pt")
    code = ("import torch, weights; torch.set_grad_enabled(False); m = weights.load(%r); assert not m.training; "
            "torch.save(m(torch.load(%r)), %r); print(m.counts('heads'), m.counts('mlp'))") % (path, str(tmp_path / "x.pt"), str(tmp_path / "y.pt"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{model.counts('heads')} {model.counts('mlp')}"
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "y.pt"), model.eval()(x), rtol=0, atol=0)
    top1 = train.main(train.Args(eval_only=True, resume=path, device="cpu"))
    assert top1 == read_log(a.out_dir)[-2]["test_top1"]


def test_average_of_the_weights_is_logged_checkpointed_and_loads(tmp_path):
    a = targs(tmp_path, ema_decay=0.95, max_steps=30)
    model, _, _ = train.main(a)
    log = read_log(a.out_dir)
    ep, summary = log[-2], log[-1]
    assert summary["final_top1_ema"] == ep["test_top1_ema"]
    path = os.path.join(a.out_dir, "checkpoint.pt")
    live, avg = weights.load(path), weights.load(path, ema=True)
    assert live.counts("heads") == avg.counts("heads") == model.counts("heads") != [2, 1, 1]  # resized with the model
    assert any(not torch.equal(p, q) for p, q in zip(live.parameters(), avg.parameters()))
    _, test_dl, _ = data.load("synthetic", "data", a.batch_size, torch.device("cpu"), CFG.img_size, a.seed, 1)
    # the logged numbers are those of the models a user loads back
    assert evaluate(live, test_dl, nullcontext()) == ep["test_top1"]
    assert evaluate(avg, test_dl, nullcontext()) == ep["test_top1_ema"]
    pub = weights.from_pretrained(os.path.join(a.out_dir, "model"))  # published: the average, and it says so
    assert all(torch.equal(p, q) for p, q in zip(pub.parameters(), avg.parameters()))
    assert "average" in json.loads(open(os.path.join(a.out_dir, "model", "config.json")).read())["weights"]
    plain = targs(tmp_path, max_steps=5, out_dir=str(tmp_path / "plain"))
    train.main(plain)
    with pytest.raises(weights.WeightsError, match="no average"):
        weights.load(os.path.join(plain.out_dir, "checkpoint.pt"), ema=True)


# ---- issue 86: the trained model published, exported, and measured at inference ------------------------

def hollow_model():
    """A compact micro model with a block of no head and no MLP channel, nonzero biases everywhere."""
    m = micro(dtype=torch.float32)
    resize(m, None, [torch.tensor([0, 2]), torch.tensor([], dtype=torch.long), torch.tensor([1])],
           [torch.arange(0, 40, 2), torch.tensor([], dtype=torch.long), torch.tensor([3, 5, 7])])
    return m.eval()


def test_published_model_rebuilds_exactly_and_bad_folders_are_refused(tmp_path):
    m = hollow_model()
    folder = weights.save_pretrained(m, str(tmp_path / "pub"))
    again = weights.from_pretrained(folder)
    assert again.counts("heads") == [2, 0, 1] and again.counts("mlp") == [20, 0, 3] and not again.training
    x, _ = batch(5, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(again(x), m(x))
    config = json.loads((tmp_path / "pub" / "config.json").read_text())
    assert set(config) == {"format", "heads", "mlp"} | set(vit.ViTConfig.__dataclass_fields__)
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "config.json").write_text(json.dumps({**config, "mlp": [20, 1, 3]}))
    with pytest.raises(weights.WeightsError, match="does not match its config.json .size mismatch for blocks.1.mlp"):
        weights.from_pretrained(str(bad))
    for text in ("{not json", "[]", json.dumps({**config, "format": "timm"})):
        (bad / "config.json").write_text(text)
        with pytest.raises(weights.WeightsError, match="does not describe a model of this project"):
            weights.from_pretrained(str(bad))
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(weights.WeightsError, match="model.safetensors is not a readable safetensors file"):
        weights.from_pretrained(str(bad))
    os.remove(bad / "model.safetensors")
    with pytest.raises(weights.WeightsError, match="not a published model: no model.safetensors"):
        weights.from_pretrained(str(bad))
    # a published model fine-tunes like any pretrained weights
    a = targs(tmp_path, pretrained=folder, max_steps=8, out_dir=str(tmp_path / "tune"))
    tuned, _, _ = train.main(a)
    assert read_log(a.out_dir)[0]["init"]["batches"] == 8 and tuned.cfg == m.cfg


def test_export_writes_programs_that_give_the_eager_logits_and_read_no_pickle(tmp_path, monkeypatch):
    import onnxruntime as ort
    import pickle

    import export

    m = hollow_model()
    folder = weights.save_pretrained(m, str(tmp_path / "pub"))

    def no_pickle(*a, **k):
        raise AssertionError("a pickle was read on the publish/export path")

    class NoUnpickler(pickle.Unpickler):  # what subclasses it at import still imports; what unpickles fails
        __init__ = no_pickle
    for mod, name, stand_in in ((pickle, "load", no_pickle), (pickle, "loads", no_pickle), (pickle, "Unpickler", NoUnpickler),
                                (torch, "load", no_pickle)):
        monkeypatch.setattr(mod, name, stand_in)
    written = export.main(export.Args(source=folder, out=str(tmp_path / "out")))
    monkeypatch.undo()
    assert sorted(written) == ["onnx", "pt2", "pte"]
    x = export.images(m, 3, seed=7)
    with torch.no_grad():
        want = m(x)
    program = torch.export.load(written["pt2"]).module()
    onnx = ort.InferenceSession(written["onnx"], providers=["CPUExecutionProvider"]).run(None, {"images": x.numpy()})[0]
    for got in (program(x), torch.as_tensor(onnx)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(AssertionError, match="differ from the eager model"):  # the check after writing can fail
        export.check("a wrong model", lambda x: m(x) + 1e-3, m)
    (tmp_path / "empty").mkdir()
    for source, says in (("empty", "holds no published model"), ("nothing", "no such file")):
        r = subprocess.run([sys.executable, "export.py", str(tmp_path / source), "--out", str(tmp_path / "o")],
                           capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


def test_export_compacts_a_masked_checkpoint(two_runs):
    import export

    path = os.path.join(two_runs[1][1], "checkpoint.pt")  # a masked run
    run_model, kind = weights.load_pretrained(two_runs[1][0])  # --pretrained takes a run folder: its model/
    assert kind == "published" and run_model.counts("heads") == weights.load(os.path.join(two_runs[1][0], "checkpoint.pt")).counts("heads")
    masked, compact = weights.load(path), export.load_source(path)
    active = torch.load(path, weights_only=True)["method"]["active"]
    for kind in ("heads", "mlp"):
        assert compact.counts(kind) == [int(a.sum()) for a in active[kind]] != masked.counts(kind)
    x, _ = batch(4, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(compact(x), masked(x), rtol=0, atol=1e-6)


def test_bench_times_inference_against_the_dense_model(tmp_path):
    import bench

    res = bench.main(bench.Args(models=("micro",), densities=(0.3,), rounds=1, inference=True, out=str(tmp_path / "inf.json")))
    rows = {(r["density"], r["backend"]): r for r in res["rows"]}
    assert set(rows) == {(d, b) for d in (0.3, 1.0) for b in ("eager", "onnxruntime")}
    for (d, b), r in rows.items():
        dense = rows[(1.0, b)]
        assert r["macs_ratio"] == pytest.approx(dense["flops_per_img"] / r["flops_per_img"]) and (r["macs_ratio"] > 1) == (d < 1)
        assert r["b64_speedup"] == pytest.approx(r["b64_img_per_s"] / dense["b64_img_per_s"])
        assert min(r["b1_ms_1thread"], r["b1_ms_all"], r["b64_img_per_s"]) > 0


# ---- issue 11: torchrun / DDP, topology in lockstep on every rank ----------------------------------

DDP_ARGS = ["--model", "micro", "--data", "synthetic", "--update-every", "10", "--warmup-epochs", "0",
            "--batch-size", "64", "--dense-frac", "0.3", "--device", "cpu"]


def torchrun(*args, script="train.py", wait=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *map(str, args)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    if not wait:
        return p
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


def updates(path):
    return [(r["step"], r["counts"]) for r in read_log(path) if r["type"] == "update"]


def close_weights(a, b):
    """Relative (Frobenius) difference of every tensor within float32 reduction noise. The key bias
    is left out: its gradient is zero in exact arithmetic (softmax ignores a shift of all logits),
    so Adam turns the rounding noise of either run into steps of the size of the learning rate."""
    for k in a:
        x, y = a[k], b[k]
        if "attn.qkv" in k and "bias" in k:  # also under a mask parametrization
            third = len(x) // 3
            x, y = torch.cat([x[:third], x[2 * third:]]), torch.cat([y[:third], y[2 * third:]])
        assert (x - y).norm() <= 1e-5 * y.norm() + 1e-7, (k, float((x - y).norm() / y.norm()))


@pytest.mark.parametrize("method", ["barter", "masked"])
def test_two_ranks_equal_one_process(tmp_path, method):
    one = targs(tmp_path, method=method, epochs=1, max_steps=40, ema_decay=0.9, out_dir=str(tmp_path / "one"))
    train.main(one)
    rc, out, err = torchrun(*DDP_ARGS, "--method", method, "--epochs", "1", "--max-steps", "40", "--ema-decay", "0.9",
                            "--out-dir", tmp_path / "two")
    assert rc == 0, err
    assert "2 ranks" in out and out.count("epoch 1 step 40") == 1  # rank 0 alone prints
    assert updates(tmp_path / "two") == updates(one.out_dir) and len(updates(one.out_dir)) == 4
    ck = [torch.load(p / "checkpoint.pt", weights_only=True) for p in (tmp_path / "one", tmp_path / "two")]
    assert ck[0]["heads"] == ck[1]["heads"] and ck[0]["mlp"] == ck[1]["mlp"]
    close_weights(ck[1]["model"], ck[0]["model"])
    close_weights(ck[1]["ema"], ck[0]["ema"])  # the average too: resized (or masked) in lockstep on every rank
    assert read_log(tmp_path / "two")[0]["world"] == 2


def test_sigterm_on_one_rank_stops_all_and_resumes(tmp_path):
    whole = tmp_path / "whole"
    rc, _, err = torchrun(*DDP_ARGS, "--epochs", "3", "--out-dir", whole)
    assert rc == 0, err
    part = tmp_path / "part"
    p = torchrun(*DDP_ARGS, "--epochs", "3", "--out-dir", part, wait=False)
    deadline = time.time() + 120
    while not (part / "checkpoint.pt").exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)  # the first epoch's checkpoint: training is under way
    with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
        workers = f.read().split()
    os.kill(int(workers[-1]), signal.SIGTERM)  # one rank only, as a scheduler may do
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    ck = torch.load(part / "checkpoint.pt", weights_only=True)
    assert 78 < ck["step"] < 234 and ck["step"] % 10 == 0 and f"interrupted: checkpoint at step {ck['step']}" in out
    rc, _, err = torchrun(*DDP_ARGS, "--epochs", "3", "--out-dir", part, "--resume", part / "checkpoint.pt")
    assert rc == 0, err
    assert updates(part) == updates(whole) and read_log(part)[-1]["type"] == "summary"


def test_desynchronised_plan_is_caught(tmp_path):
    script = tmp_path / "desync.py"
    script.write_text(f"""
import os, sys
sys.path.insert(0, {REPO!r})
import barter, train, tyro
if os.environ["RANK"] == "1":  # this rank's plan moves nothing: the ranks disagree
    barter.select = lambda counts, lo, hi, prune, grow, k, net=0: ([], [])
    barter.exchange = lambda *a, **kw: 0
train.main(tyro.cli(train.Args))
""")
    rc, out, err = torchrun(*DDP_ARGS, "--epochs", "1", "--max-steps", "40", "--out-dir", tmp_path / "run", script=script)
    assert rc != 0
    assert "ranks disagree on the units after the update at step" in err and "rank 1: {'heads': [2, 1, 1], 'mlp': [20, 19, 19]}" in err
