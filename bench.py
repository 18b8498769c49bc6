"""
Speed and memory of every method, side by side: `python bench.py`.

Same model, batch and data for each (method, density). A training step is forward + backward +
optimizer step with each method's hooks, timed with device synchronisation. Configurations are timed
interleaved, round by round, so a drift in machine speed hits all of them alike and every ratio
compares steps taken side by side. Peak memory is measured per configuration in isolation: the CUDA
allocator peak on GPU; on CPU the peak RSS growth of a fresh process that runs only that configuration.
"""
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

import train
import weights
from step import Graph, Stepper, autocast, bf16_supported, environment, make_optimizer, sync
from barter import Schedule
from vit import ViT, ViTConfig, preset


@dataclass
class Args:
    models: Optional[tuple[str, ...]] = None
    """model presets (None: cifar-tiny; on CUDA also deit-small at 224 px)"""
    batch_size: Optional[int] = None
    """batch size (None: 128 for 32 px presets, 256 for 224 px presets)"""
    densities: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7)
    """densities to compare"""
    methods: tuple[str, ...] = ("dense", "masked", "rigl", "barter")
    """methods to compare; ratios are against masked at the same density"""
    steps: Optional[int] = None
    """timed steps per configuration per round (None: 2 on CPU, 10 on CUDA)"""
    rounds: int = 5
    """interleaved rounds; the median and spread are over rounds"""
    warmup: int = 2
    """untimed steps per configuration first"""
    device: str = "auto"
    """auto, cpu, cuda"""
    bf16: Optional[bool] = None
    """bf16 autocast (None: on CUDA, where supported; on CPU it needs a CPU with bf16 instructions to be fast)"""
    compile: bool = False
    """torch.compile every model"""
    cuda_graph: tuple[bool, ...] = (False,)
    """False: eager steps; True: each step replayed from one captured CUDA graph (train.py --cuda-graph; CUDA
    only). `--cuda-graph False True` times both, interleaved; each row's ratios are against masked in the
    same mode, and against eager masked where it ran"""
    memory: bool = True
    """measure peak memory (on CPU: one subprocess per configuration)"""
    profile: bool = False
    """also print which ops the time of a step goes to (torch.profiler), for masked and barter at the lowest density"""
    runs: tuple[str, ...] = ()
    """barter run folders of train.py (or their checkpoint.pt): each is also timed at the units per block it
    holds (where its trades took the split of heads and channels), beside masked and BARTER's start at the
    run's model, density and image size. With --runs and no --models, only the runs are timed"""
    loaders: bool = False
    """time the image-folder input pipelines instead: per core, the PIL DataLoader and a prepared folder (the
    host's gather, and the augmentation on the device) on JPEGs bench makes, beside barter's step at the first
    of --models (default deit-small) and the lowest density; says which would limit training"""
    inference: bool = False
    """time inference instead, on the CPU: the first of --models (default deit-small) at each of --densities as
    BARTER's compact start, published, and dense: batch-1 latency (one thread and all) and batch-64 throughput,
    eager (torch.inference_mode) and in ONNX Runtime, beside the multiply-add ratio"""
    out: str = "bench.json"
    """JSON output path"""


def build(model_name, method, density, batch_size, device, seed=0, cfg=None, fracs=(None, None), split=None):
    """Model, method, optimizer and one fixed batch for one configuration. split: {kind: units per block}
    of a trained run, built the way train.py resumes it (no init_model: the model has those shapes);
    cfg, fracs: that run's config and --head-frac / --mlp-frac (default: the preset, one density)."""
    torch.manual_seed(seed)
    cfg = cfg or preset(model_name)
    model = ViT(cfg, **(split or {})).to(device)
    meth = train.make_method(method, model, Schedule(total_steps=10**9, update_every=10**9), density, *fracs, seed=seed)
    if split is None:
        meth.init_model()
    opt = make_optimizer(model, 1e-4, 0.05)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g).to(device)
    y = torch.randint(0, cfg.num_classes, (batch_size,), generator=g).to(device)
    return model, meth, opt, x, y


