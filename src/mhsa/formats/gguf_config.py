"""A GGUF file's metadata as the transformers config of its model (hf_config), checked:
the architecture, the sizes and the context it declares, its rotary scaling."""

from __future__ import annotations

from typing import Any

import numpy as np

from .gguf_tokenizer import check_special_ids

# general.architecture -> (transformers model_type, whether llama.cpp permuted q/k rows)
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}
# the longest context_length a file may declare (no tensor says it; caches follow it)
MAX_CONTEXT = 2**24


def hf_config(metadata: dict[str, Any], tensor_names: set[str], source: str = "GGUF") -> dict:
    """The transformers config.json dict for a file with this metadata and these tensors."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{source}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(ARCHITECTURES)}); use a GGUF of a Llama-family model"
        )
    model_type = ARCHITECTURES[arch][0]
    check_special_ids(metadata, source)  # (before the weights are read)

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{source}: metadata key {arch}.{key} is missing: a damaged GGUF file")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"{source}: metadata {arch}.attention.head_count {heads} and head_count_kv "
            f"{kv_heads} do not make attention heads (both >= 1, the first a multiple of the "
            "second): a damaged GGUF file"
        )
    context = int(get("context_length"))
    if not 1 <= context <= MAX_CONTEXT:
        raise ValueError(
            f"{source}: metadata {arch}.context_length is {context}, outside 1..{MAX_CONTEXT}: "
            "a damaged GGUF file"
        )
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = metadata.get(f"{arch}.rope.dimension_count")
    vocab = metadata.get(f"{arch}.vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())))
    config = {
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
                arch
            ]
        ],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim) if head_dim is not None else hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": _decimal(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _decimal(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(metadata, arch, source),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False  # llama.cpp runs every layer with full attention
    return config


def check_sizes(
    config: dict[str, Any], shapes: dict[str, tuple[int, ...]], arch: str, source: str
) -> None:
    """Check the sizes the metadata gives (config) against the tensors present (shapes in
    torch order, under llama.cpp's names): the blocks, the embedding and vocabulary and the
    attention heads, which shape everything else (every tensor's shape is checked against
    the config by read_tensors before any is read). Raises ValueError naming the key."""
    blocks = {_block_number(name, source) for name in shapes if name.startswith("blk.")}
    layers = config["num_hidden_layers"]
    if len(blocks) != layers or blocks != set(range(layers)):  # (len first: layers may be huge)
        held = f"blk.0 .. blk.{max(blocks)}" if blocks else "none"
        raise ValueError(
            f"{source}: metadata {arch}.block_count is {layers}, but the file holds tensors of "
            f"{len(blocks)} blocks ({held}): a damaged or inconsistent GGUF file"
        )
    head_dim = config["head_dim"]
    checks = [
        ("token_embd.weight", 0, "vocab_size", config["vocab_size"]),
        ("token_embd.weight", 1, "embedding_length", config["hidden_size"]),
        ("blk.0.attn_q.weight", 0, "attention.head_count", config["num_attention_heads"]),
        ("blk.0.attn_k.weight", 0, "attention.head_count_kv", config["num_key_value_heads"]),
    ]
    for tensor, axis, key, value in checks:
        shape = shapes.get(tensor)
        if shape is None or len(shape) <= axis:
            continue  # (a missing tensor is reported with the others when they are read)
        wanted = value * head_dim if key.startswith("attention.") else value
        if shape[axis] != wanted:
            per_head = f" heads of {head_dim}" if key.startswith("attention.") else ""
            raise ValueError(
                f"{source}: metadata {arch}.{key} is {value}{per_head}, but tensor {tensor} "
                f"has shape {shape} (dimension {axis} would be {wanted}): a damaged or "
                "inconsistent GGUF file"
            )


def _block_number(name: str, source: str) -> int:
    """N of a tensor named blk.N.something."""
    number = name.split(".")[1]
    if not number.isdigit():
        raise ValueError(
            f"{source}: tensor {name!r} is not named blk.N.<part> with a block number N: "
            "a damaged or inconsistent GGUF file"
        )
    return int(number)


def _decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back to it (1e-05, not
    9.999999747378752e-06), as the config.json it was converted from spells it."""
    return float(str(np.float32(value)))


def _rope_scaling(metadata: dict[str, Any], arch: str, source: str) -> dict[str, Any] | None:
    key = f"{arch}.rope.scaling"
    kind = metadata.get(f"{key}.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(
            f"{source}: metadata {key}.type is {kind!r}; mhsa reads 'linear' and 'yarn' "
            "scalings (and a rope_freqs tensor)"
        )
    factor = metadata.get(f"{key}.factor")
    if not factor:
        raise ValueError(f"{source}: metadata {key}.type is {kind!r} but {key}.factor is not set")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _decimal(factor)}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
