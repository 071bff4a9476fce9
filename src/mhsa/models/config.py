"""The bases of the models' config dataclasses."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, NamedTuple

from typing_extensions import Self

from ..core.checks import int_at_least, is_int
from ..core.validate import check_dropout
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


# fields that are counts or widths wherever a config has them (an int field, or None)
SIZES = frozenset(
    {"vocab_size", "src_vocab", "tgt_vocab", "type_vocab_size", "num_classes", "max_len"}
    | {"d_model", "d_ff", "d_ff_dense", "n_layer", "n_encoder_layer", "n_decoder_layer"}
    | {"n_head", "head_dim", "image_size", "patch_size", "channels"}
)


def _check_field(name: str, kind: str, value: object) -> None:
    """ValueError (as the configs raise) naming a field whose value its annotation (kind,
    a string) or SIZES refuses; annotations other than bool, int, float, str (or None)
    are the config's own to check."""
    if value is None and kind.endswith(" | None"):
        return
    kind = kind.removesuffix(" | None")
    if kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    if kind == "int" and not is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if kind == "float" and not (is_int(value) or isinstance(value, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if kind == "str" and not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {value!r}")
    if name in SIZES and kind == "int":
        int_at_least(name, value, 1)
    if name.endswith("eps") and kind == "float" and not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


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

    def __post_init__(self) -> None:
        """Each field's type as annotated (a bool field given "false" built a bias; an
        int field given 1.0 failed deep in torch), the sizes >= 1 and a norm's eps a
        finite number > 0 (nan or inf gave nan logits); subclasses check their own
        rules (other numbers' ranges) after this."""
        for field in fields(self):
            _check_field(field.name, field.type, getattr(self, field.name))

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
        super().__post_init__()  # (the sizes >= 1 among the fields)
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

    def __post_init__(self) -> None:
        super().__post_init__()
        check_dropout(self.dropout, "dropout")

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
