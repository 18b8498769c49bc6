"""
Weights in and out. In: this project's checkpoints and torchvision / timm / DeiT ViT weights, every file
read with torch.load(weights_only=True) so that none can run code (read); a pretrained model made fit
for other data (adapt, fit_head). Out: a trained model published the way timm and the Hugging Face Hub
publish one, model.safetensors beside a config.json that rebuilds its per-block shapes
(save_pretrained, from_pretrained: no pickle either way), a masked run's model compacted to the units
its masks keep (publishable).
"""
import json
import math
import os
import pathlib
import pickle
import re
from dataclasses import asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

from vit import KINDS, ViT, ViTConfig, resize

# ---- weights from elsewhere: torchvision, timm / DeiT, this project's checkpoints -------------------

CKPT_FORMAT = "barter-reference-checkpoint-v1"  # train.py's checkpoints
# no weights file stores the head count (qkv is (3D, D) whatever it is): the families' own values,
# else the usual 64 channels per head
HEADS_BY_WIDTH = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}
KINDS_ACCEPTED = ("a torchvision VisionTransformer state dict, a timm/DeiT ViT state dict (or {'model': ...}), "
                  "a checkpoint or a published folder of this project, or torchvision:NAME (e.g. torchvision:vit_b_16)")


class WeightsError(ValueError):
    pass


def torchvision_keys(sd):
    """A torchvision VisionTransformer state dict under our names (nn.MultiheadAttention's in_proj is
    [q | k | v] with heads contiguous: our qkv layout)."""
    if "heads.pre_logits.weight" in sd:
        raise WeightsError("torchvision ViT with representation_size (pre_logits) is not supported")
    ours = {"patch_embed.weight": sd["conv_proj.weight"], "patch_embed.bias": sd["conv_proj.bias"],
            "cls_token": sd["class_token"], "pos_embed": sd["encoder.pos_embedding"],
            "norm.weight": sd["encoder.ln.weight"], "norm.bias": sd["encoder.ln.bias"],
            "head.weight": sd["heads.head.weight"], "head.bias": sd["heads.head.bias"]}
    depth = len({k.split(".")[2] for k in sd if k.startswith("encoder.layers.")})
    for i in range(depth):
        p, q = f"encoder.layers.encoder_layer_{i}.", f"blocks.{i}."
        for a, b in [("ln_1", "norm1"), ("ln_2", "norm2"), ("self_attention.out_proj", "attn.proj"),
                     ("mlp.0", "mlp.fc1"), ("mlp.3", "mlp.fc2")]:
            ours[q + b + ".weight"], ours[q + b + ".bias"] = sd[p + a + ".weight"], sd[p + a + ".bias"]
        ours[q + "attn.qkv.weight"] = sd[p + "self_attention.in_proj_weight"]
        ours[q + "attn.qkv.bias"] = sd[p + "self_attention.in_proj_bias"]
    return ours


def timm_keys(sd):
    """A timm VisionTransformer (DeiT) state dict under our names: the same but for patch_embed.proj."""
    unsupported = {"dist_token": "distilled DeiT (dist_token)", "fc_norm.weight": "average pooling (fc_norm)",
                   "blocks.0.ls1.gamma": "LayerScale", "reg_token": "register tokens", "norm_pre.weight": "a pre-norm"}
    for key, what in unsupported.items():
        if key in sd:
            raise WeightsError(f"timm ViT with {what} is not supported")
    ours = {k.replace("patch_embed.proj.", "patch_embed."): v for k, v in sd.items()}
    for k in [k for k in ours if k.endswith("attn.proj.weight")]:  # a timm ViT may have no qkv bias
        ours.setdefault(k.replace("proj.weight", "qkv.bias"), ours[k].new_zeros(3 * ours[k].shape[0]))
    return ours


