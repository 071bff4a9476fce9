"""The one checked weight loader (mhsa.formats.weights): its name tables, and every loader
of the package refusing a renamed, a missing and a reshaped tensor with a one-line error
that names the file and the tensor. Each loader reads a tiny random model written by the
format's own writer (transformers' save_pretrained, gguf.GGUFWriter, ctranslate2's
WhisperSpec, our save_checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import max_error, tiny_hf_gpt2
from mhsa.checkpoint import load_checkpoint, save_checkpoint
from mhsa.formats.weights import NameTable, Rule, SafetensorsFiles, TensorDict, load_weights
from mhsa.models import GPT, Bert, GPTConfig, Llama, Whisper
from mhsa.models.bert import BERT_NAMES
from mhsa.models.gpt import GPT2_NAMES
from mhsa.models.llama import HF_NAMES
from mhsa.models.whisper import CT2_NAMES
from optional import needs

# ---------------------------------------------------------------- name tables


def test_a_table_maps_both_ways_with_splits_and_prefixes():
    assert HF_NAMES.stored_name("layers.3.attn.out_proj.weight") == (
        "model.layers.3.self_attn.o_proj.weight"
    )
    assert HF_NAMES.param_names("model.layers.3.self_attn.o_proj.weight") == (
        "layers.3.attn.out_proj.weight",
    )
    assert GPT2_NAMES.stored_name("blocks.1.self_attn.k_proj.bias") == "h.1.attn.c_attn.bias"
    assert GPT2_NAMES.param_names("transformer.h.1.attn.c_attn.weight") == (
        "blocks.1.self_attn.q_proj.weight",
        "blocks.1.self_attn.k_proj.weight",
        "blocks.1.self_attn.v_proj.weight",
    )
    assert CT2_NAMES.stored_name("decoder.norm.bias") == "decoder/layer_norm/beta"
    assert CT2_NAMES.param_names("decoder/layer_0/attention/linear_1/bias") == (
        "decoder.layers.0.cross_attn.k_proj.bias",
        "decoder.layers.0.cross_attn.v_proj.bias",
    )
    assert BERT_NAMES.param_names("bert.pooler.dense.weight") == ("pooler.weight",)
    assert HF_NAMES.param_names("model.layers.0.mlp.experts.weight") is None
    assert CT2_NAMES.ignores("encoder/num_heads") and not CT2_NAMES.ignores("encoder/conv1/weight")
    with pytest.raises(KeyError, match="no rule of this name table stores 'layers.0.attn.x'"):
        HF_NAMES.stored_name("layers.0.attn.x")


class Tiny(torch.nn.Module):
    """One fused-and-transposed linear pair, a norm and an optional vector."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(3, 4)
        self.norm = torch.nn.LayerNorm(3)
        self.extra = torch.nn.Parameter(torch.full((5,), 7.0))


TINY_NAMES = NameTable(
    Rule(("a.{p}", "b.{p}"), "ab.{p}", transpose=True),
    ("norm.{p}", "ln.{p}"),
    Rule("extra", "x", optional=True),
    ignore=("buffer",),
    prefix="model.",
)


def tiny_file() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.ab.weight": torch.randn(3, 6),
        "model.ab.bias": torch.randn(6),
        "model.ln.weight": torch.randn(3),
        "model.ln.bias": torch.randn(3),
        "buffer": torch.arange(4),
    }


