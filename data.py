"""
Datasets. Small ones (CIFAR, MNIST, Fashion-MNIST, synthetic) live on the training device as uint8
at their own size and are resized to the model's image size and augmented there (random crop with
4 px padding, horizontal flip except for digits), so the input pipeline never limits img/s, not even
for a model at density 0.1. An image folder (ImageNet layout) goes through a torchvision DataLoader.
Batch order and augmentation are a pure function of (seed, epoch, batch), for image folders too
(each image is augmented under an RNG seeded from its index), so a run resumed in the middle of an
epoch sees exactly the batches it would have seen.
"""
import functools
import gzip
import math
import os
from dataclasses import dataclass

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


def packaged_set(name, train):
    """(images, labels) from the folder a distribution package installs, or None if it is not there."""
    folder = PACKAGED.get(name, (None,))[0]
    paths = [os.path.join(folder, f) for f in IDX_FILES[train]] if folder else []
    if not paths or not all(os.path.isfile(p) for p in paths):
        return None
    x, y = (read_idx(p) for p in paths)
    return x[:, None].contiguous(), y.long()


def torchvision_set(name, root, train):
    """A torchvision set already in `root`, else the packaged copy, else a download into `root`."""
    import torchvision.datasets as tvd

    cls = {"cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100, "mnist": tvd.MNIST, "fashion-mnist": tvd.FashionMNIST}[name]
    try:
        ds = cls(root, train=train, download=False)
    except Exception:  # not there (yet)
        packaged = packaged_set(name, train)
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

    def __len__(self):  # the last partial batch is dropped in training, kept in evaluation
        n = len(self.x)
        return n // self.batch_size if self.train else -(-n // self.batch_size)

    def epoch(self, epoch, start=0):
        """Yield (images, labels) of one epoch, from batch `start` on. The batches' indices and
        augmentation draws are made on the host at the start and moved to the device in one copy each,
        so that no batch waits on a copy from the host."""
        n, B = len(self.x), self.batch_size
        order = torch.arange(n)
        if self.train:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(self.seed, epoch)))
        ids, draws = [], []
        for b in range(start, len(self)):
            whole = order[b * B:(b + 1) * B]
            part = torch.arange(len(whole)).tensor_split(self.world)[self.rank]  # this rank's slice
            if len(part) == 0:  # the last evaluation batch may hold fewer images than ranks
                continue
            ids.append(whole[part])
            if self.train and self.aug:  # drawn for the whole batch, then this rank's share
                g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch) * 100003 + b)
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


class FolderLoader:
    """An ImageNet-layout folder (train/ and val/, one subfolder per class) through a DataLoader."""

    def __init__(self, root, img_size, batch_size, train, seed=0, workers=8, device="cpu", augment=True, rank=0, world=1):
        import torchvision.datasets as tvd
        import torchvision.transforms as T

        mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
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


def folder_problem(root):
    """Why `root` is not an ImageNet-layout folder (train/ and val/, a subfolder per class), or None."""
    if not os.path.isdir(root):
        return f"{root!r} is not a folder"
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