def config_of(sd, num_heads=None):
    """ViTConfig of a dense state dict in our names (shapes only; the head count as above)."""
    D = sd["cls_token"].shape[-1]
    patch, in_chans = sd["patch_embed.weight"].shape[-1], sd["patch_embed.weight"].shape[1]
    grid = math.isqrt(sd["pos_embed"].shape[1] - 1)
    return ViTConfig(img_size=grid * patch, patch_size=patch, in_chans=in_chans, num_classes=sd["head.weight"].shape[0],
                     dim=D, depth=len([k for k in sd if k.endswith("attn.qkv.weight")]),
                     num_heads=num_heads or HEADS_BY_WIDTH.get(D, max(1, D // 64)),
                     mlp_ratio=sd["blocks.0.mlp.fc1.weight"].shape[0] / D)


def dense_from(sd, num_heads=None):
    cfg = config_of(sd, num_heads)
    if cfg.dim % cfg.num_heads:
        raise WeightsError(f"width {cfg.dim} does not split into {cfg.num_heads} heads")
    model = ViT(cfg).to(sd["cls_token"].dtype)
    model.load_state_dict(sd)
    return model


def from_torchvision(tv_model):
    """Our ViT holding the weights of a torchvision VisionTransformer (same logits, eval mode)."""
    return dense_from(torchvision_keys(tv_model.state_dict()), tv_model.encoder.layers[0].num_heads)


def from_checkpoint(ckpt, ema=False):
    """The trained model of one of train.py's checkpoints, with its per-block shapes; with `ema`, the
    average of its weights that a run with --ema-decay keeps instead of the weights themselves."""
    if ema and not ckpt.get("ema"):
        raise WeightsError("this checkpoint holds no average of the weights (its run had no --ema-decay)")
    model = ViT(ViTConfig(**ckpt["cfg"]), heads=ckpt["heads"], mlp=ckpt["mlp"])
    model.load_state_dict(unmasked({**ckpt["model"], **(ckpt["ema"] if ema else {})}), strict=True)
    return model  # a masked run's: dense, with zeros where masked (publishable compacts it)


def unmasked(sd):
    """A state dict of a model under mask parametrizations, with the plain names (the masked entries are
    zero in the weights themselves)."""
    return {k.replace(".parametrizations.", ".").replace(".original", ""): v for k, v in sd.items()}


def read(path):
    """torch.load a weights file with weights_only=True, or fail with one line. Unpickling can run code,
    so no file is read any other way: this project's checkpoints hold only tensors, numbers, strings,
    lists, tuples and dicts, as torchvision's and timm's weight files do. A file that needs more is
    refused, never loaded the unsafe way behind the user's back; convert_trusted turns one that the
    user trusts into a file this reads."""
    if not os.path.isfile(path):
        raise WeightsError(f"{path!r}: no such file")
    try:
        # checkpoints written before the environment record was a plain str hold torch's version string
        # as torch.torch_version.TorchVersion, a str subclass: the one type allowed besides plain data
        with torch.serialization.safe_globals([torch.torch_version.TorchVersion]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))  # a class or function unpickling would have to call
        if not found:
            raise WeightsError(f"{path!r} is not a readable torch file (UnpicklingError)") from None
        raise WeightsError(f"{path!r} is refused: it names {found.group(1)}, and loading it could run code. If you trust "
                           f"it, convert it once: python -c \"import weights; weights.convert_trusted({path!r}, 'weights.pt')\"") from None
    except Exception as e:
        raise WeightsError(f"{path!r} is not a readable torch file ({type(e).__name__})") from None


DROP = object()  # what plain() leaves out


def plain(obj):
    """obj with every container made a dict, list or tuple and every leaf a tensor, number, string or None
    (an object with a __dict__, such as argparse.Namespace, becomes the dict of its attributes); what has
    no plain form is dropped."""
    if torch.is_tensor(obj):
        return obj.detach()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        kept = {k: plain(v) for k, v in obj.items() if isinstance(k, (str, int))}
        return {k: v for k, v in kept.items() if v is not DROP}
    if isinstance(obj, (list, tuple)):
        kept = [v for v in map(plain, obj) if v is not DROP]
        return kept if isinstance(obj, list) else tuple(kept)
    return plain(vars(obj)) if hasattr(obj, "__dict__") else DROP



def convert_trusted(src, dst):
    """Read src the unsafe way (it may run code: only for a file you trust) and write what it holds as plain
    data (see plain) to dst, a file that read() accepts."""
    obj = plain(torch.load(src, map_location="cpu", weights_only=False))
    torch.save(obj, dst)
    read(dst)  # what was written reads back the safe way
    return dst


def whole(path, write):
    """write(tmp) then tmp renamed to path: a crash mid-write never leaves a broken file at path."""
    write(path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def save_checkpoint(path, **state):
    whole(path, lambda tmp: torch.save({"format": CKPT_FORMAT, **state}, tmp))


def read_checkpoint(path):
    """One of train.py's checkpoints (a dict), or fail with one line."""
    ckpt = read(path)
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        raise WeightsError(f"{path!r} is not a checkpoint of this project")
    return ckpt


def load(path, ema=False):
    """A model trained by train.py, rebuilt with its per-block shapes from its checkpoint, in eval mode
    (with `ema`: the average of its weights, from a run with --ema-decay)."""
    return from_checkpoint(read_checkpoint(path), ema).eval()


def load_pretrained(source, num_heads=None):
    """(model, kind) from a weights file of any kind in KINDS_ACCEPTED, told apart by its keys.
    num_heads: heads per block of a torchvision or timm state dict (None: see HEADS_BY_WIDTH)."""
    if source.startswith("torchvision:"):
        import torchvision.models as tvm

        name = source.split(":", 1)[1]
        try:
            weights = tvm.get_model_weights(name).DEFAULT
            tv = tvm.get_model(name, weights=weights)
        except Exception as e:  # an unknown name, no network...
            raise WeightsError(f"could not get {source} through torchvision ({type(e).__name__}: {e}); "
                               f"download the weights file where there is network and pass its path") from None
        return from_torchvision(tv), "torchvision"
    if os.path.isdir(source):
        return from_pretrained(model_folder(source)), "published"
    obj = read(source)
    if isinstance(obj, dict) and obj.get("format") == CKPT_FORMAT:
        return from_checkpoint(obj), "checkpoint"
    sd = obj.get("model", obj.get("state_dict", obj)) if isinstance(obj, dict) else None
    if isinstance(sd, dict) and "conv_proj.weight" in sd and "encoder.pos_embedding" in sd:
        return dense_from(torchvision_keys(sd), num_heads), "torchvision"
    if isinstance(sd, dict) and "patch_embed.proj.weight" in sd and "blocks.0.attn.qkv.weight" in sd:
        return dense_from(timm_keys(sd), num_heads), "timm"
    raise WeightsError(f"{source!r} holds no weights of a kind this project reads; accepted: {KINDS_ACCEPTED}")


@torch.no_grad()
def adapt(model, cfg):
    """A pretrained model made fit, in place, for data of shape cfg: grey images take the RGB patch
    embedding summed over its channels, the position embedding is resampled to the patch grid, and a
    new class count gets a zero head. Returns (whether the head is new, what changed, in words)."""
    old, notes = model.cfg, []
    if old.in_chans != cfg.in_chans:
        if (old.in_chans, cfg.in_chans) != (3, 1):
            raise WeightsError(f"the weights take {old.in_chans} channels, the data has {cfg.in_chans}")
        w, b = model.patch_embed.weight, model.patch_embed.bias  # grey = RGB with three equal channels
        model.patch_embed = nn.Conv2d(1, old.dim, old.patch_size, old.patch_size).to(w.dtype)
        model.patch_embed.weight.copy_(w.sum(1, keepdim=True))
        model.patch_embed.bias.copy_(b)
        notes.append("grey images: the RGB patch embedding is summed over its three channels")
    model.pos_embed = nn.Parameter(resample_pos_embed(model.pos_embed.detach(), cfg.img_size // cfg.patch_size))
    new_head = old.num_classes != cfg.num_classes
    if new_head:
        model.head = nn.Linear(old.dim, cfg.num_classes)
        nn.init.zeros_(model.head.weight)
        nn.init.zeros_(model.head.bias)
        notes.append(f"new classifier head for {cfg.num_classes} classes (the weights have {old.num_classes}): zero, then "
                     f"fitted to the frozen features of the --init-batches before units are scored")
    model.cfg = cfg
    return new_head, notes


def fit_head(model, batches, steps=200):
    """Fit a zero head to the frozen features of `batches` (logistic regression, Adam): a zero head gives
    every unit a zero gate-Taylor score."""
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


def resample_pos_embed(pos, grid):
    """Position embedding (1, 1 + g*g, D) resampled to a grid x grid patch grid: bicubic, class token
    kept, as timm's resample_abs_pos_embed does."""
    old = math.isqrt(pos.shape[1] - 1)
    if old == grid:
        return pos
    cls, rest = pos[:, :1], pos[:, 1:].float().reshape(1, old, old, -1).permute(0, 3, 1, 2)
    rest = F.interpolate(rest, size=(grid, grid), mode="bicubic", antialias=True, align_corners=False)
    return torch.cat([cls, rest.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).to(pos.dtype)], dim=1)


# ---- a trained model, published: model.safetensors + config.json, no pickle either way -------------------

PUBLISHED_FORMAT = "barter-vit"  # config.json's "format"
PUBLISHED = ("config.json", "model.safetensors")


@torch.no_grad()
def publishable(model, active=None):
    """The model as it is published: a plain ViT of its shapes holding its weights on the CPU, with no mask
    parametrization (a masked method's masked weights are zero already). active ({kind: [bool per unit of
    each block]}, a structured masked run's Masked.active) keeps only the units the masks keep, the
    shapes BARTER would have: the same function, since a masked unit's weights are all zero."""
    plain_model = ViT(model.cfg, heads=model.counts("heads"), mlp=model.counts("mlp"))
    plain_model.load_state_dict({k: v.cpu() for k, v in unmasked(model.state_dict()).items()})
    if active is not None:
        resize(plain_model, None, *[[a.nonzero()[:, 0] for a in active[k]] for k in KINDS])
    return plain_model.eval()


def save_pretrained(model, folder, **about):
    """Write a plain ViT (see publishable) as folder/model.safetensors and folder/config.json: its config
    and every block's head count and MLP width, what rebuilds it exactly, and `about` (e.g. which weights
    these are). Each file is written whole or not at all."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config = {"format": PUBLISHED_FORMAT, **asdict(model.cfg), "heads": model.counts("heads"), "mlp": model.counts("mlp"), **about}
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    whole(os.path.join(folder, "model.safetensors"), lambda tmp: save_file(tensors, tmp))
    whole(os.path.join(folder, "config.json"), lambda tmp: pathlib.Path(tmp).write_text(json.dumps(config, indent=1)))
    return folder


def model_folder(path):
    """The published model of `path`: the folder itself, or a run folder's model/; or one line saying why not."""
    for folder in (path, os.path.join(path, "model")):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise WeightsError(f"{path!r} holds no published model (config.json, or a run's model/)")


def from_pretrained(folder):
    """The model save_pretrained wrote, rebuilt from its config.json and model.safetensors, in eval mode;
    or one line saying what is wrong with the folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    missing = [f for f in PUBLISHED if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise WeightsError(f"{folder!r} is not a published model: no {' or '.join(missing)}")
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        if not isinstance(config, dict) or config.get("format") != PUBLISHED_FORMAT:
            raise ValueError(f"its format is not {PUBLISHED_FORMAT!r}")
        cfg = ViTConfig(**{k: config[k] for k in ViTConfig.__dataclass_fields__})
        model = ViT(cfg, heads=config["heads"], mlp=config["mlp"])
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise WeightsError(f"{folder}/config.json does not describe a model of this project ({type(e).__name__}: {e})") from None
    try:
        tensors = load_file(os.path.join(folder, "model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise WeightsError(f"{folder}/model.safetensors is not a readable safetensors file ({e})") from None
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        why = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise WeightsError(f"{folder}/model.safetensors does not match its config.json ({why[-1]})") from None
    return model.eval()
