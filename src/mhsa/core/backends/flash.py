"""The flash backend: exact tiled attention, memory linear in sequence length.

The call's mask and causal flag become a block plan (empty tiles skipped, full tiles
unmasked); the engine in mhsa.core.kernels.flash computes it with PyTorch's fused CPU
kernel per run, or with its unfused kernel (torch matmuls: any device, dropout). Paged
keys go to the tiled paged engine (mhsa.core.kernels.paged: one tile of pages at a
time, an online softmax), which serves inference only.
"""

from __future__ import annotations

from ..kernels import paged
from ..kernels.dropout import draw_seed
from ..kernels.flash import flash_apply
from ..masks import SlidingWindow
from ..masks.residues import residue_classes
from .common import tracing
from .flash_op import traceable, traced_flash_attention
from .flash_plan import band_of, engine_call
from .registry import AttentionSpec, Backend


class FlashBackend(Backend):
    name = "flash"

    def supports(self, spec: AttentionSpec) -> str | None:
        if spec.paged and spec.needs_grad:
            return (
                "paged keys with gradients: its tiled paged engine is for inference; "
                "reference is differentiable, or run under torch.no_grad()"
            )
        return None

    def preference(self, spec: AttentionSpec) -> float:
        return 2.0 if spec.device.type == "cpu" else 0.5

    def prepare_paged(self, call):
        """The fused engine's layout (positions, tiles, masks) of a short call."""
        return paged.fused_layout(call, paged.TILE_SIZE)

    def forward_paged(self, call, prepared=None):
        return paged.paged_tiled(call, paged.TILE_SIZE, prepared)

    def forward(
        self, q, k, v, *, mask, bias, causal, scale, dropout_p, return_lse, score=None, sinks=None
    ):
        band = band_of(mask)
        bare = bias is None and score is None and sinks is None  # no bias, score function or sinks
        if band is not None and band.dilation == 1:
            # the undilated window, whatever pattern said it: its plan has the band and triangles
            mask = SlidingWindow(band.left, band.right)
        elif band is not None and band.left == band.right and bare and not dropout_p:
            classes = residue_classes(band.left, band.dilation, causal, q.shape[2], k.shape[2])
            if classes is not None:
                out, lse = self._by_residue(q, k, v, classes, band.dilation, scale)
                return out, (lse if return_lse else None)
        if tracing() and traceable(score):  # one custom op in the graph
            out, lse = traced_flash_attention(
                q, k, v, mask, bias, causal, scale, dropout_p, score, sinks
            )
            return out, (lse if return_lse else None)
        dropout = (dropout_p, draw_seed()) if dropout_p > 0 else None
        out, lse = flash_apply(
            engine_call(q, k, v, mask, bias, causal, scale, dropout, score, sinks)
        )
        return out, (lse if return_lse else None)

    def _by_residue(self, q, k, v, classes, dilation: int, scale: float):
        """Dilated attention as one sliding window per residue class (strided views)."""
        batch, heads, q_len, _ = q.shape
        out = q.new_empty(batch, heads, q_len, v.shape[-1])  # the classes cover every row
        lse = None
        for c in classes:
            rows = slice(c.q_start, None, dilation)
            keys = slice(c.k_start, None, dilation)
            out_c, lse_c = self.forward(
                q[:, :, rows],
                k[:, :, keys],
                v[:, :, keys],
                mask=c.window,
                bias=None,
                causal=False,
                scale=scale,
                dropout_p=0.0,
                return_lse=True,
            )
            if lse is None:
                lse = lse_c.new_empty(batch, heads, q_len)
            out[:, :, rows] = out_c
            lse[:, :, rows] = lse_c
        return out, lse
