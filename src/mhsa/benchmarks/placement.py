"""Where a benchmark suite runs: one device and one dtype, the CPU in float32 unless
`mhsa bench SUITE --device --dtype` say otherwise.

    on = Placement(torch.device("cuda"), torch.bfloat16)
    torch.randn(1, 8, 512, 64, **on.kwargs)   a tensor there, in that dtype
    str(on)                                    "cuda, bfloat16"
    on.label                                   "cuda bfloat16" ("CPU float32" on the CPU)

Each suite's run() takes `on: Placement = CPU` (the CPU in float32, its default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """A suite's device and dtype (a device given by name becomes a torch.device)."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def kwargs(self) -> dict:
        """{"device": ..., "dtype": ...}: torch's factory keywords (torch.randn, .to)."""
        return {"device": self.device, "dtype": self.dtype}

    @property
    def dtype_name(self) -> str:
        """bfloat16 of torch.bfloat16."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def label(self) -> str:
        """A table's heading: CPU float32, cuda:0 bfloat16."""
        return f"{'CPU' if self.cpu else self.device} {self.dtype_name}"

    def __str__(self) -> str:
        """cpu, float32; cuda:0, bfloat16."""
        return f"{self.device}, {self.dtype_name}"


CPU = Placement()  # every suite's default: the CPU in float32
