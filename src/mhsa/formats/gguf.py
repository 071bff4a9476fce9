"""Read a GGUF file (llama.cpp's format) into a transformers-style config and state dict.

GGUF keeps the model's hyperparameters as metadata under llama.cpp's key names
(`llama.embedding_length`, ...) and its tensors under llama.cpp's names (`blk.0.attn_q.weight`),
many of them quantised in blocks (Q4_0, Q8_0, K-quants...). `read_gguf` turns both into what
a transformers checkpoint of the same model holds:

    model = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    model.config        {"model_type": "llama", "hidden_size": 576, ...}  (a config.json)
    model.state_dict    {"model.layers.0.self_attn.q_proj.weight": tensor, ...}
    model.raw(name)     the stored blocks of one tensor, for weight-only quantised matmuls

Parsing and dequantisation are the `gguf` package's own (GGUFReader, gguf.quants); this file
only renames, reshapes and checks. One fact it must undo: llama.cpp's converter reorders the
rows of every llama q and k projection, head by head, from rotary "halves" (HF: the first half
of a head's dimensions pairs with the second) to "interleaved" pairs (GGUF: dimensions 2i and
2i + 1 pair). `_unpermute_rows` gives the inverse row order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .gguf_config import ARCHITECTURES, check_sizes, hf_config
from .gguf_tokenizer import GGUFTokenizer
from .weights import NameTable, Rule, read_tensors

GGUF_MAGIC = b"GGUF"
INSTALL_HINT = "pip install gguf (or pip install 'mhsa[chat]')"


# transformers' names <-> llama.cpp's (what gguf-py's tensor map says for the Llama family)
GGUF_NAMES = NameTable(
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    Rule("model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias", optional=True),
    Rule("model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias", optional=True),
    Rule("model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias", optional=True),
    Rule("model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias", optional=True),
    Rule("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", optional=True),
    Rule("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", optional=True),
    ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
    ignore=("rope_freqs.weight",),  # read apart: not a weight (see read_gguf)
)
# llama.cpp stores Llama 3's scaled rotary frequencies as a tensor; not a model weight
ROPE_FREQS = "rope_freqs.weight"


def _gguf():
    try:
        import gguf
    except ImportError as error:
        raise ImportError(f"reading GGUF files needs the gguf package: {INSTALL_HINT}") from error
    return gguf


@dataclass(frozen=True)
class RawTensor:
    """One tensor as stored: `ggml_type` (a gguf.GGMLQuantizationType: F32, Q4_0, Q8_0...),
    `data` (numpy; for block-quantised types uint8 of shape (rows, bytes per row), otherwise the
    values in `shape`) and `shape`, the logical (rows, columns) in torch order. Rows of q and k
    projections are already in transformers' order."""

    ggml_type: Any
    data: np.ndarray
    shape: tuple[int, ...]


@dataclass
class GGUFModel:
    """What `read_gguf` returns: the transformers `config` dict, the `state_dict` under
    transformers' names, the file's `metadata` (key -> value, arrays as lists) and the
    `architecture` as the file names it. `rope_freqs` holds llama.cpp's per-frequency rotary
    divisors when the file has them (Llama 3.1 and later), else None; the config then
    carries them as rope_scaling {"rope_type": "factors", "factors": [...]}."""

    path: Path
    architecture: str
    config: dict[str, Any]
    state_dict: dict[str, Tensor]
    metadata: dict[str, Any]
    rope_freqs: Tensor | None = None
    _tensors: dict[str, Any] = field(default_factory=dict, repr=False)  # HF name -> ReaderTensor

    def raw(self, name: str) -> RawTensor:
        """The stored (possibly quantised) data of the tensor transformers calls `name`,
        q/k rows un-permuted like the state dict's. The array is a read-only view of the
        memory-mapped file except for q/k projections, which are reordered copies."""
        if name not in self._tensors:
            raise KeyError(f"{name!r} is not a tensor of {self.path.name}; known: state_dict keys")
        tensor = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        data = tensor.data
        rows = _row_order(name, shape[0], self.config, self.architecture)
        if rows is not None:
            data = np.ascontiguousarray(data[rows.numpy()])
        return RawTensor(tensor.tensor_type, data, shape)

    def tokenizer(self) -> GGUFTokenizer:
        """The tokenizer the metadata describes (see formats.gguf_tokenizer.GGUFTokenizer)."""
        return GGUFTokenizer(self.metadata, source=str(self.path))


