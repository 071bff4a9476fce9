"""Sources of named tensors as files store them, for the weight loader (weights.py):
anything with a `name` (the file, for messages), `shapes()` ({stored name: shape},
cheap: from a header) and `read(name)` (one tensor). A state dict (`TensorDict`) and
safetensors files (`SafetensorsFiles`) are here; the GGUF reader has its own."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor


class TensorSource(Protocol):
    """Named tensors as a file stores them."""

    name: str

    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def read(self, name: str) -> Tensor: ...


# what a loader takes: a state dict, or a TensorSource such as SafetensorsFiles
Weights = Mapping[str, Tensor] | TensorSource


class TensorDict:
    """A state dict in memory as a source; `name` says where it came from."""

    def __init__(self, tensors: Mapping[str, Tensor], name: str = "the state dict") -> None:
        self.tensors, self.name = tensors, name

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(value.shape) for key, value in self.tensors.items()}

    def read(self, name: str) -> Tensor:
        return self.tensors[name]


def as_source(weights: Weights, name: str = "the state dict") -> TensorSource:
    """weights as a TensorSource: a source as it is, a state dict as a TensorDict."""
    return weights if hasattr(weights, "shapes") else TensorDict(weights, name)


class Within:
    """The tensors of `source` whose names start with `prefix`, named without it: the
    text model of a multimodal checkpoint (language_model.), its other parts left out."""

    def __init__(self, source: TensorSource, prefix: str) -> None:
        self.source, self.prefix = source, prefix
        self.name = f"{source.name} ({prefix}*)"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = self.source.shapes().items()
        return {
            key.removeprefix(self.prefix): v for key, v in shapes if key.startswith(self.prefix)
        }

    def read(self, name: str) -> Tensor:
        return self.source.read(self.prefix + name)


class SafetensorsFiles:
    """One or more .safetensors files (shards of one model) as a source: shapes from the
    headers, each file read whole (safetensors' load_file) the first time it is needed."""

    def __init__(self, files: Path | str | Sequence[Path | str], device: str = "cpu") -> None:
        paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
        if not paths:
            raise ValueError("files is empty: pass one or more .safetensors files")
        self.name = str(paths[0]) if len(paths) == 1 else f"{paths[0].parent}/*.safetensors"
        self.device, self._loaded = device, {}
        self._file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for path in paths:
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for key in handle.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                        self._shapes[key] = tuple(handle.get_slice(key).get_shape())
                        self._file_of[key] = path
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{path}: not a readable safetensors file ({error})") from error

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, name: str) -> Tensor:
        path = self._file_of[name]
        if path not in self._loaded:
            try:
                self._loaded[path] = load_file(path, device=self.device)
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{path}: not a readable safetensors file ({error})") from error
        return self._loaded[path][name]


def checkpoint_files(directory: Path) -> list[Path]:
    """The .safetensors files of a Hugging Face model directory, as transformers picks
    them: model.safetensors; else the shards model.safetensors.index.json names (other
    files beside them, such as Mistral's consolidated.safetensors, are not the model's);
    else every *.safetensors. ValueError when there is none, or a named shard is missing."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{index}: not a safetensors index (no weight_map)") from error
        missing = [name for name in names if not (directory / name).is_file()]
        if missing:
            raise ValueError(f"{index} names {', '.join(missing)}, not in {directory}")
        return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{directory} has no *.safetensors weights; convert .bin "
            "checkpoints with transformers' save_pretrained first"
        )
    return files