class Config:
    def __init__(self, model_name, method, density, batch_size, device, bf16, compile, cfg=None, fracs=(None, None),
                 split=None, group=None, graph=False):
        """split: None, "start" (BARTER's start, beside a run's end) or a run's {kind: units per block}.
        graph: the step captured as a CUDA graph and replayed (Stepper)."""
        self.key = dict(model=group or model_name, method=method, density=density if method != "dense" else 1.0,
                        cuda_graph=graph)
        if split is not None:
            self.key["split"] = "start" if split == "start" else "end"
        units = split if isinstance(split, dict) else None
        self.model, self.meth, self.opt, self.x, self.y = build(model_name, method, density, batch_size, device, 0,
                                                                cfg, fracs, units)
        self.mem_spec = (model_name, method, density, batch_size, str(device), bf16, cfg, fracs, split, graph)  # for peak_memory
        self.amp = autocast(device, bf16)
        self.step = Stepper(self.model, self.meth, self.opt, self.amp, 1.0, 0.1, Graph(device) if graph else None)
        self.step.fwd = torch.compile(self.model) if compile else self.model
        self.device, self.graph, self.t, self.times = device, graph, 0, []

    def run(self, n):
        for _ in range(n):
            self.t += 1
            self.step(self.x, self.y, self.t)

    def warm_up(self, n):
        """n untimed steps, and with a graph as many more as it takes to have it captured."""
        self.run(n + (Stepper.WARMUP + 1 if self.graph else 0))

    def timed(self, n):
        sync(self.device)
        t0 = time.perf_counter()
        self.run(n)
        sync(self.device)
        self.times.append((time.perf_counter() - t0) / n)


def status_mb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024  # kB


