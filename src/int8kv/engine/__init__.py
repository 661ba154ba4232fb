"""A small continuous-batching engine over the paged INT8 KV cache (in the spirit of nano-vllm).

llm.py (the front door and its error contract), scheduler.py (who runs, how many tokens), runner.py (one
packed Batch per step, failures isolated), sampler.py (penalties; greedy, temperature, min-p, top-k, top-p),
grammar.py (structured outputs), hf_model.py (any transformers decoder's own forward over the paged cache),
model.py (the fused Llama/Qwen3 forward).
"""

from ..errors import InvalidEngineConfig, InvalidRequest
from .grammar import Guide
from .hf_model import TransformersModel
from .llm import LLM, EngineStats, RequestOutput, RequestUpdate, parse_bytes
from .model import Batch, DecoderModel
from .runner import ModelRunner
from .sampler import probabilities, sample
from .scheduler import Scheduled, Scheduler
from .sequence import SamplingParams, Sequence, Status

__all__ = [
    "LLM",
    "Batch",
    "DecoderModel",
    "EngineStats",
    "Guide",
    "InvalidEngineConfig",
    "InvalidRequest",
    "ModelRunner",
    "RequestOutput",
    "RequestUpdate",
    "SamplingParams",
    "Scheduled",
    "Scheduler",
    "Sequence",
    "Status",
    "TransformersModel",
    "parse_bytes",
    "probabilities",
    "sample",
]
