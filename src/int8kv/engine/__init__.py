"""A small continuous-batching engine over the paged INT8 KV cache (in the spirit of nano-vllm)."""

from .llm import LLM, EngineStats, RequestOutput, parse_bytes
from .model import Batch, DecoderModel
from .sequence import SamplingParams, Sequence, Status

__all__ = [
    "LLM",
    "Batch",
    "DecoderModel",
    "EngineStats",
    "RequestOutput",
    "SamplingParams",
    "Sequence",
    "Status",
    "parse_bytes",
]