def peak_memory(model_name, method, density, batch_size, device, bf16, cfg=None, fracs=(None, None), split=None, graph=False,
                steps=2):
    """MB of peak memory one configuration allocates (run alone: see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        # a tiny run of the same code first: libraries loaded lazily on the first step are not
        # this configuration's allocations; then reset the peak RSS (VmHWM, Linux) to the current RSS
        Config("micro", method, min(density, 0.5), 8, device, bf16, False).run(1)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = status_mb("VmRSS")
    c = Config(model_name, method, density, batch_size, device, bf16, False, cfg, fracs, split, graph=graph)
    c.warm_up(steps)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        del c
        torch.cuda.empty_cache()
        return peak
    return status_mb("VmHWM") - base


def saved_bytes(c, batch):
    """Bytes autograd keeps for backward after one eager forward on `batch` images, by the op that
    saved them. Parameters are not counted (they stay whatever the batch); a storage shared by
    several ops (a view, a tensor two ops both keep) is counted once, for the first op found."""
    params = {p.untyped_storage().data_ptr() for p in c.model.parameters()}
    with c.amp:
        loss = F.cross_entropy(c.model(c.x[:batch]), c.y[:batch])
    seen, by_op, todo, done = set(params), Counter(), [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in done:
            continue
        done.add(node)
        for name in dir(node):
            if not (name.startswith("_saved_") or name == "saved_tensors"):  # built-in ops; autograd.Function
                continue
            try:
                v = getattr(node, name)
            except RuntimeError:  # an optional tensor that was not saved
                continue
            for t in v if isinstance(v, (tuple, list)) else [v]:
                if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    by_op[re.sub(r"Backward\d*$", "", type(node).__name__)] += t.untyped_storage().nbytes()
        todo += [f for f, _ in node.next_functions]
    return by_op


def activation_mb(c):
    """MB per image of what autograd keeps for backward, by op: the part of the memory that grows with
    the batch. The difference between a forward on the whole batch and on one image, per image."""
    big, one, n = saved_bytes(c, len(c.x)), saved_bytes(c, 1), len(c.x) - 1
    by_op = {k: (big[k] - one[k]) / n / 2**20 for k in big}
    return {k: v for k, v in sorted(by_op.items(), key=lambda kv: -kv[1]) if v > 0}


def top_ops(c, steps, rows=12):
    """torch.profiler table of `steps` steps, sorted by the time ops take themselves (on the GPU, if any)."""
    cuda = c.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        c.run(steps)
        sync(c.device)
    table = prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=rows)
    return f"{c.key['model']} {label(c.key)} d={c.key['density']}, {steps} steps\n{table}"


def update_cost(c, repeats=3):
    """Seconds of one BARTER topology update at the largest fraction moved (alpha0), and with a graph the
    seconds its capture again adds: the eager warm-up steps and the capture step after the update, less
    as many replayed steps (the median timed step). Medians over `repeats`."""
    update, capture = [], []
    for _ in range(repeats):
        c.run(1)  # fresh statistics, as after a training interval
        sched, c.meth.schedule = c.meth.schedule, Schedule(total_steps=10**6, update_every=1, end_frac=1.0)
        sync(c.device)
        t0 = time.perf_counter()
        c.meth.update(c.opt, 1)
        sync(c.device)
        update.append(time.perf_counter() - t0)
        c.meth.schedule = sched
        c.step.release()  # as the Stepper does after an update step: the graph's tensors were replaced
        if c.graph:
            n = Stepper.WARMUP + 1
            t0 = time.perf_counter()
            c.run(n)
            sync(c.device)
            capture.append(time.perf_counter() - t0 - n * statistics.median(c.times))
    return statistics.median(update), statistics.median(capture) if capture else 0.0


def device_work(c, steps):
    """Per step on CUDA: GPU busy time (ms, the sum of the kernels' and copies' durations), kernels run, and
    launches the host made (a graph replay is one), from torch.profiler over `steps` steps. Where the
    profiler sees no kernel inside a replayed graph, only the launches are reported."""
    DEV = torch.autograd.DeviceType.CUDA
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        c.run(steps)
        sync(c.device)
    ev = prof.events()
    dev = [e for e in ev if e.device_type == DEV]
    kernels = [e for e in dev if not e.name.startswith(("Memcpy", "Memset"))]
    launches = [e for e in ev if e.device_type != DEV and e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                                     "cuLaunchKernelEx", "cudaGraphLaunch")]
    out = {"launches_per_step": len(launches) / steps}
    if kernels:
        out.update(gpu_busy_ms=sum(e.time_range.elapsed_us() for e in dev) / 1e3 / steps, kernels_per_step=len(kernels) / steps)
    return out


def run_group(path):
    """A barter run's configurations, at its model, density and image size: masked, BARTER's start, and
    BARTER at the units per block the run's checkpoint holds. Returns (group, model, spec, [(method, density, split)])."""
    f = os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path
    try:
        ck = weights.read_checkpoint(f)
    except weights.WeightsError as e:
        raise SystemExit(f"error: --runs {e}") from None
    a = ck["args"]
    if a["method"] != "barter":
        raise SystemExit(f"error: --runs {path!r} is a {a['method']} run: only a barter run's split moves")
    spec = dict(cfg=ViTConfig(**ck["cfg"]), fracs=(a.get("head_frac"), a.get("mlp_frac")))
    split = {"heads": list(ck["heads"]), "mlp": list(ck["mlp"])}
    d = a["dense_frac"]
    return f"{a['model']} {path}", a["model"], spec, [("masked", d, None), ("barter", d, "start"), ("barter", d, split)]


