"""The encoders as graphs: torch.export programs and ONNX files, with dynamic axes.

    "minilm" or a Bert   input_ids (batch, seq) int64, attention_mask (batch, seq) int64
                         (1 = a real token) -> embeddings (batch, hidden): mean-pooled
                         over real tokens and L2-normalised, as mhsa.apps.embed.SentenceEncoder
    a ViT                images (batch, channels, size, size) float32 -> logits
                         (batch, classes); size is the model's image_size

batch is dynamic, and seq too (1 to the model's max_len). Attention is traced
through the sdpa backend, torch's scaled_dot_product_attention, which ONNX exports;
the flash engine's tiled loops are not traceable. ONNX export needs onnx and
onnxscript (pip install 'mhsa[export]'); checking a file needs onnxruntime.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from ..core.backends import use_backend
from ..models.bert import Bert, mean_pool
from ..models.vit import ViT
from .embed import minilm_directory

MODELS = ("minilm",)  # by name; a ViT comes as a module (e.g. from a `mhsa train vit` checkpoint)
AXES = {"input_ids": ("batch", "seq"), "attention_mask": ("batch", "seq"), "images": ("batch",)}
OUTPUTS = {"input_ids": "embeddings", "images": "logits"}  # named after the first input


class SentenceEmbedding(nn.Module):
    """A Bert with SentenceEncoder's pooling: (input_ids, attention_mask) (B, S) ->
    unit-length embeddings (B, hidden)."""

    def __init__(self, bert: Bert) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return mean_pool(self.bert(input_ids, attention_mask), attention_mask)


@dataclass
class Exportable:
    """A module ready to trace, with example inputs and their dynamic axes."""

    module: nn.Module
    inputs: dict[str, Tensor]
    dynamic_shapes: dict[str, dict[int, Dim]]


def exportable(model: str | nn.Module) -> Exportable:
    """The module to trace for "minilm", a Bert (or SentenceEmbedding) or a ViT in eval
    mode; example inputs are a padded batch of 2 x min(16, max_len) tokens (a BERT of
    max_len < 2 is refused: its length could not stay dynamic) or 2 images."""
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(
                f"model must be one of {list(MODELS)} or a Bert or ViT module (a ViT: load "
                f"a `mhsa train vit` checkpoint, or `mhsa export onnx --model vit "
                f"--checkpoint DIR`), got {model!r}"
            )
        model = Bert.from_pretrained(minilm_directory())
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a name ({', '.join(MODELS)}) or a Bert or ViT module, "
            f"got {type(model).__name__}"
        )
    if model.training:
        raise ValueError("model is in training mode (dropout would be traced): call model.eval()")
    if isinstance(model, Bert):
        model = SentenceEmbedding(model).eval()
    if isinstance(model, SentenceEmbedding):
        max_len = model.bert.config.max_len
        if max_len < 2:
            raise ValueError(
                f"max_len {max_len}: a BERT exports with a dynamic length only if it "
                "takes at least 2 tokens"
            )
        batch, seq = Dim("batch", min=1), Dim("seq", min=1, max=max_len)
        axes = {0: batch, 1: seq}
        # traced at a length inside seq's range; 2 or more, or torch.export fixes it
        inputs = example_inputs(model, batch=2, length=min(16, max_len))
        return Exportable(model, inputs, {"input_ids": axes, "attention_mask": axes})
    if isinstance(model, ViT):
        inputs = example_inputs(model, batch=2)
        return Exportable(model, inputs, {"images": {0: Dim("batch", min=1)}})
    raise TypeError(
        f"model must be a Bert, SentenceEmbedding or ViT module, got {type(model).__name__}"
    )


def example_inputs(
    model: nn.Module, batch: int, length: int = 16, seed: int = 0
) -> dict[str, Tensor]:
    """Inputs for `model` (a SentenceEmbedding or a ViT): random token ids (batch, length)
    with sequence i padded to a length from `length` down to about half of it, or
    random images (batch, channels, size, size)."""
    generator = torch.Generator().manual_seed(seed)
    if isinstance(model, ViT):
        c, size = model.config.channels, model.config.image_size
        return {"images": torch.randn(batch, c, size, size, generator=generator)}
    config = model.bert.config
    ids = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
    lengths = torch.linspace(length, max(1, length // 2), batch).round().long()
    mask = (torch.arange(length) < lengths[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, config.pad_token_id), "attention_mask": mask}


def export_program(model: str | nn.Module) -> ExportedProgram:
    """torch.export.export of "minilm", a Bert or a ViT (see the module docstring) with
    dynamic batch (and sequence) axes, attention through the sdpa backend."""
    ready = exportable(model)
    with use_backend("sdpa"), torch.no_grad():
        return torch.export.export(
            ready.module, (), kwargs=ready.inputs, dynamic_shapes=ready.dynamic_shapes
        )


def _require(module: str, pip: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{module} is not installed: pip install {pip}")


def export_onnx(
    model: str | nn.Module | ExportedProgram, path: str | Path, *, overwrite: bool = False
) -> Path:
    """Write `model` ("minilm", a Bert, a ViT, or a program from export_program) to the
    ONNX file `path` (one file, weights inside), atomically: written in a temporary
    folder beside it, then renamed. An existing file is replaced only with overwrite."""
    path = Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"path must name a .onnx file, got {str(path)!r}")
    if path.is_dir():  # a folder is never replaced, overwrite or not
        raise ValueError(f"{path} is a folder: name a .onnx file to write")
    if path.exists() and not overwrite:
        raise ValueError(f"{path} exists: pass overwrite=True (--overwrite) to replace it")
    for module in ("onnx", "onnxscript"):
        _require(module, "onnx onnxscript (or pip install 'mhsa[export]')")
    program = model if isinstance(model, ExportedProgram) else export_program(model)
    names = program.graph_signature.user_inputs
    onnx_program = torch.onnx.export(
        program,
        dynamo=True,
        optimize=True,
        verbose=False,
        output_names=[OUTPUTS[names[0]]] if names and names[0] in OUTPUTS else None,
    )
    renamed = {}
    for value in onnx_program.model.graph.inputs:  # s0, s1 ... -> batch, seq
        for dim, axis in zip(value.shape, AXES.get(value.name, ()), strict=False):
            if not isinstance(dim, int):
                renamed[dim] = axis
    onnx_program.rename_axes(renamed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=path.parent))
    try:
        onnx_program.save(tmp / path.name, external_data=False)
        with open(tmp / path.name, "rb") as f:
            os.fsync(f.fileno())
        if path.exists() and not overwrite:  # appeared meanwhile: keep it
            raise ValueError(f"{path} exists: pass overwrite=True (--overwrite) to replace it")
        os.replace(tmp / path.name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def run_onnx(path: str | Path, inputs: dict[str, Tensor]) -> Tensor:
    """The output of the ONNX file `path` on `inputs` (named as its inputs), run in
    onnxruntime on the CPU."""
    _require("onnxruntime", "onnxruntime")
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {name: t.numpy() for name, t in inputs.items()}
    return torch.from_numpy(session.run(None, feeds)[0])


def onnx_difference(path: str | Path, model: str | nn.Module, inputs: dict[str, Tensor]) -> float:
    """Largest absolute difference between the ONNX file in onnxruntime and `model`
    in eager mode (backend "auto") on `inputs`."""
    module = exportable(model).module
    with torch.no_grad():
        ours = module(**inputs)
    return (run_onnx(path, inputs).double() - ours.double()).abs().max().item()


__all__ = [
    "Exportable",
    "SentenceEmbedding",
    "example_inputs",
    "export_onnx",
    "export_program",
    "exportable",
    "onnx_difference",
    "run_onnx",
]
