"""Models built on mhsa.nn, one small file per family."""

from .ast import AST, ASTConfig
from .bert import Bert, BertConfig
from .gpt import GPT, GPTConfig
from .points import PointCloudConfig, PointCloudTransformer
from .vit import ViT, ViTConfig

__all__ = [
    "AST",
    "ASTConfig",
    "Bert",
    "BertConfig",
    "GPT",
    "GPTConfig",
    "PointCloudConfig",
    "PointCloudTransformer",
    "ViT",
    "ViTConfig",
]