def main(a: Args):
    if (a.steps is not None and a.steps < 1) or a.rounds < 1 or a.warmup < 0 or not a.densities or not a.methods:
        raise SystemExit("error: --steps and --rounds must be positive, --densities and --methods non-empty")
    bad = [m for m in a.methods if m not in train.METHODS] + [str(d) for d in a.densities if not 0 < d <= 1]
    if bad:
        raise SystemExit(f"error: unknown method or density out of (0, 1]: {', '.join(bad)}")
    device = train.pick_device(a.device)
    if any(a.cuda_graph) and (device.type != "cuda" or a.compile):
        raise SystemExit(f"error: --cuda-graph True needs a CUDA device (this is {device}) and no --compile")
    steps = a.steps or (10 if device.type == "cuda" else 2)
    models = a.models or (() if a.runs else ("cifar-tiny", "deit-small") if device.type == "cuda" else ("cifar-tiny",))
    bf16 = a.bf16 if a.bf16 is not None else bf16_supported(device)
    machine = {**environment(device), "python": platform.python_version(), "bf16": bf16, "compile": a.compile,
               "cuda_graph": list(a.cuda_graph)}
    if a.loaders:
        return loader_bench(a, device, bf16, steps, machine)
    if a.inference:
        return inference_bench(a, machine)
    # (group, model, spec, [(method, density, split)]), split as Config takes it; dense once per model: it has no density
    groups = [(m, m, {}, [(meth, d, None) for d in a.densities for meth in a.methods if not (meth == "dense" and d != a.densities[0])])
              for m in models] + [run_group(p) for p in a.runs]
    rows, profiles = [], []
    for group in groups:
        r, p = time_group(a, device, bf16, steps, *group)
        rows, profiles = rows + r, profiles + p
    for r in rows:  # ratios against full-tensor structured DST at the same density (and the same kind of step)
        same = lambda q, graph: q["model"] == r["model"] and q["method"] == "masked" and q["density"] == r["density"] \
            and q["cuda_graph"] == graph
        ref, eager = (next((q for q in rows if same(q, g)), None) for g in (r["cuda_graph"], False))
        if ref:
            r["speedup_vs_masked"] = ref["step_ms"] / r["step_ms"]
            r["ideal_speedup"] = ref["flops_per_img"] / r["flops_per_img"]
            if "peak_mem_mb" in r:
                r["mem_vs_masked"] = r["peak_mem_mb"] / ref["peak_mem_mb"]
        if eager and r["cuda_graph"]:
            r["speedup_vs_eager_masked"] = eager["step_ms"] / r["step_ms"]
    return written(a, machine, lambda r: "\n\n".join([table(r)] + profiles), steps_per_round=steps, rows=rows, profiles=profiles)


def written(a, machine, show, **fields):
    """A bench's result (its command, machine and arguments beside `fields`) written to --out as JSON, and
    shown (show: result -> the text printed)."""
    result = {"command": "python bench.py " + " ".join(sys.argv[1:]), "machine": machine, "args": asdict(a), **fields}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(show(result))
    return result