def test_load_weights_splits_transposes_and_keeps_what_is_optional():
    stored = tiny_file()
    model = load_weights(Tiny(), TensorDict(stored, "tiny.bin"), TINY_NAMES)
    assert torch.equal(model.a.weight, stored["model.ab.weight"].t()[:2])
    assert torch.equal(model.b.weight, stored["model.ab.weight"].t()[2:])
    assert torch.equal(model.b.bias, stored["model.ab.bias"][2:])
    assert torch.equal(model.norm.bias, stored["model.ln.bias"])
    assert torch.equal(model.extra, torch.full((5,), 7.0))  # not in the file: kept
    with_extra = {**stored, "x": torch.ones(5)}
    model = load_weights(Tiny(), TensorDict(with_extra, "tiny.bin"), TINY_NAMES)
    assert torch.equal(model.extra, torch.ones(5))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d.pop("model.ln.bias"),
            r"^tiny.bin: 1 tensor missing: 'model.ln.bias' \(for norm.bias\); ",
        ),
        (lambda d: d.update(y=torch.ones(1)), r"^tiny.bin: 1 unexpected tensor: 'y' \(no param"),
        (
            lambda d: d.update(x=torch.ones(4)),
            r"^tiny.bin: tensor 'x' has shape \(4,\), but the model implies \(5,\) \(for extra\); ",
        ),
        (
            lambda d: d.update({"model.ab.weight": torch.ones(6, 3)}),
            r"tensor 'model.ab.weight' has shape \(6, 3\), but the model implies \(3, 6\) "
            r"\(for a.weight \+ b.weight\)",
        ),
        (
            lambda d: d.update({"model.ab.bias": torch.ones(6, dtype=torch.int8)}),
            r"tensor 'model.ab.bias' is stored as torch.int8, not a float type",
        ),
        (
            lambda d: [
                d.pop(f"model.{k}") for k in ("ln.bias", "ln.weight", "ab.bias", "ab.weight")
            ],
            r"4 tensors missing: 'ab.weight' \(for a.weight \+ b.weight\), 'ab.bias' \(for "
            r"a.bias \+ b.bias\), 'ln.weight' \(for norm.weight\) and 1 more; ",
        ),  # no prefix left
    ],
)
def test_load_weights_errors_are_one_line(change, message):
    stored = tiny_file()
    change(stored)
    model = Tiny()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=message) as info:
        load_weights(model, TensorDict(stored, "tiny.bin"), TINY_NAMES, fix="the fix")
    assert "\n" not in str(info.value) and str(info.value).endswith("; the fix")
    for name, tensor in model.state_dict().items():  # refused before anything was copied
        assert torch.equal(tensor, before[name]), name


def test_a_parameter_without_a_rule_is_a_bug_of_the_table():
    with pytest.raises(ValueError, match="the name table has no rule for the parameter 'extra'"):
        load_weights(Tiny(), TensorDict(tiny_file()), NameTable(*TINY_NAMES.rules[:2]))


# ---------------------------------------------------------------- every loader refuses


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in tensors.items()}, path)
    return path


