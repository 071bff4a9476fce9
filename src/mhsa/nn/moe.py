"""A mixture-of-experts feed-forward with DeepSeek-V3's routing, written plainly (a
loop over the chosen experts): for checking models that have one against their
reference implementation, not for speed.

    scores  = sigmoid(x W_router^T)                               (N, E), float32
    choice  = scores + score_bias         (DeepSeek's e_score_correction_bias: it
                                           steers the choice, not the weights)
    groups  = the topk_group groups of E / n_group experts whose two best choices
              sum highest; experts outside them cannot be chosen
    chosen  = the top_k experts by choice within those groups
    weights = their scores (/ their sum if norm_topk_prob) * routed_scaling_factor
    out     = sum over chosen e of weight_e * expert_e(x)  +  shared(x)

Each expert is a SwiGLU feed-forward; the shared experts are one wider one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.checks import int_at_least
from .feedforward import ACTIVATIONS, GatedFeedForward


def route(
    x: Tensor,
    router: Tensor,
    score_bias: Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3's routing of tokens x (N, d) over router (E, d): (weights (N, top_k)
    float32, expert indices (N, top_k)). See the module docstring."""
    experts = router.shape[0]
    scores = F.linear(x.float(), router.float()).sigmoid()  # (N, E)
    choice = scores + score_bias.float()
    grouped = choice.view(-1, n_group, experts // n_group)  # (N, G, E / G)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
    groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    allowed = allowed.unsqueeze(-1).expand_as(grouped).reshape(-1, experts)
    chosen = choice.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, chosen)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, chosen


class MoEFeedForward(nn.Module):
    """Routed experts (DeepSeek-V3's routing) plus shared experts: (..., d) -> same.

    Args:
        d_model: input and output width.
        expert_dim: hidden width of each expert (moe_intermediate_size).
        num_experts: routed experts E.
        top_k: experts per token.
        n_group: experts are split in n_group groups (1: no grouping).
        topk_group: each token chooses only within its topk_group best groups.
        num_shared: shared experts, run for every token as one feed-forward of
            num_shared * expert_dim hidden width.
        norm_topk_prob: divide the chosen experts' scores by their sum.
        routed_scaling_factor: multiplies the routed experts' weights.
        activation: of the experts' gates ("silu": SwiGLU).
    """

    def __init__(
        self,
        d_model: int,
        expert_dim: int,
        num_experts: int,
        *,
        top_k: int,
        n_group: int = 1,
        topk_group: int = 1,
        num_shared: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        activation: str = "silu",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("d_model", d_model),
            ("expert_dim", expert_dim),
            ("num_experts", num_experts),
            ("top_k", top_k),
            ("n_group", n_group),
            ("topk_group", topk_group),
            ("num_shared", num_shared),
        ):
            int_at_least(name, value, 1)
        if num_experts % n_group or num_experts // n_group < 2:
            raise ValueError(
                f"n_group ({n_group}) must divide num_experts ({num_experts}) into "
                "groups of 2 or more experts"
            )
        if topk_group > n_group:
            raise ValueError(f"topk_group ({topk_group}) must be <= n_group ({n_group})")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(
                f"top_k ({top_k}) must be <= the experts in topk_group groups "
                f"({topk_group * (num_experts // n_group)})"
            )
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.routing = {  # route()'s keywords
            "top_k": top_k,
            "n_group": n_group,
            "topk_group": topk_group,
            "norm_topk_prob": norm_topk_prob,
            "routed_scaling_factor": routed_scaling_factor,
        }
        self.activation = activation
        factory = {"device": device, "dtype": dtype}
        self.router = nn.Parameter(torch.empty(num_experts, d_model, **factory))
        self.register_buffer("score_bias", torch.zeros(num_experts, **factory))
        # expert e: gate and up rows stacked (2 * expert_dim, d), down (d, expert_dim)
        self.experts_gate_up = nn.Parameter(
            torch.empty(num_experts, 2 * expert_dim, d_model, **factory)
        )
        self.experts_down = nn.Parameter(torch.empty(num_experts, d_model, expert_dim, **factory))
        for weight in (self.router, self.experts_gate_up, self.experts_down):
            nn.init.normal_(weight, std=0.02)
        self.shared = GatedFeedForward(
            d_model, num_shared * expert_dim, activation=activation, **factory
        )

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d) -> (..., d)."""
        flat = x.reshape(-1, x.shape[-1])  # (N, d)
        weights, chosen = route(flat, self.router, self.score_bias, **self.routing)
        out = torch.zeros_like(flat)
        act = ACTIVATIONS[self.activation]
        for expert in chosen.unique().tolist():
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            gate, up = F.linear(flat[token], self.experts_gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(act(gate) * up, self.experts_down[expert])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out.view_as(x) + self.shared(x)