def time_group(a, device, bf16, steps, group, model_name, spec, todo):
    """The rows of one model (or one run's group): every configuration warmed up, then timed in
    interleaved rounds, then its device work, activations, update cost and peak memory alone."""
    bs = a.batch_size or (128 if (spec.get("cfg") or preset(model_name)).img_size <= 64 else 256)
    if a.compile:
        # dynamo keeps 8 graphs of a function, then runs it eagerly: a group's configurations are
        # timed in turn, so all of them must stay compiled at once (the group before is done)
        torch.compiler.reset()
        torch._dynamo.config.recompile_limit = len(todo) + 8
    configs = [Config(model_name, m, d, bs, device, bf16, a.compile, split=split, group=group, graph=g, **spec)
               for m, d, split in todo for g in a.cuda_graph]
    for c in tqdm(configs, desc=f"{group} warm-up", leave=False, disable=None):
        c.warm_up(a.warmup)
    for _ in tqdm(range(a.rounds), desc=f"{group} rounds", leave=False, disable=None):
        for c in configs:
            c.timed(steps)
    profiles = []
    if a.profile:
        low = min(c.key["density"] for c in configs)
        profiles = [top_ops(c, steps) for c in configs if c.key["density"] == low and c.key["method"] in ("masked", "barter")]
    mine = []
    for c in configs:
        r = {**c.key, "batch_size": bs, "step_ms": 1e3 * statistics.median(c.times),
             "step_ms_min": 1e3 * min(c.times), "step_ms_max": 1e3 * max(c.times),
             "img_per_s": bs / statistics.median(c.times), "flops_per_img": c.model.flops_per_image(),
             "density_measured": c.meth.density(), "act_by_op": activation_mb(c)}
        r["act_mb_per_img"] = sum(r["act_by_op"].values())
        if device.type == "cuda":
            r.update(device_work(c, steps))
        if r["method"] in train.UNIT_METHODS:
            r["units"] = {k: c.model.counts(k) for k in ("heads", "mlp")}
        if r["method"] == "barter":
            update, capture = update_cost(c)
            r["update_ms"] = 1e3 * update
            if c.graph:  # what capturing the step again after the update adds
                r["capture_ms"] = 1e3 * capture
            cost = r["update_ms"] + r.get("capture_ms", 0.0)
            r["update_share"] = cost / (train.Args.update_every * r["step_ms"] + cost)
        mine.append((r, c.mem_spec))
    del configs, c  # free them before the memory of each configuration is measured alone
    if a.memory:
        for r, mem_spec in tqdm(mine, desc=f"{group} memory", leave=False, disable=None):
            if device.type == "cuda":
                r["peak_mem_mb"] = peak_memory(*mem_spec)
            else:
                with mp.get_context("spawn").Pool(1) as pool:
                    r["peak_mem_mb"] = pool.apply(peak_memory, mem_spec)
    return [r for r, _ in mine], profiles


# ---- the input pipelines of an image folder, per core, beside the step they feed ----------------------

LOADER_IMAGES, PREPARED_SIZE = 2000, 160  # JPEGs bench makes; the side S they are prepared at


def jpeg_folder(root, n, classes=10, seed=0):
    """An ImageNet-layout folder of n training JPEGs (and a validation image per class) of ImageNet's typical
    size, 500 x 375 (a quarter of them portrait): smooth random scenes with grain, at quality 90."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    for split, count in (("train", n), ("val", classes)):
        for i in range(count):
            folder = os.path.join(root, split, f"class{i % classes}")
            os.makedirs(folder, exist_ok=True)
            h, w = (375, 500) if i % 4 else (500, 375)
            scene = F.interpolate(torch.rand(1, 3, h // 25, w // 25, generator=g), size=(h, w), mode="bicubic")[0]
            px = ((scene + 0.05 * torch.randn(3, h, w, generator=g)).clamp(0, 1) * 255).to(torch.uint8)
            Image.fromarray(px.permute(1, 2, 0).contiguous().numpy()).save(os.path.join(folder, f"{i}.JPEG"), quality=90)


def per_second(fn, images, device):
    """Images per second of fn(), which handles `images` images, timed once (synchronised on CUDA)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return images / (time.perf_counter() - t0)


