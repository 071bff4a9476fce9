"""--device and --dtype: where a command computes and in which dtype, chosen in one place.

    device, dtype = placement(args)                  an inference command
    device, dtype = placement(args, training=True)   train: dtype is autocast's

The default device is cuda when torch sees a GPU, else cpu. On CUDA the default dtype is
bfloat16 (the weights' for inference; for training bfloat16 autocast over float32
weights and optimizer state); on the CPU it is float32, as before these options. A
device torch cannot use, an unknown name, or a dtype the device cannot do is a one-line
ValueError naming the flag (main prints it and exits 2), raised before anything loads.
Adding the options imports no torch (the parser is built without it); resolving does.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the commands that take --device and --dtype: name -> whether it trains (dtype: autocast's)
COMMANDS = {
    "train": True,
    "chat": False,
    "serve": False,
    "generate": False,
    "translate": False,
    "transcribe": False,
    "embed": False,
    "classify": False,
    "viz": False,
    "bench": False,
}
# --dtype's names (and their short forms) -> torch's attribute
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
DEVICE_HELP = (
    "where it computes: cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)"
)
DTYPE_HELP = (
    "float32, bfloat16 (bf16) or float16 (fp16; CUDA only) for {what} "
    "(default: bfloat16 on CUDA, {cpu} on the CPU)"
)
TRAIN_DTYPE_HELP = (
    "float32 or bfloat16 (bf16): the matmuls' dtype under autocast; weights and optimizer "
    "state stay float32 (default: bfloat16 on CUDA, float32 on the CPU)"
)


def device_options(
    parser: argparse.ArgumentParser,
    *,
    what: str = "the weights and activations",
    training: bool = False,
    cpu_dtype: str = "float32",
    dtype: bool = True,
) -> None:
    """--device and (unless dtype=False) --dtype, both defaulting to None: resolved at run
    time by placement() (the parser is built without importing torch)."""
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    if dtype:
        text = TRAIN_DTYPE_HELP if training else DTYPE_HELP.format(what=what, cpu=cpu_dtype)
        parser.add_argument("--dtype", default=None, help=text)


def _why_no_cuda() -> str:
    """Why torch sees no CUDA GPU, in a few words."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__}, built without CUDA"
    return f"torch {torch.__version__} with CUDA {torch.version.cuda}, but no GPU or driver found"


def default_device() -> torch.device:
    """cuda when torch sees a GPU, else cpu."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(text: str | None, flag: str = "--device") -> torch.device:
    """The torch.device of --device (None: default_device()); ValueError naming the flag for
    a name that is no device, or a CUDA device torch cannot use here."""
    import torch

    if text is None or text == "auto":
        return default_device()
    try:
        device = torch.device(text.strip().lower())
    except (RuntimeError, ValueError):
        device = None
    if (
        device is None
        or device.type not in ("cpu", "cuda")
        or (device.type == "cpu" and device.index not in (None, 0))
    ):
        raise ValueError(f"{flag} {text}: not a device mhsa runs on; pass cpu, cuda or cuda:N")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{flag} {text}: torch sees no CUDA GPU ({_why_no_cuda()}); use {flag} cpu"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        names = ", ".join(f"cuda:{i}" for i in range(count))
        raise ValueError(
            f"{flag} {text}: torch sees {count} CUDA GPU{'s' * (count != 1)} ({names}); "
            f"pass one of them"
        )
    return device


def _bf16_on(device: torch.device) -> bool:
    import torch

    return device.type == "cpu" or torch.cuda.is_bf16_supported()


def default_dtype(device: torch.device, training: bool = False, cpu: str = "float32"):
    """bfloat16 on CUDA (float16 for inference, float32 for training, on a GPU without
    bfloat16), cpu (a name) on the CPU."""
    import torch

    if device.type != "cuda":
        return getattr(torch, cpu)
    if _bf16_on(device):
        return torch.bfloat16
    return torch.float32 if training else torch.float16


def resolve_dtype(
    text: str | None,
    device: torch.device,
    *,
    training: bool = False,
    cpu: str = "float32",
    allowed: tuple[str, ...] | None = None,
    flag: str = "--dtype",
) -> torch.dtype:
    """The torch.dtype of --dtype on device (None: default_dtype); for training, autocast's
    dtype (float32: none). allowed limits the names a command takes. ValueError naming
    the flag for an unknown name or one the device (or the command) cannot do."""
    import torch

    if text is None:
        return default_dtype(device, training, cpu)
    name = DTYPE_NAMES.get(text.strip().lower())
    if name is None:
        raise ValueError(f"{flag} {text}: not a dtype; pass float32, bfloat16 or float16")
    if allowed is not None and name not in allowed:
        raise ValueError(f"{flag} {text}: this command takes {' or '.join(allowed)}")
    if training and name == "float16":
        raise ValueError(
            f"{flag} {text}: float16 training needs loss scaling, which mhsa train does not "
            f"do; use {flag} bfloat16 (as fast, no scaling needed) or float32"
        )
    if name == "float16" and device.type == "cpu":
        raise ValueError(
            f"{flag} {text}: float16 is for CUDA; on the CPU use {flag} bfloat16 or float32"
        )
    if name == "bfloat16" and not _bf16_on(device):
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        other = "float32" if training else "float16 or float32"
        raise ValueError(
            f"{flag} {text}: {device} ({torch.cuda.get_device_name(device)}, compute "
            f"capability {capability}) has no bfloat16; use {flag} {other}"
        )
    return getattr(torch, name)


def placement(
    args: argparse.Namespace,
    *,
    training: bool = False,
    cpu: str = "float32",
    allowed: tuple[str, ...] | None = None,
) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of args.device and args.dtype (a command without --dtype: the
    default); see resolve_device and resolve_dtype."""
    device = resolve_device(getattr(args, "device", None))
    dtype = resolve_dtype(
        getattr(args, "dtype", None), device, training=training, cpu=cpu, allowed=allowed
    )
    return device, dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a dtype: bfloat16 of torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def describe(device: torch.device, dtype: torch.dtype, training: bool = False) -> str:
    """In words: cuda:0, bfloat16 autocast (float32 weights); cpu, float32 ..."""
    import torch

    if training and dtype != torch.float32:
        return f"{device}, {dtype_name(dtype)} autocast (float32 weights)"
    return f"{device}, {dtype_name(dtype)}"


def defaults_here() -> list[str]:
    """What each command computes on here without --device and --dtype, one line each
    (mhsa info)."""
    device = default_device()
    where = str(device)
    if device.type == "cuda":
        import torch

        where += f" ({torch.cuda.get_device_name(device)})"
    lines = []
    for command, training in COMMANDS.items():
        dtype = default_dtype(device, training)
        text = describe(device, dtype, training).replace(str(device), where, 1)
        if command in ("chat", "serve"):
            text += (
                " (weights dequantised)"
                if device.type == "cuda"
                else " (a GGUF's own int4/int8 weights unless --quantize none)"
            )
        if command == "bench":
            text += " (ring and transcribe: their processes on the CPU)"
        lines.append(f"{command:<10} {text}")
    lines.append(
        f"{'export':<10} cpu (an ONNX file is the same whichever device traces it; "
        "onnxruntime checks it on the CPU)"
    )
    return lines