def edit_safetensors(path: Path, edit: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file

    tensors = load_file(path)
    edit(tensors)
    save_safetensors(tensors, path)


def write_gpt2(folder: Path) -> Path:
    hf = tiny_hf_gpt2(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    hf.save_pretrained(folder)
    return folder / "model.safetensors"


def load_gpt2(path: Path) -> GPT:
    config = GPTConfig(vocab_size=11, n_layer=1, n_head=2, d_model=8, max_len=8)
    return GPT.from_hf_gpt2(SafetensorsFiles(path), config)


def write_bert(folder: Path) -> Path:
    transformers = needs("transformers")
    config = transformers.BertConfig(
        vocab_size=13,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=12,
        max_position_embeddings=10,
    )
    transformers.BertModel(config).save_pretrained(folder)
    return folder


def write_llama(folder: Path) -> Path:
    transformers = needs("transformers")
    config = transformers.LlamaConfig(
        vocab_size=17,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def write_checkpoint(folder: Path) -> Path:
    model = GPT(GPTConfig(vocab_size=11, n_layer=1, n_head=2, d_model=8, max_len=8))
    return save_checkpoint(folder, 1, model, {"model": "gpt"}, {})


def load_checkpoint_weights(path: Path) -> dict:
    model = GPT(GPTConfig(vocab_size=11, n_layer=1, n_head=2, d_model=8, max_len=8))
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return load_checkpoint(path, trainer=False, expected=expected)["weights"]


def write_gguf_file(folder: Path, edit: Callable[[dict], None]) -> Path:
    """A one-layer Llama GGUF (test_gguf's writer, the up projection stored as Q8_0 blocks)
    from transformers-named weights after edit."""
    test_gguf = pytest.importorskip("test_gguf")
    weights = test_gguf.hf_weights()
    edit(weights)
    folder.mkdir(parents=True, exist_ok=True)
    return test_gguf.write_gguf(folder / "tiny.gguf", weights=weights, qtype=test_gguf.Q.Q8_0)


def load_gguf(path: Path) -> Llama:
    from mhsa.apps.chat import _from_gguf

    return _from_gguf(path, torch.float32, "file").model  # the quantised path of mhsa chat


WHISPER_TOKENS = ["a", "b", "c", "<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"]


def write_whisper(folder: Path) -> Path:
    """A one-layer Whisper written by ctranslate2's own WhisperSpec.save (vocabulary.json,
    as ctranslate2 writes it now), with a word-level tokenizer.json."""
    specs = needs("ctranslate2.specs")
    tokenizers = needs("tokenizers")
    rng = np.random.default_rng(0)
    d, mels = 8, 4

    def values(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def linear(spec, rows, cols, *kernel):
        spec.weight, spec.bias = values(rows, cols, *kernel), values(rows)

    def norm(spec):
        spec.gamma, spec.beta = values(d), values(d)

    spec = specs.WhisperSpec(1, 2, 1, 2)
    encoder, decoder = spec.encoder, spec.decoder
    linear(encoder.conv1, d, mels, 3)
    linear(encoder.conv2, d, d, 3)
    encoder.position_encodings.encodings = values(5, d)
    decoder.embeddings.weight = values(len(WHISPER_TOKENS), d)
    decoder.position_encodings.encodings = values(7, d)
    decoder.projection.weight = decoder.embeddings.weight
    norm(encoder.layer_norm)
    norm(decoder.layer_norm)

    def attention(spec, rows):  # fused q|k|v (or q, then k|v) and the output projection
        norm(spec.layer_norm)
        for spec_linear, count in zip(spec.linear, rows, strict=True):
            linear(spec_linear, count, d)

    def feed_forward(spec):
        norm(spec.layer_norm)
        linear(spec.linear_0, 4 * d, d)
        linear(spec.linear_1, d, 4 * d)

    for layer in encoder.layer:
        attention(layer.self_attention, [3 * d, d])
        feed_forward(layer.ffn)
    for layer in decoder.layer:
        attention(layer.self_attention, [3 * d, d])
        attention(layer.attention, [d, 2 * d, d])
        feed_forward(layer.ffn)
    spec.register_vocabulary(WHISPER_TOKENS)
    spec.validate()
    folder.mkdir(parents=True, exist_ok=True)
    spec.save(str(folder))
    vocab = {token: i for i, token in enumerate(WHISPER_TOKENS)}
    word_level = tokenizers.models.WordLevel(vocab, unk_token="a")
    tokenizers.Tokenizer(word_level).save(str(folder / "tokenizer.json"))
    return folder


def edit_ctranslate2(folder: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite folder/model.bin with its variables after edit (test_whisper's writer of a
    WhisperSpec file, every variable as stored)."""
    test_whisper = pytest.importorskip("test_whisper")
    from mhsa.formats import read_ctranslate2

    tensors = read_ctranslate2(folder, dtype=None)
    edit(tensors)
    variables = []
    for name, tensor in tensors.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        type_id = test_whisper.TYPE_IDS[tensor.dtype]
        variables.append(test_whisper._ct2_raw(name.encode(), list(tensor.shape), type_id, raw))
    (folder / "model.bin").write_bytes(test_whisper._ct2_file(variables))


@dataclass
class Loader:
    """How to write a tiny valid file (write(folder) -> what load takes), to edit its
    tensors in place ({stored name: tensor}), and which stored tensor the cases change
    (`tensor`, as the file names it; `renamed` is what it becomes: a name the table does
    not know)."""

    write: Callable[[Path], Path]
    edit: Callable[[Path, Callable[[dict], None]], None]
    load: Callable[[Path], object]
    file: Callable[[Path], Path]  # the file the message must name
    tensor: str
    renamed: str
    stored: str = ""  # the name in the file when the edit uses other names (GGUF)
    stored_renamed: str = ""


LOADERS = {
    "gpt2": Loader(
        write_gpt2,
        edit_safetensors,
        load_gpt2,
        lambda p: p,
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_fc2.weight",
    ),
    "bert": Loader(
        write_bert,
        lambda p, e: edit_safetensors(p / "model.safetensors", e),
        Bert.from_pretrained,
        lambda p: p / "model.safetensors",
        "encoder.layer.0.intermediate.dense.weight",
        "encoder.layer.0.intermediate.dense2.weight",
    ),
    "llama": Loader(
        write_llama,
        lambda p, e: edit_safetensors(p / "model.safetensors", e),
        Llama.from_pretrained,
        lambda p: p / "model.safetensors",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.upper_proj.weight",
    ),
    "gguf": Loader(
        lambda folder: write_gguf_file(folder, lambda w: None),
        lambda p, e: write_gguf_file(p.parent, e),
        load_gguf,
        lambda p: p,
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.gate_proj.bias",
        "blk.0.ffn_up.weight",
        "blk.0.ffn_gate.bias",
    ),
    "ctranslate2": Loader(
        write_whisper,
        edit_ctranslate2,
        Whisper.from_ctranslate2,
        lambda p: p / "model.bin",
        "decoder/layer_0/ffn/linear_0/weight",
        "decoder/layer_0/ffn/linear_9/weight",
    ),
    "checkpoint": Loader(
        write_checkpoint,
        lambda p, e: edit_safetensors(p / "model.safetensors", e),
        load_checkpoint_weights,
        lambda p: p / "model.safetensors",
        "blocks.0.feed_forward.linear1.weight",
        "blocks.0.feed_forward.linear_1.weight",
    ),
}


def renamed(loader: Loader) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        tensors[loader.renamed] = tensors.pop(loader.tensor)

    return edit


def missing(loader: Loader) -> Callable[[dict], None]:
    return lambda tensors: tensors.pop(loader.tensor)


def reshaped(loader: Loader) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        tensor = tensors[loader.tensor]
        cut = tensor[..., :-1] if isinstance(tensor, torch.Tensor) else tensor[..., :-32]
        tensors[loader.tensor] = (
            cut.contiguous() if isinstance(cut, torch.Tensor) else (np.ascontiguousarray(cut))
        )

    return edit


def expected_message(kind: str, loader: Loader) -> str:
    name = repr(loader.stored or loader.tensor)
    if kind == "renamed":
        new = repr(loader.stored_renamed or loader.renamed)
        return f"1 tensor missing: {name}.*, and 1 unexpected: {new}"
    if kind == "missing":
        return f"1 tensor missing: {name}"
    return f"tensor {name} has shape"


@pytest.mark.parametrize("kind", ["renamed", "missing", "reshaped"])
@pytest.mark.parametrize("format", list(LOADERS))
def test_every_loader_refuses_a_renamed_missing_or_reshaped_tensor(tmp_path, format, kind):
    loader = LOADERS[format]
    target = loader.write(tmp_path / format)
    loader.load(target)  # the file as written loads
    edit = {"renamed": renamed, "missing": missing, "reshaped": reshaped}[kind]
    loader.edit(target, edit(loader))
    with pytest.raises(ValueError, match=expected_message(kind, loader)) as info:
        loader.load(target)
    text = str(info.value)
    assert "\n" not in text, text
    assert text.startswith(f"{loader.file(target)}: "), text


def test_loaded_weights_are_the_files(tmp_path):
    """What the loaders took from the tiny files is what the files hold."""
    from safetensors.torch import load_file

    path = write_gpt2(tmp_path / "gpt2")
    stored = load_file(path)
    gpt = load_gpt2(path)
    assert torch.equal(
        gpt.blocks[0].feed_forward.linear1.weight, stored["transformer.h.0.mlp.c_fc.weight"].t()
    )
    assert torch.equal(
        gpt.blocks[0].self_attn.v_proj.bias, stored["transformer.h.0.attn.c_attn.bias"][16:]
    )
    llama = Llama.from_pretrained(write_llama(tmp_path / "llama"))
    stored = load_file(tmp_path / "llama" / "model.safetensors")
    assert torch.equal(
        llama.layers[0].attn.out_proj.weight, stored["model.layers.0.self_attn.o_proj.weight"]
    )
    whisper = Whisper.from_ctranslate2(write_whisper(tmp_path / "whisper"))
    assert whisper.config.vocab_size == len(WHISPER_TOKENS) and whisper.config.prompt == (4, 5)
    from mhsa.formats import read_ctranslate2

    stored = read_ctranslate2(tmp_path / "whisper")
    assert torch.equal(
        whisper.decoder.layers[0].cross_attn.v_proj.weight,
        stored["decoder/layer_0/attention/linear_1/weight"][8:],
    )
    assert torch.equal(whisper.decoder.norm.bias, stored["decoder/layer_norm/beta"])


def test_bert_masked_lm_head_loads_when_the_file_has_it(tmp_path):
    """A BertForMaskedLM file ("bert." names and the cls.predictions head) gives the MLM
    logits transformers gives; a BertModel file (no head) loads too."""
    transformers = needs("transformers")
    config = transformers.BertConfig(
        vocab_size=13,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=12,
        max_position_embeddings=10,
    )
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
        hf.cls.predictions.bias.normal_()
    hf.save_pretrained(tmp_path)
    ours = Bert.from_pretrained(tmp_path)
    ids = torch.randint(0, 13, (2, 7))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours.mlm_logits(ours(ids))
    assert max_error(got, expected) < 1e-5


class Experts(torch.nn.Module):
    """Three experts stacked in one parameter, as a MoE layer keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.zeros(3, 4, 2))  # (experts, 2 + 2, in)


EXPERT_NAMES = NameTable(
    ("gate_up", "experts.gate_up_proj"),  # fused, as in memory
    ("gate_up", ("experts.{e}.gate.weight", "experts.{e}.up.weight")),  # one per expert
)


def test_a_stacked_rule_builds_row_e_from_expert_es_tensors_and_either_layout_loads():
    per_expert = {
        f"experts.{e}.{kind}.weight": torch.randn(2, 2) for e in range(3) for kind in ("gate", "up")
    }
    model = load_weights(Experts(), TensorDict(per_expert), EXPERT_NAMES)
    for e in range(3):
        want = torch.cat(
            [per_expert[f"experts.{e}.gate.weight"], per_expert[f"experts.{e}.up.weight"]]
        )
        assert torch.equal(model.gate_up[e], want)
    fused = {"experts.gate_up_proj": model.gate_up.detach().clone()}
    assert torch.equal(
        load_weights(Experts(), TensorDict(fused), EXPERT_NAMES).gate_up,
        fused["experts.gate_up_proj"],
    )
    missing = dict(per_expert)
    missing.pop("experts.2.up.weight")
    with pytest.raises(
        ValueError, match=r"1 tensor missing: 'experts.2.up.weight' \(for gate_up\)"
    ):
        load_weights(Experts(), TensorDict(missing), EXPERT_NAMES)


@pytest.mark.parametrize(
    "rule",
    [
        ("a", ("x.{e}.w", "y.w")),  # one piece without {e}
        (("a", "b"), "x.{e}.w"),  # several of ours stacked
    ],
)
def test_a_malformed_stacking_rule_is_refused_when_the_table_is_built(rule):
    with pytest.raises(ValueError, match="stored patterns with `\\{e\\}`"):
        NameTable(rule)