def loader_bench(a, device, bf16, steps, machine):
    """The rows of --loaders: img/s per core of the PIL path (decode, RandomResizedCrop, flip, ToTensor,
    Normalize: all on the host), of a prepared folder's host work (the gather into a batch buffer, from
    the page cache) and of its augmentation on `device` (one core on the CPU), and barter's step."""
    import tempfile

    import data

    model = (a.models or ("deit-small",))[0]
    img, density = preset(model).img_size, min(a.densities)
    bs = a.batch_size or (128 if img <= 64 else 256)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "jpegs"), os.path.join(tmp, "prepared")
        print(f"making {LOADER_IMAGES} JPEGs of 500 x 375 and preparing them at {PREPARED_SIZE} px")
        jpeg_folder(src, LOADER_IMAGES)
        head = data.prepare(src, out, PREPARED_SIZE)
        torch.set_num_threads(1)  # per core: the loaders below run in this one thread
        try:
            pil = data.FolderLoader(src, img, bs, True, workers=0)
            rates = {"pil": per_second(lambda: [None for _ in pil.epoch(0)], len(pil) * bs, torch.device("cpu"))}
            prep = data.PreparedLoader(out, head, "train", img, bs, True, device=device)
            plan = list(prep.plan(0))
            rates["gather"] = per_second(lambda: [prep.gather(0, i, b) for i, b in plan], len(plan) * bs, torch.device("cpu"))
            x, _, d = (t.to(device) for t in prep.slots[0])
            prep.augment(x, d)  # warm-up
            rates["augment"] = per_second(lambda: [prep.augment(x, d) for _ in range(3)], 3 * bs, device)
        finally:
            torch.set_num_threads(threads)
    c = Config(model, "barter", density, bs, device, bf16, a.compile)
    c.warm_up(a.warmup)
    for _ in range(a.rounds):
        c.timed(steps)
    step = bs / statistics.median(c.times)
    rows = [{"pipeline": "pil", "what": "PIL DataLoader: decode, RandomResizedCrop, flip, ToTensor, Normalize", "where": "host"},
            {"pipeline": "gather", "what": "prepared: gather into the batch buffer", "where": "host"},
            {"pipeline": "augment", "what": "prepared: crop, resize, flip, normalise in a few batched kernels", "where": str(device)}]
    for r in rows:
        r.update(img_per_s_per_core=rates[r["pipeline"]], cores_to_feed_step=step / rates[r["pipeline"]])
    return written(a, machine, loader_table, model=model, density=density, batch_size=bs, img_size=img,
                   prepared_size=PREPARED_SIZE, step_img_per_s=step, rows=rows)


def loader_table(result):
    lines = [f"{result['machine']['device']}, torch {result['machine']['torch']}: {result['model']} at {result['img_size']} px, batch "
             f"{result['batch_size']}; prepared at {result['prepared_size']} px; barter's step at d = {result['density']}: "
             f"{result['step_img_per_s']:.0f} img/s", "",
             "| pipeline | where | img/s per core | step's img/s over it |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['where']} | {r['img_per_s_per_core']:.0f} | {r['cores_to_feed_step']:.2f} |" for r in result["rows"]]
    host = {r["pipeline"]: r for r in result["rows"]}
    lines += ["", "The last column: on the host, the cores it takes to feed the step; on a GPU, the share of the step's "
              "time the augmentation adds.", f"Host work per image: {1e3 / host['pil']['img_per_s_per_core']:.3f} ms on the PIL path, "
              f"{1e3 / host['gather']['img_per_s_per_core']:.4f} ms prepared ({host['gather']['img_per_s_per_core'] / host['pil']['img_per_s_per_core']:.0f}x less). "
              f"Fed by one core, the {'PIL path' if host['pil']['cores_to_feed_step'] > 1 else 'step'} would be the limit on the PIL "
              f"path and the {'loader' if host['gather']['cores_to_feed_step'] > 1 else 'step'} on the prepared one."]
    return "\n".join(lines)


# ---- a trained model answering: the compact model against the dense one, eager and in ONNX Runtime -------

INFER_BATCH, INFER_CALLS = 64, 10  # the throughput batch; batch-1 calls averaged into one sample of a round


