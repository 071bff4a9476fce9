"""Point-to-point transfers around the ring (isend/irecv), overlapped with compute."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class Transfer:
    works: list
    received: list[Tensor]

    def wait(self) -> list[Tensor]:
        """The received tensors; the sent ones are released."""
        for work in self.works:
            work.wait()
        received, self.works, self.received = self.received, [], []
        return received


@dataclass
class Ring:
    group: dist.ProcessGroup | None
    rank: int
    world: int

    def shift(
        self, tensors: list[Tensor], delta: int, tag: int = 0, into: list[Tensor] | None = None
    ) -> Transfer:
        """Start sending tensors to rank - delta and receiving their likes (into the
        given buffers, or new ones) from rank + delta, the holder of what comes next."""
        send_to, recv_from = (self.rank - delta) % self.world, (self.rank + delta) % self.world
        received = into if into is not None else [torch.empty_like(t) for t in tensors]
        ops = [
            dist.P2POp(
                dist.isend, t.contiguous(), group=self.group, tag=tag + i, group_peer=send_to
            )
            for i, t in enumerate(tensors)
        ] + [
            dist.P2POp(dist.irecv, r, group=self.group, tag=tag + i, group_peer=recv_from)
            for i, r in enumerate(received)
        ]
        return Transfer(dist.batch_isend_irecv(ops), received)


class Travelling:
    """Tensors that travel along the ring: the ones this rank holds now, passed on into
    two alternating receive buffers (allocated once, so no memory churn per step)."""

    def __init__(self, ring: Ring, tensors: list[Tensor], owned: bool, tag: int) -> None:
        self.ring, self.current, self.tag = ring, tensors, tag
        self.owned = owned  # False: the caller's tensors, never overwritten
        self.spare: list[Tensor] | None = None
        self.incoming: Transfer | None = None

    def pass_on(self, delta: int) -> None:
        """Start sending the current tensors to rank - delta, receiving from rank + delta."""
        self.incoming = self.ring.shift(self.current, delta, self.tag, into=self.spare)
        self.spare = None

    def receive(self) -> list[Tensor]:
        """Wait for the transfer; the received tensors become the current ones."""
        received = self.incoming.wait()
        self.spare = self.current if self.owned else None
        self.current, self.owned, self.incoming = received, True, None
        return received
