"""
Datasets. Small ones (CIFAR, MNIST, Fashion-MNIST, synthetic) live on the training device as uint8
at their own size and are resized to the model's image size and augmented there (random crop with
4 px padding, horizontal flip except for digits), so the input pipeline never limits img/s, not even
for a model at density 0.1. An image folder (ImageNet layout) goes through a torchvision DataLoader
that decodes JPEGs with PIL, or, prepared once (`python data.py --src SRC --out OUT --size S`), is
read through a memory map and augmented on the device, so that the loader keeps up with a step
several times faster than a dense one. Batch order and augmentation are a pure function of (seed,
epoch, batch), for image folders too (each image is augmented under an RNG seeded from its index),
so a run resumed in the middle of an epoch sees exactly the batches it would have seen.
"""
import array
import functools
import gzip
import json
import math
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

DATASETS = ("cifar10", "cifar100", "mnist", "fashion-mnist", "synthetic", "folder")
# a horizontally flipped digit is another digit (or none)
NO_FLIP = {"mnist"}
# offline copies that a distribution package installs: gzipped IDX files, as released
PACKAGED = {"fashion-mnist": ("/usr/share/datasets/fashion-mnist", "dataset-fashion-mnist")}
IDX_FILES = {True: ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
             False: ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


class DataError(RuntimeError):
    pass


@dataclass
class DataInfo:
    in_chans: int
    img_size: int
    num_classes: int


def class_patterns(num_classes=10, size=32, chans=3, seed=0):
    """One smooth random pattern per class, fixed by seed (shared by the train and test sets)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(num_classes, chans, 8, 8, generator=g)
    return F.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)


def make_synthetic(n, patterns, seed):
    """A learnable made-up set: a sample is its class pattern, randomly scaled and shifted, plus
    another class's pattern at lower weight and pixel noise, quantised to uint8 like a real image."""
    g = torch.Generator().manual_seed(seed)
    C = patterns.shape[0]
    y = torch.randint(0, C, (n,), generator=g)
    other = torch.randint(0, C, (n,), generator=g)
    scale = 0.7 + 0.6 * torch.rand(n, 1, 1, 1, generator=g)
    x = scale * patterns[y] + 0.5 * patterns[other] + 0.5 * torch.randn(n, *patterns.shape[1:], generator=g)
    shifts = torch.randint(-3, 4, (n, 2), generator=g).tolist()
    x = torch.stack([torch.roll(xi, shifts=s, dims=(1, 2)) for xi, s in zip(x, shifts)])
    x = ((x / 4 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return x, y


@functools.lru_cache(maxsize=1)
def synthetic_set():
    patterns = class_patterns()
    return make_synthetic(5000, patterns, 1), make_synthetic(1000, patterns, 2)


def read_idx(path):
    """A gzipped IDX file (the MNIST release format) as a uint8 tensor: magic 0 0 8 ndim, ndim
    big-endian sizes, then the bytes."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08":
        raise DataError(f"{path} is not a gzipped IDX file of bytes")
    nd = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(nd)]
    if len(raw) != 4 + 4 * nd + math.prod(dims):
        raise DataError(f"{path} is truncated: {len(raw)} bytes for shape {dims}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=4 + 4 * nd).view(dims)


def packaged_set(name, train, folder=None):
    """(images, labels) from the release's gzipped IDX files in `folder` (default: where a distribution
    package installs them), or None if they are not there."""
    folder = folder or PACKAGED.get(name, (None,))[0]
    paths = [os.path.join(folder, f) for f in IDX_FILES[train]] if folder and name in ("mnist", "fashion-mnist") else []
    if not paths or not all(os.path.isfile(p) for p in paths):
        return None
    x, y = (read_idx(p) for p in paths)
    return x[:, None].contiguous(), y.long()


def torchvision_set(name, root, train):
    """A torchvision set already in `root`, else the release's IDX files in `root` itself or the packaged copy,
    else a download into `root`."""
    import torchvision.datasets as tvd

    cls = {"cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100, "mnist": tvd.MNIST, "fashion-mnist": tvd.FashionMNIST}[name]
    try:
        ds = cls(root, train=train, download=False)
    except Exception:  # not there (yet)
        packaged = packaged_set(name, train, root) or packaged_set(name, train)
        if packaged is not None:
            return packaged
        try:
            ds = cls(root, train=train, download=True)
        except Exception as e:  # no network, a proxy, a half-written file...
            pkg = f", install the {PACKAGED[name][1]} package (apt-get install {PACKAGED[name][1]})" if name in PACKAGED else ""
            raise DataError(f"could not get {name} into {os.path.abspath(root)!r} ({type(e).__name__}: {e}). "
                            f"Put the files torchvision expects there by hand{pkg}, or try the tool offline "
                            f"with --data synthetic") from None
    x = torch.as_tensor(ds.data)
    x = x.permute(0, 3, 1, 2) if x.ndim == 4 else x[:, None]  # (n, C, H, W)
    return x.contiguous(), torch.as_tensor(ds.targets).long()


def epoch_seed(seed, epoch):
    """The seed of one epoch's order and augmentation: every loader derives its RNGs from it."""
    return seed * 100003 + epoch


def batches_in(n, batch_size, train):
    """The batches of an epoch of n images: the last partial one dropped in training, kept in evaluation."""
    return n // batch_size if train else -(-n // batch_size)


def epoch_plan(n, batch_size, train, seed, epoch, start=0, rank=0, world=1):
    """For each batch of an epoch from batch `start` on that gives this rank images: (the batch's positions
    among the n images, this rank's part of them, the batch's own generator). The epoch's shuffle when
    training. Every rank walks the same shuffle and takes its slice of each global batch; the batch's
    draws are made for the whole batch, so that a rank's share is augmented as one process would."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch))) if train else torch.arange(n)
    for b in range(start, batches_in(n, batch_size, train)):
        whole = order[b * batch_size:(b + 1) * batch_size]
        part = torch.arange(len(whole)).tensor_split(world)[rank]
        if len(part):  # the last evaluation batch may hold fewer images than ranks
            yield whole, part, torch.Generator().manual_seed(epoch_seed(seed, epoch) * 100003 + b)


class Waiting:
    """A loader's batches, and the seconds the caller spent blocked waiting for them: the share of an
    epoch a faster input pipeline would give back to the step (on CUDA the time the host takes to queue
    the loader's own kernels counts too)."""

    def __init__(self, batches):
        self.batches, self.seconds = iter(batches), 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.seconds += time.perf_counter() - t0

    def close(self):
        """Stop the loader (and a thread it runs) when the loop ends before the epoch does."""
        self.batches.close()


class TensorLoader:
    """Batches from uint8 images held on `device`; augmentation on the device. Under DDP (world > 1)
    every rank walks the same permutation and takes its slice of each global batch, augmented with the
    draws a single process would make for those images."""

    def __init__(self, x, y, batch_size, train, mean, std, seed=0, device="cpu", img_size=None, flip=True, augment=True,
                 rank=0, world=1):
        self.x, self.y = x.to(device), y.to(device)
        self.batch_size, self.train, self.seed, self.device = batch_size, train, seed, device
        self.rank, self.world = rank, world
        self.img_size, self.flip, self.aug = img_size or x.shape[-1], flip, augment
        self.mean = mean.view(1, -1, 1, 1).to(device)
        self.std = std.view(1, -1, 1, 1).to(device)

    def __len__(self):
        return batches_in(len(self.x), self.batch_size, self.train)

    def epoch(self, epoch, start=0):
        """Yield (images, labels) of one epoch, from batch `start` on. The batches' indices and
        augmentation draws are made on the host at the start and moved to the device in one copy each,
        so that no batch waits on a copy from the host."""
        ids, draws = [], []
        for whole, part, g in epoch_plan(len(self.x), self.batch_size, self.train, self.seed, epoch, start, self.rank, self.world):
            ids.append(whole[part])
            if self.train and self.aug:  # drawn for the whole batch, then this rank's share
                shift = torch.randint(0, 9, (2, len(whole)), generator=g)
                flip = torch.rand(len(whole), generator=g) < 0.5
                draws.append(torch.cat([shift, flip[None].long()])[:, part])  # (3, images): dy, dx, flip
        if not ids:
            return
        sizes = [len(i) for i in ids]
        ids = torch.cat(ids).to(self.device).split(sizes)
        draws = torch.cat(draws, 1).to(self.device).split(sizes, 1) if draws else [None] * len(ids)
        for idx, d in zip(ids, draws):
            x = self.x[idx].float().div_(255)
            if x.shape[-2:] != (self.img_size, self.img_size):  # to the model's size, on the device
                x = F.interpolate(x, size=(self.img_size, self.img_size), mode="bilinear", antialias=True)
            if d is not None:
                x = self.augment(x, d)
            yield (x - self.mean) / self.std, self.y[idx]

    def augment(self, x, d):
        """Random crop (4 px padding) by the draws d[0], d[1] and horizontal flip where d[2] is 1."""
        B, C, H, W = x.shape
        dy, dx, flip = d[0], d[1], d[2].bool() & self.flip
        xp = F.pad(x, (4, 4, 4, 4))
        rows = (dy[:, None] + torch.arange(H, device=x.device))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(W, device=x.device))[:, None, None, :]
        cols = torch.where(flip[:, None, None, None], cols.flip(-1), cols)
        return xp[torch.arange(B, device=x.device)[:, None, None, None], torch.arange(C, device=x.device)[None, :, None, None], rows, cols]


class Seeded(torch.utils.data.Dataset):
    """A dataset whose sample i in `epoch` is drawn with the torch RNG seeded from (seed, epoch, i),
    inside fork_rng: its augmentation is the same whichever worker loads it, with any number of
    workers or none, and the caller's RNG is left as it was."""

    def __init__(self, ds, seed, epoch):
        self.ds, self.base = ds, epoch_seed(seed, epoch) * 1000003

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.base + i)
            return self.ds[i]


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # an image folder's normalisation


class FolderLoader:
    """An ImageNet-layout folder (train/ and val/, one subfolder per class) through a DataLoader."""

    def __init__(self, root, img_size, batch_size, train, seed=0, workers=8, device="cpu", augment=True, rank=0, world=1):
        import torchvision.datasets as tvd
        import torchvision.transforms as T

        mean, std = IMAGENET_MEAN, IMAGENET_STD
        tf = (T.Compose([T.RandomResizedCrop(img_size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
              if train and augment else T.Compose([T.Resize(int(img_size * 8 / 7)), T.CenterCrop(img_size), T.ToTensor(), T.Normalize(mean, std)]))
        self.ds = tvd.ImageFolder(os.path.join(root, "train" if train else "val"), transform=tf)
        self.batch_size, self.train, self.seed, self.workers = batch_size, train, seed, workers
        self.device, self.rank, self.world = torch.device(device), rank, world

    def __len__(self):
        n = -(-len(self.ds) // self.world) if self.world > 1 else len(self.ds)  # per rank
        b = self.batch_size // self.world
        return n // b if self.train else -(-n // b)

    def order(self, epoch):
        """This rank's sample indices for the epoch, in order (a disjoint share of the epoch-seeded
        shuffle under torchrun, as DistributedSampler deals them)."""
        if self.world > 1:
            sampler = torch.utils.data.DistributedSampler(self.ds, self.world, self.rank, shuffle=self.train,
                                                          seed=self.seed, drop_last=self.train)
            sampler.set_epoch(epoch)
            return list(sampler)
        if not self.train:
            return list(range(len(self.ds)))
        return torch.randperm(len(self.ds), generator=torch.Generator().manual_seed(epoch_seed(self.seed, epoch))).tolist()

    def epoch(self, epoch, start=0):
        """The batches of `epoch` from batch `start` on: a resumed run loads none of the batches before
        it, and sees the same images, augmented the same way, as a run that never stopped."""
        b = self.batch_size // self.world
        idx = self.order(epoch)[start * b:]
        dl = torch.utils.data.DataLoader(Seeded(self.ds, self.seed, epoch), b, sampler=idx, drop_last=self.train,
                                         num_workers=self.workers, pin_memory=self.device.type == "cuda",
                                         generator=torch.Generator().manual_seed(epoch))  # not the global RNG
        for x, y in dl:
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


# ---- an image folder prepared once, then read at memory speed ------------------------------------------
#
# `python data.py --src SRC --out OUT --size S` decodes every image of SRC once, on every core: in RGB
# (grey and CMYK JPEGs, PNGs named .JPEG: whatever PIL opens), the short side resized to S as
# torchvision's Resize does it, the centre S x S square kept. OUT then holds per split (train, val)
# SPLIT.u8, N x S x S x 3 uint8 (row-major, RGB), and SPLIT.labels, N int64 in this machine's byte
# order, both read through a memory map; and prepared.json, the header (source, S, classes, counts,
# the files that could not be read), written last, so that a half-prepared folder is never taken for a
# whole one. progress.json records the chunks done meanwhile: an interrupted preparation continues.

HEADER, PROGRESS, SPLITS = "prepared.json", "progress.json", ("train", "val")
CHUNK = 256  # images one task converts and the progress file records at a time


@dataclass
class PrepareArgs:
    src: str
    """an ImageNet-layout folder: train/ and val/, one subfolder per class"""
    out: str
    """the prepared folder (run the same command again to finish an interrupted preparation)"""
    size: int = 160
    """S: every image's short side resized to S and its centre S x S square kept (N x S x S x 3 bytes on disk)"""
    workers: Optional[int] = None
    """processes converting images (None: every core; 0: this process alone)"""


def listing(src, split, classes):
    """(path relative to src, label) of every image file of src/split, in torchvision's ImageFolder order."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    found = make_dataset(os.path.join(src, split), {c: i for i, c in enumerate(classes)}, IMG_EXTENSIONS, allow_empty=True)
    return [(os.path.relpath(path, src), label) for path, label in found]


def square(path, size):
    """The image file as (size x size x 3) RGB bytes: its short side resized to size (bilinear, antialiased:
    torchvision's Resize of a PIL image), then the centre square (CenterCrop)."""
    import torchvision.transforms.functional as TF
    from PIL import Image

    with Image.open(path) as img:
        return TF.center_crop(TF.resize(img.convert("RGB"), size), size).tobytes()


def convert_chunk(task):
    """Convert one chunk of a split into its rows of SPLIT.u8; returns (split, chunk, {index: why not})."""
    out, split, c, paths, size = task
    errors, row = {}, size * size * 3
    with open(os.path.join(out, f"{split}.u8"), "r+b") as f:
        for k, path in enumerate(paths):
            i = c * CHUNK + k
            try:
                rgb = square(path, size)
            except Exception as e:  # unreadable, truncated, not an image: listed in the header, never dropped unsaid
                errors[i] = f"{type(e).__name__}: {e}"
                continue
            f.seek(i * row)
            f.write(rgb)  # a failed write (a full disk) stops the preparation: it is no unreadable image
    return split, c, errors


def read_json(path):
    with open(path) as f:
        return json.load(f)


def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)  # whole or not at all


def prepare(src, out, size, workers=None):
    """Prepare the image folder src into out (see above) and return its header."""
    from tqdm import tqdm

    problem = folder_problem(src) if not os.path.isfile(os.path.join(src, HEADER)) else f"{src!r} is prepared already"
    if problem:
        raise DataError(f"--src {problem}")
    if size < 1 or (workers is not None and workers < 0):
        raise DataError(f"--size must be positive and --workers at least 0, got {size} and {workers}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"--out {out!r} is a file, not a folder")
    classes = sorted(e.name for e in os.scandir(os.path.join(src, "train")) if e.is_dir())
    extra = sorted({e.name for e in os.scandir(os.path.join(src, "val")) if e.is_dir()} - set(classes))
    if not classes or extra:
        raise DataError(f"--src {src!r}: " + (f"val/ has classes train/ lacks: {', '.join(extra[:5])}" if classes else
                                              "train/ has no class folders"))
    files = {split: listing(src, split, classes) for split in SPLITS}
    if not files["train"]:
        raise DataError(f"--src {src!r}: train/ holds no image file")
    plan = {"source": os.path.realpath(src), "size": size, "classes": classes, "counts": {k: len(v) for k, v in files.items()}}
    if os.path.isfile(os.path.join(out, HEADER)):
        head = read_header(out)
        if {k: head[k] for k in plan} != plan:
            raise DataError(f"--out {out!r} holds another preparation ({head['source']} at {head['size']} px): "
                            f"remove it or pick another --out")
        print(f"{out} is prepared already")
        return head
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out {out!r} cannot be made ({e.strerror})") from None
    prog_path = os.path.join(out, PROGRESS)
    prog = read_json(prog_path) if os.path.isfile(prog_path) else None
    if prog and prog["plan"] != plan:
        raise DataError(f"--out {out!r} holds an unfinished preparation of another source or size: remove it or pick another --out")
    if not prog:  # the arrays at their full size (sparse until written), the labels at once
        for split, found in files.items():
            with open(os.path.join(out, f"{split}.u8"), "wb") as f:
                f.truncate(len(found) * size * size * 3)
            with open(os.path.join(out, f"{split}.labels"), "wb") as f:
                f.write(array.array("q", [label for _, label in found]).tobytes())
        prog = {"plan": plan, "done": {k: [] for k in SPLITS}, "unreadable": {k: {} for k in SPLITS}}
        write_json(prog_path, prog)
    tasks = [(out, split, c, [os.path.join(src, p) for p, _ in found[c * CHUNK:(c + 1) * CHUNK]], size)
             for split, found in files.items() for c in range(-(-len(found) // CHUNK)) if c not in prog["done"][split]]
    todo = sum(len(t[3]) for t in tasks)
    workers = os.cpu_count() if workers is None else workers
    # the workers leave Ctrl-C to this process, which records what is done and says how to go on
    pool = mp.get_context("fork").Pool(workers, signal.signal, (signal.SIGINT, signal.SIG_IGN)) if workers > 0 and tasks else None
    bar = tqdm(total=todo, unit="img", desc=f"preparing {src} at {size} px", disable=None)
    try:
        for split, c, errors in (pool.imap_unordered(convert_chunk, tasks) if pool else map(convert_chunk, tasks)):
            prog["done"][split].append(c)
            prog["unreadable"][split].update({str(i): e for i, e in errors.items()})
            write_json(prog_path, prog)  # after the chunk's rows are written
            bar.update(len(files[split][c * CHUNK:(c + 1) * CHUNK]))
    except KeyboardInterrupt:
        bar.close()
        done = sum(len(v) for v in prog["done"].values()) * CHUNK
        raise DataError(f"interrupted with about {min(done, sum(plan['counts'].values()))} of {sum(plan['counts'].values())} "
                        f"images prepared: run the same command again to continue") from None
    finally:
        if pool:
            pool.terminate()
    bar.close()
    bad = {split: [{"index": int(i), "file": files[split][int(i)][0], "error": e} for i, e in sorted(v.items(), key=lambda x: int(x[0]))]
           for split, v in prog["unreadable"].items()}
    head = {**plan, "format": 1, "layout": "SPLIT.u8: N x S x S x 3 uint8, RGB, row-major; SPLIT.labels: N int64, native order",
            "byteorder": sys.byteorder, "unreadable": bad}
    write_json(os.path.join(out, HEADER), head)
    os.remove(prog_path)
    n_bad = sum(len(v) for v in bad.values())
    gb = sum(plan["counts"].values()) * size * size * 3 / 1e9
    print(f"prepared {plan['counts']['train']} training and {plan['counts']['val']} validation images of {len(classes)} classes "
          f"at {size} px into {out} ({gb:.2f} GB); " + (f"{n_bad} files could not be read and are left out (listed in "
                                                          f"{os.path.join(out, HEADER)})" if n_bad else "every file read"))
    return head


def read_header(root):
    """A prepared folder's header, its arrays checked against it (one line if they do not match)."""
    head = read_json(os.path.join(root, HEADER))
    if head.get("byteorder", sys.byteorder) != sys.byteorder:
        raise DataError(f"{root!r} was prepared on a machine of another byte order: prepare it again here")
    S = head["size"]
    for split in SPLITS:
        for name, nbytes in ((f"{split}.u8", S * S * 3), (f"{split}.labels", 8)):
            path, want = os.path.join(root, name), head["counts"][split] * nbytes
            if not os.path.isfile(path) or os.path.getsize(path) != want:
                raise DataError(f"{path} is missing or not {want} bytes as {HEADER} says: prepare the folder again")
    return head


def random_boxes(n, size, g, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """RandomResizedCrop's boxes for n images of size x size, drawn as torchvision draws them (ten tries of
    an area fraction in `scale` and a log-uniform aspect ratio in `ratio`, the first that fits, else the
    whole image), for the batch at once; and a horizontal flip each, with probability 1/2. (n, 5) float
    rows of top, left, height, width, flip (0 or 1)."""
    area = size * size * torch.empty(n, 10).uniform_(*scale, generator=g)
    aspect = torch.exp(torch.empty(n, 10).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=g))
    w, h = (area * aspect).sqrt().round(), (area / aspect).sqrt().round()
    fits = (w > 0) & (w <= size) & (h > 0) & (h <= size)
    first = fits.float().argmax(1, keepdim=True)  # the first try that fits
    any_fit = fits.any(1)
    w = torch.where(any_fit, w.gather(1, first)[:, 0], float(size))
    h = torch.where(any_fit, h.gather(1, first)[:, 0], float(size))
    top = (torch.rand(n, generator=g) * (size - h + 1)).floor()
    left = (torch.rand(n, generator=g) * (size - w + 1)).floor()
    return torch.stack([top, left, h, w, (torch.rand(n, generator=g) < 0.5).float()], 1)


def center_boxes(n, size):
    """The evaluation crop of the PIL path for n images of size x size: the centre square of 7/8 of the side
    (Resize(8/7 of the image size), then CenterCrop), unflipped."""
    c = round(size * 7 / 8)
    top = float(int(round((size - c) / 2)))
    return torch.tensor([[top, top, c, c, 0.0]]).expand(n, 5)


def crop_resize(x, boxes, out):
    """Each image's box (top, left, height, width; flipped where the fifth value is 1) resized to out x out,
    the whole batch in one grid_sample: bilinear at the points a resize of the box alone samples (pixel
    centres, clamped to the box's edge rows and columns: torchvision's resized_crop without antialiasing,
    which a box enlarged to `out` never needs). x: (n, C, H, W) float; boxes (n, 5) of x's dtype."""
    n, C, H, W = x.shape
    top, left, h, w, flip = boxes.unbind(1)
    j = torch.arange(out, device=x.device, dtype=x.dtype) + 0.5  # (out,) output pixel centres
    ys = top[:, None] + torch.minimum((j * h[:, None] / out - 0.5).clamp(min=0), h[:, None] - 1)  # (n, out) source rows
    xs = left[:, None] + torch.minimum((j * w[:, None] / out - 0.5).clamp(min=0), w[:, None] - 1)  # (n, out) columns
    xs = torch.where(flip[:, None] > 0, xs.flip(1), xs)
    gx, gy = (2 * xs[:, None, :] + 1) / W - 1, (2 * ys[:, :, None] + 1) / H - 1  # grid_sample's [-1, 1] coordinates
    grid = torch.stack(torch.broadcast_tensors(gx, gy), -1)  # (n, out, out, 2): x, then y
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


class PreparedLoader:
    """A split of a prepared folder, read through a memory map (torch.from_file: pages are read as batches
    touch them). A background thread gathers each batch's images, at sorted indices, into one of a few
    buffers (pinned on CUDA, once, here: the thread makes no CUDA call but waiting for a copy), a batch or
    two ahead; the loop copies it to the device without blocking, and there, in a few batched kernels and
    with no host sync, crops and resizes (RandomResizedCrop's boxes), flips and normalises it. Order and
    draws are a function of (seed, epoch, batch), and under torchrun each rank takes its slice of every
    global batch, as TensorLoader does. Evaluation: the centre crop the PIL path takes."""

    AHEAD = 2  # batches gathered ahead of the one the step uses

    def __init__(self, root, head, split, img_size, batch_size, train, seed=0, device="cpu", augment=True, rank=0, world=1):
        S, n = head["size"], head["counts"][split]
        self.x = torch.from_file(os.path.join(root, f"{split}.u8"), size=n * S * S * 3, dtype=torch.uint8).view(n, S, S, 3)
        self.y = torch.from_file(os.path.join(root, f"{split}.labels"), size=n, dtype=torch.int64)
        ok = torch.ones(n, dtype=torch.bool)
        ok[[u["index"] for u in head["unreadable"][split]]] = False
        self.keep = ok.nonzero()[:, 0]  # the images that were read
        self.size, self.img_size, self.batch_size, self.train, self.aug = S, img_size, batch_size, train, augment
        self.seed, self.device, self.rank, self.world = seed, torch.device(device), rank, world
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1) * 255  # on 0-255 pixels
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1) * 255
        rows, pin = -(-batch_size // world), self.device.type == "cuda"
        self.slots = [(torch.empty(rows, S, S, 3, dtype=torch.uint8, pin_memory=pin), torch.empty(rows, dtype=torch.int64, pin_memory=pin),
                       torch.empty(rows, 5, pin_memory=pin)) for _ in range(self.AHEAD + 1)]
        self.copies = torch.cuda.Stream(self.device) if pin else None  # host-to-device copies, beside the steps

    def __len__(self):
        return batches_in(len(self.keep), self.batch_size, self.train)

    def plan(self, epoch, start=0):
        """(image indices, boxes) of this rank's share of each batch of `epoch` from batch `start` on."""
        for whole, part, g in epoch_plan(len(self.keep), self.batch_size, self.train, self.seed, epoch, start, self.rank, self.world):
            whole = self.keep[whole].sort().values  # sorted: pages read in file order
            boxes = random_boxes(len(whole), self.size, g) if self.train and self.aug else center_boxes(len(whole), self.size)
            yield whole[part], boxes[part]

    def gather(self, slot, idx, boxes):
        """What the host does per batch: the images and labels at idx, and their boxes, into a buffer."""
        x, y, d = self.slots[slot]
        torch.index_select(self.x, 0, idx, out=x[:len(idx)])
        torch.index_select(self.y, 0, idx, out=y[:len(idx)])
        d[:len(idx)] = boxes

    def augment(self, x, d):
        """On x's device: (n, S, S, 3) uint8 rows and (n, 5) boxes -> (n, 3, img, img) normalised floats."""
        x = crop_resize(x.permute(0, 3, 1, 2).float(), d, self.img_size)
        return (x - self.mean) / self.std

    def epoch(self, epoch, start=0):
        """Yield (images, labels) of one epoch on the device, from batch `start` on."""
        full, free, stop = queue.Queue(), queue.Queue(), threading.Event()
        for k in range(len(self.slots)):
            free.put((k, None))

        def fill():
            try:
                for idx, boxes in self.plan(epoch, start):
                    k, copied = free.get()
                    if stop.is_set():
                        return
                    if copied is not None:
                        copied.synchronize()  # the copy out of this buffer is done: it may be refilled
                    self.gather(k, idx, boxes)
                    full.put((k, len(idx)))
                full.put(None)
            except BaseException as e:  # raised again in the loop
                full.put(e)

        thread = threading.Thread(target=fill, name="prepared-loader", daemon=True)
        thread.start()
        try:
            while (item := full.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                k, n = item
                x, y, d = (t[:n] for t in self.slots[k])
                if self.device.type == "cuda":  # copied on a stream of their own, not queued behind the steps
                    steps = torch.cuda.current_stream(self.device)
                    with torch.cuda.stream(self.copies):
                        x, y, d = (t.to(self.device, non_blocking=True) for t in (x, y, d))
                        copied = torch.cuda.Event(blocking=True)  # which the thread waits for without spinning
                        copied.record()
                    steps.wait_stream(self.copies)
                    for t in (x, y, d):
                        t.record_stream(steps)  # made on the copy stream, used on the steps'
                    images = self.augment(x, d)
                else:  # the images are read by augment before the buffer is handed back; the labels copied
                    images, y, copied = self.augment(x, d), y.clone(), None
                free.put((k, copied))
                yield images, y
        finally:
            stop.set()
            free.put((None, None))
            thread.join()


def folder_problem(root):
    """Why `root` is neither an ImageNet-layout folder (train/ and val/, a subfolder per class) nor a
    prepared one, or None."""
    if not os.path.isdir(root):
        return f"{root!r} is not a folder"
    if os.path.isfile(os.path.join(root, HEADER)):
        return None
    if os.path.isfile(os.path.join(root, PROGRESS)):
        return (f"{root!r} is a preparation that has not finished: run the `python data.py --src ... --out {root}` "
                f"that started it again to finish it")
    if not all(os.path.isdir(os.path.join(root, split)) for split in ("train", "val")):
        return f"{root!r} needs train/ and val/ folders, one subfolder per class"
    return None


def load(name, data_dir, batch_size, device, img_size=None, seed=0, workers=8, augment=True, rank=0, world=1):
    """(train loader, test loader, DataInfo). Images come out at `img_size` px (None: the set's own
    size; 224 for an image folder); training images augmented unless `augment` is False. With world > 1
    each rank gets its share of every global batch of `batch_size`."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    if name == "folder":
        problem = folder_problem(data_dir)
        if problem:
            raise FileNotFoundError(f"--data folder: {problem}")
        img_size = img_size or 224
        if os.path.isfile(os.path.join(data_dir, HEADER)):
            head = read_header(data_dir)
            if head["size"] > img_size:
                print(f"note: {data_dir} holds {head['size']} px images, more than --img-size {img_size}: crops that shrink "
                      f"are not antialiased (prepare it at {img_size} or less)")
            tr = PreparedLoader(data_dir, head, "train", img_size, batch_size, True, seed, device, augment, rank, world)
            te = PreparedLoader(data_dir, head, "val", img_size, batch_size, False, seed, device, False, rank, world)
            return tr, te, DataInfo(3, img_size, len(head["classes"]))
        tr = FolderLoader(data_dir, img_size, batch_size, True, seed, workers, device, augment, rank, world)
        te = FolderLoader(data_dir, img_size, batch_size, False, seed, workers, device, False, rank, world)
        return tr, te, DataInfo(3, img_size, len(tr.ds.classes))
    if name == "synthetic":
        (xtr, ytr), (xte, yte) = synthetic_set()
    else:
        (xtr, ytr), (xte, yte) = torchvision_set(name, data_dir, True), torchvision_set(name, data_dir, False)
    xf = xtr.float() / 255  # normalisation from the training set itself
    mean, std = xf.mean((0, 2, 3)), xf.std((0, 2, 3))
    info = DataInfo(xtr.shape[1], img_size or xtr.shape[-1], int(ytr.max()) + 1)
    flip = name not in NO_FLIP
    return (TensorLoader(xtr, ytr, batch_size, True, mean, std, seed, device, info.img_size, flip, augment, rank, world),
            TensorLoader(xte, yte, batch_size, False, mean, std, seed, device, info.img_size, flip, False, rank, world), info)


if __name__ == "__main__":
    import tyro

    a = tyro.cli(PrepareArgs, description="Prepare an ImageNet-layout image folder once, for --data folder --data-dir OUT.")
    try:
        prepare(a.src, a.out, a.size, a.workers)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