def inference_bench(a, machine):
    """The rows of --inference: per (density, backend), the median over --rounds interleaved rounds of the
    batch-1 latency (one thread, all threads) and the batch-64 throughput (all threads)."""
    import tempfile

    import onnxruntime as ort

    import export

    name = (a.models or ("deit-small",))[0]
    models = [(d, weights.publishable(build(name, "barter", d, 1, "cpu")[0])) for d in sorted(set(a.densities)) if d < 1]
    torch.manual_seed(0)
    models.append((1.0, ViT(preset(name)).eval()))
    threads = torch.get_num_threads()
    configs = []  # (key, {threads: runner}); a runner maps a batch to logits
    with tempfile.TemporaryDirectory() as tmp:
        for d, m in models:
            def eager(n, m=m):
                def run(x):
                    torch.set_num_threads(n)
                    with torch.inference_mode():
                        return m(x)
                return run
            folder = os.path.join(tmp, str(d))
            os.makedirs(folder)
            path = export.write_onnx(m, folder)  # checked against the eager logits
            sessions = {}
            for n in (1, threads):
                opt = ort.SessionOptions()
                opt.intra_op_num_threads, opt.inter_op_num_threads = n, 1
                opt.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no spinning into eager's turn
                sessions[n] = ort.InferenceSession(path, opt, providers=["CPUExecutionProvider"])
            onnx = lambda n, s=sessions: (lambda x: s[n].run(None, {"images": x.numpy()})[0])
            key = {"model": name, "density": d, "params": sum(p.numel() for p in m.parameters()),
                   "heads": sum(m.counts("heads")), "mlp": sum(m.counts("mlp")), "flops_per_img": m.flops_per_image()}
            configs += [({**key, "backend": "eager"}, {n: eager(n) for n in (1, threads)}),
                        ({**key, "backend": "onnxruntime"}, {n: onnx(n) for n in (1, threads)})]
        one, batch = export.images(models[0][1], 1), export.images(models[0][1], INFER_BATCH)
        samples = {id(k): {"b1_1": [], "b1_all": [], "b64": []} for k, _ in configs}
        try:
            for _ in tqdm(range(a.rounds + 1), desc="inference rounds", leave=False, disable=None):  # the first: warm-up
                for key, run in configs:
                    got = samples[id(key)]
                    for metric, n, x, calls in (("b1_1", 1, one, INFER_CALLS), ("b1_all", threads, one, INFER_CALLS),
                                                ("b64", threads, batch, 1)):
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            run[n](x)
                        got[metric].append((time.perf_counter() - t0) / calls)
        finally:
            torch.set_num_threads(threads)  # what eager() changed
    rows = []
    for key, _ in configs:
        got = {k: v[1:] for k, v in samples[id(key)].items()}  # without the warm-up round
        rows.append({**key, "threads": threads, "b1_ms_1thread": 1e3 * statistics.median(got["b1_1"]),
                     "b1_ms_all": 1e3 * statistics.median(got["b1_all"]),
                     "b64_img_per_s": INFER_BATCH / statistics.median(got["b64"]),
                     "spread": {k: [1e3 * min(v), 1e3 * max(v)] for k, v in got.items()}})
    for r in rows:  # against the dense model in the same backend
        dense = next(q for q in rows if q["density"] == 1.0 and q["backend"] == r["backend"])
        r.update(macs_ratio=dense["flops_per_img"] / r["flops_per_img"], b1_speedup=dense["b1_ms_1thread"] / r["b1_ms_1thread"],
                 b64_speedup=r["b64_img_per_s"] / dense["b64_img_per_s"])
    return written(a, machine, inference_table, batch=INFER_BATCH, rows=rows)


def inference_table(result):
    rows, t = result["rows"], result["rows"][0]["threads"]
    lines = [f"{result['machine']['device']}, torch {result['machine']['torch']}: {rows[0]['model']}, median over "
             f"{result['args']['rounds']} interleaved rounds (min-max)", "",
             f"| density | backend | parameters | multiply-adds vs dense | batch 1, 1 thread ms | batch 1, {t} threads ms | "
             f"batch {result['batch']}, {t} threads img/s | vs dense: batch 1, 1 thread / batch {result['batch']} |",
             "|---" * 8 + "|"]
    for r in rows:
        sp = r["spread"]
        lines.append(f"| {r['density']} | {r['backend']} | {r['params'] / 1e6:.2f} M | {1 / r['macs_ratio']:.3f} ({r['macs_ratio']:.2f}x fewer) | "
                     f"{r['b1_ms_1thread']:.2f} ({sp['b1_1'][0]:.2f}-{sp['b1_1'][1]:.2f}) | {r['b1_ms_all']:.2f} "
                     f"({sp['b1_all'][0]:.2f}-{sp['b1_all'][1]:.2f}) | {r['b64_img_per_s']:.0f} | "
                     f"{r['b1_speedup']:.2f}x / {r['b64_speedup']:.2f}x |")
    return "\n".join(lines)