def _open(path: str | Path):
    """A gguf.GGUFReader for `path`, with one-line errors for the usual ways a file is bad."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; pass the path of a .gguf model file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r}); "
            "pass a .gguf model, e.g. one converted with llama.cpp's convert_hf_to_gguf.py"
        )
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError) as error:
        raise ValueError(
            f"{path}: truncated or damaged GGUF file ({error}); download or convert it again"
        ) from None
    if reader.byte_order != "I":  # gguf's reader would hand over byte-swapped arrays
        raise ValueError(
            f"{path}: a GGUF file in the other byte order (big- vs little-endian) than this "
            "machine's; convert the model again for this machine"
        )
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + int(tensor.n_bytes) > size:
            raise ValueError(
                f"{path}: truncated GGUF file (tensor {tensor.name!r} ends at byte "
                f"{tensor.data_offset + int(tensor.n_bytes)}, the file has {size}); "
                "download or convert it again"
            )
    return reader


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of a GGUF file -> its value (arrays as lists), tensors not read."""
    return _metadata(_open(path), path)


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The tokenizer of a GGUF file (encode, decode, stream, render_chat), tensors not read."""
    return GGUFTokenizer(gguf_metadata(path), source=str(path))


def _metadata(reader, path: str | Path) -> dict[str, Any]:
    try:
        return {key: value.contents() for key, value in reader.fields.items()}
    except UnicodeDecodeError as error:  # strings are decoded here, not when the file is read
        raise ValueError(
            f"{path}: damaged GGUF metadata, a string that is not UTF-8 ({error}); "
            "download or convert it again"
        ) from None


def _expected_shape(name: str, config: dict[str, Any]) -> tuple[int, ...]:
    """The torch shape transformers gives the parameter `name` under `config`."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes = {
        "embed_tokens": (config["vocab_size"], hidden),
        "lm_head": (config["vocab_size"], hidden),
        "norm": (hidden,),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "q_proj": (q_rows, hidden),
        "k_proj": (kv_rows, hidden),
        "v_proj": (kv_rows, hidden),
        "o_proj": (hidden, q_rows),
        "q_norm": (config["head_dim"],),
        "k_norm": (config["head_dim"],),
        "gate_proj": (inner, hidden),
        "up_proj": (inner, hidden),
        "down_proj": (hidden, inner),
    }
    module, suffix = name.rsplit(".", 2)[-2:]
    shape = shapes[module]
    return shape[:1] if suffix == "bias" else shape


def _unpermute_rows(rows: int, num_heads: int) -> Tensor:
    """Index that takes llama.cpp's q/k row order to transformers': within each head, GGUF
    row 2i + j holds HF row j * head_dim / 2 + i (j in {0, 1})."""
    half = rows // num_heads // 2
    return torch.arange(rows).view(num_heads, half, 2).transpose(1, 2).reshape(rows)


def _row_order(name: str, rows: int, config: dict[str, Any], arch: str) -> Tensor | None:
    if not ARCHITECTURES[arch][1]:
        return None
    if ".self_attn.q_proj." in name:
        return _unpermute_rows(rows, config["num_attention_heads"])
    if ".self_attn.k_proj." in name:
        return _unpermute_rows(rows, config["num_key_value_heads"])
    return None


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def _dequantize(tensor, source: str) -> np.ndarray:
    gguf = _gguf()
    if tensor.tensor_type == gguf.GGMLQuantizationType.F64:
        return np.asarray(tensor.data)  # (stored as it is; the gguf package has no path)
    try:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"{source}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which the "
            f"gguf package (version {_version('gguf')}) cannot dequantise; "
            "upgrade gguf or use a file quantised as F16, Q8_0, Q4_K_M or similar"
        ) from None


