"""
A trained model for runtimes: `python export.py SOURCE --out DIR`. SOURCE is a run folder (its model/),
a published folder (weights.save_pretrained) or one of train.py's checkpoints (a masked run's compacted
to the units its masks keep). DIR gets, for any batch size:
  model.pt2   torch.export's program: torch.export.load(path).module() runs it in any PyTorch
  model.onnx  ONNX, for ONNX Runtime on servers and CPUs
  model.pte   ExecuTorch with the XNNPACK backend, for phones (where the executorch package is installed)
Each file is checked once written: its logits on a few images at batch 1 and 8 against the eager model's.
"""
import os
import sys
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

import weights

FORMATS = ("pt2", "onnx", "pte")
TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # float32: a runtime may sum in another order
PTE_MAX_BATCH = 64  # ExecuTorch plans its memory for the largest batch it will see


@dataclass
class Args:
    source: tyro.conf.Positional[str]
    """a run folder, a published folder (config.json + model.safetensors) or a checkpoint.pt"""
    out: str = "export"
    """the folder to write the exported files to"""
    formats: tuple[Literal["pt2", "onnx", "pte"], ...] = FORMATS
    """what to write: pt2 (torch.export), onnx, pte (ExecuTorch, XNNPACK; needs the executorch package)"""


def load_source(path):
    """The model to export (a plain ViT in eval mode, on the CPU), or one line saying why not."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "checkpoint.pt")):
            return weights.from_pretrained(weights.model_folder(path))
        if os.path.isfile(os.path.join(path, "model", "config.json")):  # a finished run
            return weights.from_pretrained(os.path.join(path, "model"))
        path = os.path.join(path, "checkpoint.pt")  # a run stopped before its end
    ckpt = weights.read_checkpoint(path)
    model = weights.from_checkpoint(ckpt).eval()
    return weights.publishable(model, ckpt["method"]["active"]) if ckpt["args"].get("method") == "masked" else model


def images(model, n, seed=0):
    c = model.cfg
    return torch.randn(n, c.in_chans, c.img_size, c.img_size, generator=torch.Generator().manual_seed(seed))


def program(model, max_batch=None):
    """torch.export's program of the model, its batch dimension dynamic (at most max_batch, where given)."""
    batch = torch.export.Dim("batch", min=1, max=max_batch) if max_batch else torch.export.Dim("batch", min=1)
    with torch.no_grad():
        return torch.export.export(model, (images(model, 2),), dynamic_shapes=({0: batch},))


def check(name, run, model):
    """The exported model's logits against the eager model's at batch 1 and 8 (fails with both)."""
    for n in (1, 8):
        x = images(model, n, seed=n)
        with torch.inference_mode():
            want = model(x)
        got = torch.as_tensor(run(x))
        if got.shape != want.shape or not torch.allclose(got, want, **TOLERANCE):
            raise AssertionError(f"{name}: logits at batch {n} differ from the eager model's by up to "
                                 f"{(got - want).abs().max().item() if got.shape == want.shape else got.shape}")


def write_pt2(model, out):
    path = os.path.join(out, "model.pt2")
    ep = program(model)
    ep.example_inputs = None  # else the file holds them pickled, and loading it unpickles them
    torch.export.save(ep, path)
    loaded = torch.export.load(path).module()
    check(path, lambda x: loaded(x), model)
    return path


def write_onnx(model, out):
    import onnxruntime as ort

    path = os.path.join(out, "model.onnx")
    with torch.no_grad():
        torch.onnx.export(model, (images(model, 2),), path, dynamo=True, input_names=["images"], output_names=["logits"],
                          dynamic_shapes=({0: torch.export.Dim("batch", min=1)},), verbose=False)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    check(path, lambda x: session.run(None, {"images": x.numpy()})[0], model)
    return path


def write_pte(model, out):
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
        from executorch.runtime import Runtime
    except ImportError:
        raise weights.WeightsError("model.pte needs the executorch package (pip install executorch); "
                                   "or leave pte out of --formats") from None

    path = os.path.join(out, "model.pte")
    et = to_edge_transform_and_lower(program(model, PTE_MAX_BATCH), partitioner=[XnnpackPartitioner()]).to_executorch()
    with open(path, "wb") as f:
        f.write(et.buffer)
    method = Runtime.get().load_program(path).load_method("forward")
    check(path, lambda x: method.execute([x])[0], model)
    return path


WRITERS = {"pt2": write_pt2, "onnx": write_onnx, "pte": write_pte}


def main(a: Args):
    """Export the model to every format asked for; returns {format: path}."""
    model = load_source(a.source)
    os.makedirs(a.out, exist_ok=True)
    heads, mlp = sum(model.counts("heads")), sum(model.counts("mlp"))
    print(f"{a.source}: {model.cfg.depth} blocks, {heads} heads and {mlp} MLP channels in all, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")
    written = {}
    for fmt in dict.fromkeys(a.formats):
        written[fmt] = WRITERS[fmt](model, a.out)
        print(f"wrote {written[fmt]}: logits at batch 1 and 8 equal the eager model's (to {TOLERANCE['atol']:g})")
    return written


if __name__ == "__main__":
    args = tyro.cli(Args)
    try:
        main(args)
    except weights.WeightsError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
