"""Models built on mhsa.nn, one small file per family."""

from .ast import AST, ASTConfig
from .bert import Bert, BertConfig
from .deepseek import DeepSeek, DeepSeekConfig
from .gemma3 import Gemma3, Gemma3Config
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .llama4 import Llama4, Llama4Config
from .points import PointCloudConfig, PointCloudTransformer
from .seq2seq import Seq2Seq, Seq2SeqConfig
from .vit import ViT, ViTConfig
from .whisper import Whisper, WhisperConfig

__all__ = [
    "AST",
    "ASTConfig",
    "Bert",
    "BertConfig",
    "DeepSeek",
    "DeepSeekConfig",
    "Gemma3",
    "Gemma3Config",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "Llama4",
    "Llama4Config",
    "PointCloudConfig",
    "PointCloudTransformer",
    "Seq2Seq",
    "Seq2SeqConfig",
    "ViT",
    "ViTConfig",
    "Whisper",
    "WhisperConfig",
]