def read_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
) -> GGUFModel:
    """Read a GGUF model file into a transformers-style config and state dict.

    Every tensor is dequantised by the gguf package to float32, then cast to `dtype` (a
    floating dtype: float32, bfloat16 or float16). Names and shapes are checked against the
    config before anything is dequantised; progress(done, total) follows the tensors
    read. Raises ValueError for a file that is not GGUF, is truncated, or holds an
    architecture, tensor or quantisation type we do not support.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"dtype={dtype!r} is not a floating dtype; pass torch.float32 or torch.bfloat16"
        )
    path = Path(path)
    reader = _open(path)
    metadata = _metadata(reader, path)
    names = {tensor.name for tensor in reader.tensors}
    config = hf_config(metadata, names, source=str(path))
    arch = metadata["general.architecture"]
    source = _GGUFTensors(reader, path, config, arch)
    check_sizes(config, source.shapes(), arch, str(path))  # (before a size drives a loop)
    rope_freqs = None
    if ROPE_FREQS in names:
        rope_freqs = torch.from_numpy(np.array(source.dequantised(ROPE_FREQS))).float()
        if config["rope_scaling"] is not None:
            raise ValueError(
                f"{path}: the file holds both rope scaling metadata "
                f"({config['rope_scaling']['rope_type']}) and rope_freqs, which we do not "
                "combine"
            )
        # llama.cpp divides each rotary frequency by its factor (Llama 3.1's llama3
        # scaling, written out by the converter): the model must do the same
        config["rope_scaling"] = {"rope_type": "factors", "factors": rope_freqs.tolist()}
    expected = {name: _expected_shape(name, config) for name in _possible_names(config)}
    fix = f"a damaged or inconsistent GGUF file, or a {arch} variant we do not support"
    state_dict = read_tensors(
        source,
        GGUF_NAMES,
        expected,
        dtype=dtype,
        expected_by="the metadata",
        fix=fix,
        progress=progress,
    )
    by_name = {GGUF_NAMES.param_names(t.name)[0]: t for t in reader.tensors if t.name != ROPE_FREQS}
    return GGUFModel(path, arch, config, state_dict, metadata, rope_freqs, by_name)


class _GGUFTensors:
    """A GGUF file's tensors as a TensorSource (formats.weights): shapes in torch order
    from the tensor infos; each read dequantised to float32 by the gguf package, q/k rows
    in transformers' order."""

    def __init__(self, reader, path: Path, config: dict[str, Any], arch: str) -> None:
        self.name, self.config, self.arch = str(path), config, arch
        self.tensors = {tensor.name: tensor for tensor in reader.tensors}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            name: tuple(int(d) for d in reversed(tensor.shape.tolist()))
            for name, tensor in self.tensors.items()
        }

    def dequantised(self, name: str) -> np.ndarray:
        values = _dequantize(self.tensors[name], self.name)
        if not np.isfinite(values).all():
            raise ValueError(
                f"{self.name}: tensor {name!r} holds NaN or infinite values: a damaged GGUF "
                "file; download or convert it again"
            )
        return values

    def read(self, name: str) -> Tensor:
        (hf,) = GGUF_NAMES.param_names(name)
        values = torch.from_numpy(np.array(self.dequantised(name), dtype=np.float32))
        values = values.reshape(_expected_shape(hf, self.config))
        rows = _row_order(hf, values.shape[0], self.config, self.arch)
        return (values if rows is None else values[rows]).contiguous()


def _required_names(config: dict[str, Any]) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        names.append("lm_head.weight")
    for layer in range(config["num_hidden_layers"]):
        for module in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            names.append(f"model.layers.{layer}.{module}.weight")
    return names


def _possible_names(config: dict[str, Any]) -> list[str]:
    """Every transformers name a file of this config may hold: the required ones, the
    attention biases and the q/k norms (Qwen2, Qwen3)."""
    names = _required_names(config)
    for layer in range(config["num_hidden_layers"]):
        for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"model.layers.{layer}.self_attn.{module}.bias")
        for module in ("q_norm", "k_norm"):
            names.append(f"model.layers.{layer}.self_attn.{module}.weight")
    return names