def label(r):
    """A row's method, '(graph)' for a captured step, and for a run's rows which split:
    'barter (end: 17 heads + 374 channels)'."""
    name = r["method"] + (" (graph)" if r.get("cuda_graph") else "")
    if "split" not in r:
        return name
    u = r.get("units")
    return f"{name} ({r['split']}" + (f": {sum(u['heads'])} heads + {sum(u['mlp'])} channels)" if u else ")")


def table(result):
    m, rows = result["machine"], result["rows"]
    f = lambda r, k, fmt, unit="": format(r[k], fmt) + unit if k in r else "-"
    has = lambda k: any(k in r for r in rows)
    upd = lambda r: (f"{r['update_ms'] + r.get('capture_ms', 0):.1f} ({100 * r['update_share']:.2f}%)" if "update_ms" in r else "-")
    columns = [("model", lambda r: r["model"]), ("method", label), ("density", lambda r: str(r["density"]))]
    columns += [("step ms (min-max)", lambda r: f"{r['step_ms']:.1f} ({r['step_ms_min']:.1f}-{r['step_ms_max']:.1f})"),
                ("img/s", lambda r: f"{r['img_per_s']:.0f}")]
    columns += [("GPU busy ms", lambda r: f(r, "gpu_busy_ms", ".1f")),
                ("kernels / launches per step", lambda r: f"{f(r, 'kernels_per_step', '.0f')} / {f(r, 'launches_per_step', '.0f')}")] \
        if has("gpu_busy_ms") else []
    columns += [("peak MB", lambda r: f(r, "peak_mem_mb", ".0f")), ("act MB/img", lambda r: f"{r['act_mb_per_img']:.2f}"),
                ("speedup vs masked", lambda r: f(r, "speedup_vs_masked", ".2f", "x"))]
    columns += [("vs eager masked", lambda r: f(r, "speedup_vs_eager_masked", ".2f", "x"))] if has("speedup_vs_eager_masked") else []
    columns += [("ideal (FLOPs)", lambda r: f(r, "ideal_speedup", ".2f", "x")), ("memory vs masked", lambda r: f(r, "mem_vs_masked", ".2f")),
                ("update" + (" + capture" if has("capture_ms") else "") + " ms (share)", upd)]
    lines = [f"{m['device']}, {m['cpu_threads']} threads, torch {m['torch']}, bf16 {m['bf16']}, compile {m['compile']}; "
             f"median over {result['args']['rounds']} interleaved rounds of {result['steps_per_round']} steps (min-max)", "",
             "| " + " | ".join(h for h, _ in columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(fn(r) for _, fn in columns) + " |" for r in rows]
    # what the activation memory consists of, at the lowest density: which op keeps what for backward
    for model in dict.fromkeys(r["model"] for r in rows):  # (a captured step keeps what the eager one keeps)
        low = min(r["density"] for r in rows if r["model"] == model)
        cols = [r for r in rows if r["model"] == model and r["density"] == low and r.get("cuda_graph") == rows[0].get("cuda_graph")]
        most = {op: max(r["act_by_op"].get(op, 0) for r in cols) for r in cols for op in r["act_by_op"]}
        ops = sorted((op for op in most if most[op] >= 0.005), key=lambda op: -most[op])  # 0.00 everywhere: left out
        lines += ["", f"{model}, density {low}: MB per image that autograd keeps for backward, by op", "",
                  "| op | " + " | ".join(label(r) for r in cols) + " |", "|---" * (len(cols) + 1) + "|"]
        lines += [f"| {op} | " + " | ".join(f"{r['act_by_op'].get(op, 0):.2f}" for r in cols) + " |" for op in ops]
    return "\n".join(lines)


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
