"""The bases of the models' config dataclasses."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..core.validate import int_at_least


@dataclass
class ModelConfig:
    """A model's hyperparameters (subclasses are dataclasses of them). to_dict() gives
    the JSON-able fields a checkpoint keeps; Config(**that) rebuilds the config."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CausalLMConfig(ModelConfig):
    """What every decoder-only language model's config starts with (GPT, Llama): the
    vocabulary, depth, heads and width, checked here; subclasses add their own."""

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # None: n_head (no grouped-query attention)
    d_model: int = 256

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model"):
            int_at_least(name, getattr(self, name), 1)
        kv = self.n_head if self.n_kv_head is None else self.n_kv_head
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or self.n_head % kv:
            raise ValueError(
                f"n_kv_head must divide n_head ({self.n_head}) or be None, got {self.n_kv_head!r}"
            )


@dataclass
class EncoderClassifierConfig(ModelConfig):
    """What the pre-norm encoder classifiers (ViT, AST, the point-cloud model) share:
    the classes, width, depth and heads, the feed-forward width (None: ff_ratio *
    d_model) and dropout; subclasses add their input's fields."""

    ff_ratio = 4  # a class constant, not a field

    num_classes: int = 10
    d_model: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_ff: int | None = None
    dropout: float = 0.1

    def feed_forward_width(self) -> int:
        return self.d_ff or self.ff_ratio * self.d_model
