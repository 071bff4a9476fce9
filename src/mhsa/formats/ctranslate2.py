"""Read a CTranslate2 model.bin: named tensors in one little-endian binary file.

Layout (binary versions 4 to 6, as CTranslate2's ModelSpec._serialize writes them):

    uint32 version | string spec name | uint32 spec revision | uint32 variable count
    per variable: string name | uint8 rank | uint32 dims[rank] | uint8 dtype id
                  | uint32 byte count | raw bytes (row-major)
    uint32 alias count | per alias: string alias | string target name

A string is a uint16 length (counting a trailing NUL), the UTF-8 bytes, then the NUL.
An alias names a variable stored once under another name (tied weights). Quantized
models store integer weights `w` with a `w_scale` beside them: float = w / scale.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import torch
from torch import Tensor

# CTranslate2's dtype ids, in its order: float32, int8, int16, int32, float16, bfloat16
DTYPES = (torch.float32, torch.int8, torch.int16, torch.int32, torch.float16, torch.bfloat16)
VERSIONS = (4, 5, 6)


class _Reader:
    """Little-endian numbers and strings from a byte buffer, with a clear truncation error."""

    def __init__(self, data: bytes, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    def take(self, size: int) -> bytes:
        if self.pos + size > len(self.data):
            raise ValueError(
                f"{self.path}: truncated CTranslate2 model (wanted {size} bytes at offset "
                f"{self.pos}, the file has {len(self.data)}); download or convert it again"
            )
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def number(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        start = self.pos
        raw = self.take(self.number("H"))[:-1]  # drop the trailing NUL
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                f"{self.path}: the name at offset {start} is not valid UTF-8: a damaged "
                "CTranslate2 model; download or convert it again"
            ) from None

    def header(self) -> tuple[int, str, int]:
        version = self.number("I")
        if version not in VERSIONS:
            raise ValueError(
                f"{self.path}: CTranslate2 binary version {version} is not supported "
                f"(supported: {VERSIONS}); convert the model again with ctranslate2 >= 3"
            )
        return version, self.string(), self.number("I")


def _check_one_float_type(tensors: dict[str, Tensor], path: Path) -> None:
    """A converter stores every float variable (quantization scales aside) in one float
    type; a second one means a flipped dtype id, whose bytes would load as garbage."""
    kinds: dict[torch.dtype, str] = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not name.endswith("_scale"):
            kinds.setdefault(tensor.dtype, name)
    if len(kinds) > 1:
        found = ", ".join(f"{name!r} is {dtype}" for dtype, name in kinds.items())
        raise ValueError(
            f"{path}: float variables stored in {len(kinds)} types ({found}); a converter "
            "writes one: a damaged CTranslate2 model"
        )


def _model_file(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / "model.bin"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; pass a CTranslate2 model.bin or its folder")
    return path


def ctranslate2_header(path: str | Path) -> tuple[int, str, int]:
    """(binary version, spec name such as "WhisperSpec", spec revision) of a model.bin."""
    path = _model_file(path)
    with open(path, "rb") as f:
        return _Reader(f.read(4096), path).header()


def read_ctranslate2(
    path: str | Path, dtype: torch.dtype | None = torch.float32
) -> dict[str, Tensor]:
    """name -> tensor for every variable of a CTranslate2 model.bin (or its folder).

    Floating-point variables are converted to `dtype` (None keeps the stored dtype);
    quantized weights are dequantized to it (their `_scale` entries are dropped);
    other integer variables (flags, head counts) keep their dtype. Aliases map to the
    same tensor object as their target.
    """
    path = _model_file(path)
    reader = _Reader(path.read_bytes(), path)
    reader.header()
    tensors: dict[str, Tensor] = {}
    for _ in range(reader.number("I")):
        name = reader.string()
        shape = [reader.number("I") for _ in range(reader.number("B"))]
        type_id = reader.number("B")
        if type_id >= len(DTYPES):
            raise ValueError(f"{path}: variable {name!r} has an unknown dtype id {type_id}")
        dtype_stored = DTYPES[type_id]
        size = reader.number("I")
        expected = math.prod(shape) * dtype_stored.itemsize  # Python ints: no overflow
        if size != expected:
            raise ValueError(
                f"{path}: variable {name!r} holds {size} bytes, but its shape {shape} of "
                f"{dtype_stored} needs {expected}: a damaged CTranslate2 model"
            )
        raw = reader.take(size)
        tensors[name] = torch.frombuffer(bytearray(raw), dtype=dtype_stored).reshape(shape)
    _check_one_float_type(tensors, path)
    for name in [name for name in tensors if name + "_scale" in tensors]:
        scale = tensors.pop(name + "_scale").float()
        weight = tensors[name].float()
        tensors[name] = weight / (scale.view(-1, 1) if scale.dim() == 1 else scale)
    if dtype is not None:
        for name, tensor in tensors.items():
            if tensor.is_floating_point():
                tensors[name] = tensor.to(dtype)
    for _ in range(reader.number("I")):
        alias, target = reader.string(), reader.string()
        if target not in tensors:
            raise ValueError(f"{path}: alias {alias!r} names a missing variable {target!r}")
        tensors[alias] = tensors[target]
    return tensors
