"""The bases of the models' config dataclasses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import ClassVar, NamedTuple

from typing_extensions import Self

from ..core.checks import int_at_least, is_int
from ..nn.positional import RotaryEmbedding, rope_frequencies, rope_type

HF_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
HF_SIZES += ("num_attention_heads",)  # what every transformers decoder config gives
# transformers' activation names (hidden_act, activation_function) -> ours
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


@dataclass
class ModelConfig:
    """A model's hyperparameters (subclasses are dataclasses of them), named in one
    vocabulary: d_model, n_layer, n_head, n_kv_head, d_ff (transformers' names are
    translated by each family's from_hf_config). to_dict() gives the JSON-able fields
    a checkpoint keeps; Config.from_dict(that) rebuilds the config, also from a dict
    an older version saved (see `renamed`)."""

    # a field's name in configs that older versions saved -> its name now (a class
    # constant, not a field; from_dict translates it)
    renamed: ClassVar[Mapping[str, str]] = {}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: Mapping) -> Self:
        """The config of to_dict()'s dict (a checkpoint's config.json "config"), its
        fields' old names (`renamed`) translated. ValueError for a dict that gives a
        field under both names; an unknown field is a TypeError, as in cls(**saved)."""
        if not isinstance(saved, Mapping):
            raise TypeError(f"a saved config must be a dict, got {type(saved).__name__}")
        both = [old for old, new in cls.renamed.items() if old in saved and new in saved]
        if both:
            raise ValueError(
                f"the saved {cls.__name__} gives {both[0]!r} and its new name "
                f"{cls.renamed[both[0]]!r}; keep one of them"
            )
        return cls(**{cls.renamed.get(name, name): value for name, value in saved.items()})


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
        if not is_int(kv) or kv < 1 or self.n_head % kv:
            raise ValueError(
                f"n_kv_head must divide n_head ({self.n_head}) or be None, got {self.n_kv_head!r}"
            )


class RopeSetting(NamedTuple):
    """One rotary embedding of a config: heads of head_dim, the first rotary_dim (None:
    all) of each rotated, at base theta with scaling (None: plain) for max_len positions."""

    head_dim: int
    theta: float
    scaling: dict | None
    max_len: int
    rotary_dim: int | None = None

    def check(self) -> None:
        """Raise a ValueError naming the fault unless the scaling is valid."""
        width = self.rotary_dim or self.head_dim
        rope_frequencies(width, self.theta, self.scaling, max_position_embeddings=self.max_len)

    def embedding(self) -> RotaryEmbedding:
        return RotaryEmbedding(
            self.head_dim,
            self.theta,
            rotary_dim=self.rotary_dim,
            scaling=self.scaling,
            max_position_embeddings=self.max_len,
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


def hf_sizes(d: dict, family: str, model_types: Sequence[str], needed: Sequence[str] = ()) -> dict:
    """A transformers config.json dict, checked to be of one of model_types and to hold
    HF_SIZES and `needed` -> CausalLMConfig's fields (vocab_size, n_layer, n_head,
    n_kv_head, d_model)."""
    kind = d.get("model_type")
    if kind not in model_types:
        raise ValueError(
            f"model_type {kind!r} is not supported by {family}; supported: {', '.join(model_types)}"
        )
    missing = [k for k in (*HF_SIZES, *needed) if k not in d]
    if missing:
        raise ValueError(f"the config dict lacks {missing}; pass the model's config.json")
    n_head = d["num_attention_heads"]
    return {
        "vocab_size": d["vocab_size"],
        "n_layer": d["num_hidden_layers"],
        "n_head": n_head,
        "n_kv_head": d.get("num_key_value_heads") or n_head,
        "d_model": d["hidden_size"],
    }


def hf_rope(
    rope: dict, theta: float, max_len: int, original: int | None = None
) -> tuple[float, dict | None]:
    """One rotary setting of a transformers config (its rope_scaling or rope_parameters,
    whose rope_theta wins over `theta`) -> (theta, scaling or None for the default). A
    llama3 or yarn scaling takes the config's top-level original_max_position_embeddings
    (`original`, Phi-3's convention, first as in transformers), else its own, else max_len."""
    rope = dict(rope)
    theta = rope.pop("rope_theta", None) or theta
    if rope_type(rope) in ("llama3", "yarn"):
        if original is not None:
            rope["original_max_position_embeddings"] = original
        rope.setdefault("original_max_position_embeddings", max_len)
    return float(theta), (rope if rope_type(rope) != "default" else None)


def hf_stop_tokens(d: dict) -> tuple[int, ...]:
    """A transformers config dict's eos_token_id (one id, a list or None) as a tuple."""
    eos = d.get("eos_token_id")
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
