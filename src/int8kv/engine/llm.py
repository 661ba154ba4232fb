"""The engine's front door: prompts in, tokens out, with continuous batching over a paged cache.

    llm = LLM(model, kv_format="int8", memory="512MiB")
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))

`add_forked_request(prompt, params, n=4)` queues n choices of one prompt that share one prefill (the other
choices are copy-on-write forks of its blocks; docs/design.md, "Forked groups").

Prefix caching is on by default (full blocks keyed by a SHA-256 chain rooted in the model's fingerprint,
cache/prefix.py); `kv_store="embedded" | "disk:/path" | "redis://host:6379/0" | ...` adds a block store shared
with other processes (engine/store_tier.py). `close()` (or `with LLM(...) as llm:`) flushes and closes it.
A model with recurrent / conv layers (Qwen3-Next, Jamba, Bamba, LFM2, RecurrentGemma, ...) runs without them:
a cached block holds only attention K/V, not the state its other layers reached, so by default prefix caching
is off for it (logged), and asking for it (`prefix_caching=True`, `kv_store=`) is refused by name.

Error contract (docs/design.md, "Engine error contract"): everything a request can be refused for is checked
before any request of the call is queued (typed `InvalidRequest` / `KvPoolExhausted`, nothing changed); an
error that still happens inside a step fails only the request that causes it (`finish_reason == "error"`),
frees its blocks and leaves the engine as a fresh one would be. Calls from several threads are serialized.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..blockstore import BlockSpec, BlockStore, check_secret
from ..blockstore.base import check_namespace
from ..blockstore.codec_q4w import PageSpec
from ..cache.paged_q4w import plan_sizes, sealed_page_bytes
from ..cache.pool_q4w import PAGE
from ..cache.prefix import PrefixHasher
from ..cache.state import as_format
from ..errors import (
    InvalidEngineConfig,
    InvalidRequest,
    KvPoolExhausted,
    UnsupportedFormat,
    UnsupportedModel,
    UnsupportedWeights,
)
from ..formats import KvStorageFormat
from ..models.weights import check_weights, convert_weights
from ..ops import BACKENDS
from . import grammar
from .chat import chat_prompt_ids
from .grammar import Grammars
from .kv_events import KvEvents, KvEventsConfig
from .model import DecoderModel, check_fused
from .runner import ModelRunner
from .sampler import TokenLogprob, make_generator, sample, token_logprobs
from .scheduler import Scheduled, Scheduler
from .sequence import SamplingParams, Sequence, is_int, positive_int
from .step_threads import StepThreads
from .store_tier import PageStoreTier, StoreTier

# "transformers" serves every model; None (the default) picks "fused" for a model the fused forward implements
# exactly (check_fused: Llama / Qwen3 with nothing it refuses) and "transformers" for every other. With float32
# weights the generic path is a little slower than the fused forward; once the matmuls read packed GGUF blocks
# the rest of the step is what differs and the gap widens, the fused forward making 121 matmul calls a step and
# the model's own 211 (docs/archive/benchmarks-2026.md, "Engine model paths on SmolLM2-135M", "Packed GGUF
# weights").
IMPLEMENTATIONS = ("transformers", "fused")


def choose_implementation(hf_model: torch.nn.Module, implementation: str | None) -> str:
    """``implementation``, or for None "fused" where the fused forward runs ``hf_model`` exactly (check_fused; a
    model in training mode goes to the generic path, which refuses it by name), else "transformers"."""
    if implementation is not None:
        return implementation
    return "fused" if not hf_model.training and check_fused(hf_model) is None else "transformers"
logger = logging.getLogger("int8kv.engine")


def engine_model(hf_model: torch.nn.Module, implementation: str = "transformers", backend: str | None = None):
    """The engine's model for `hf_model`: a `TransformersModel` (the model's own forward over the paged cache)
    or, with "fused", the fused Llama/Qwen3 `DecoderModel`. Refusals are typed (UnsupportedModel /
    UnsupportedAttention) and leave the model as it was."""
    if implementation == "fused":
        return DecoderModel(hf_model, backend)  # refuses (UnsupportedModel) what it does not implement
    from .hf_model import TransformersModel

    return TransformersModel(hf_model, backend)


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(value: int | float | str) -> int:
    """'512MiB', '8GiB', '1.5GB' or a plain number of bytes; InvalidEngineConfig unless finite and >= 0."""
    if is_int(value):
        number, unit = float(value) if abs(value) < 2**1000 else math.inf, ""
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number, unit = float(value), ""
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):]
        try:
            number = float(digits) if digits and unit in _UNITS else None
        except ValueError:
            number = None
        if number is None:
            raise InvalidEngineConfig(f"cannot read a memory size from {value!r}; use e.g. 512MiB, 8GiB, 1GB")
    else:
        raise InvalidEngineConfig(f"a memory size is an int or a string such as '512MiB', got {value!r}")
    size = number * _UNITS[unit]
    if not math.isfinite(size) or size < 0:
        raise InvalidEngineConfig(f"a memory size must be a finite number of bytes >= 0, got {value!r}")
    return int(size)


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    num_preemptions: int
    finish_reason: str = "length"  # "stop" (EOS), "length" (max_tokens) or "error"
    error: str | None = None  # with finish_reason "error": the exception, as "Type: message"
    logprobs: list[TokenLogprob] | None = None  # per output token, with SamplingParams.logprobs
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (Sequence.num_cached_prompt)


@dataclass
class RequestUpdate:
    """What one online request (`LLM.add_request`) produced since the previous `LLM.pop_updates()`."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # once finished: as RequestOutput.finish_reason ("stop", "length", "error")
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int  # all generated so far, new_token_ids included
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, with SamplingParams.logprobs
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (Sequence.num_cached_prompt)
    admitted_at: float | None = None  # time.perf_counter() of its first step (None: it has not run yet)


@dataclass
class _Live:
    seq: Sequence
    sent: int = 0  # output tokens already handed out by pop_updates


@dataclass
class EngineStats:
    """What the engine ran since it was built (assign a fresh EngineStats() to start counting anew).

    Token counters count tokens of requests whose step succeeded:
      prefill_tokens    prompt tokens run through the model, plus tokens recomputed after a preemption (a
                        forked group's prompt counts once: its n choices share one prefill)
      decode_tokens     generated tokens fed back through the model (one per decoding sequence per step)
      generated_tokens  tokens sampled and handed to requests (each request's first comes from its prefill;
                        a forked group's n first tokens all come from its one prefill)
    The decode phase is the steps that decode the whole batch: every request queued since the engine was last
    idle is running and feeds back one generated token (none waits, prefills, or has finished; see
    `Scheduler.in_decode_phase`). `decode_tokens_per_s` is the tokens generated in those steps over their wall
    time: "tokens per second while all the batch's sequences decode", whatever the prefill chunking; the
    figure transformers' generate gives when timed once per token after the first. It is 0.0 when the batch
    never decoded whole (e.g. more requests than max_num_seqs, or sequences staggered by chunked prefill
    that finish before the last one has started decoding).
    """

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    failed_requests: int = 0
    seconds: float = 0.0
    peak_blocks_used: int = 0
    decode_phase_steps: int = 0
    decode_phase_tokens: int = 0
    decode_phase_seconds: float = 0.0
    # Prefix caching, counted at admission: tokens of full blocks offered as keys, of those found in the pool,
    # and loaded from the block store (neither is in prefill_tokens); store fetches that fell short or failed.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    store_hit_tokens: int = 0
    store_faults: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_phase_tokens / self.decode_phase_seconds if self.decode_phase_seconds else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """(pool + store hit tokens) / queried tokens; 0.0 before any query."""
        hits = self.prefix_hit_tokens + self.store_hit_tokens
        return hits / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


class LLM:
    def __init__(
        self,
        model: str | torch.nn.Module,
        kv_format: KvStorageFormat | str = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        memory: int | str = "256MiB",
        block_size: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        tokenizer=None,
        prefix_caching: bool | None = None,
        kv_store: str | BlockStore | bool | None = None,
        kv_namespace: str = "int8kv",
        model_id: str | None = None,
        kv_store_secret: str | bytes | None = None,
        implementation: str | None = None,
        backend: str | None = None,
        weights: str = "model",
        threads: int | None = None,
        kv_events_config: KvEventsConfig | str | dict | None = None,
    ) -> None:
        """`prefix_caching`: None (the default) is on, except for a model with state layers (then off, logged);
        True asks for it (refused by name for such a model). `kv_store`: a block store URL (`True` is
        "embedded") or an open BlockStore (left open); it needs prefix caching. `kv_store_secret` (at least 16
        bytes; default: the INT8KV_KV_STORE_SECRET variable) authenticates the store's values with an HMAC, for a
        URL (an open store has its own). `model_id`
        replaces the weights' SHA-256 in the key root (the model fingerprint, int8kv.store.model_fingerprint):
        equal ids must mean equal K/V. `implementation`: "transformers" runs the model's own forward over the
        paged cache (any decoder whose attention goes through transformers' attention interface,
        engine/hf_model.py), "fused" the engine's own Llama/Qwen3 forward (engine/model.py, refusing every config
        field it does not implement), None (the default) the fused one where it implements the model exactly
        and the model's own otherwise (`choose_implementation`). `backend`: the attention kernels (int8kv.ops.BACKENDS;
        None: "cpu" or "triton" from the pool's device). `weights`: the precision of the model's matmuls,
        "model" (its own weights exactly, GGUF blocks run packed), "dense" (as loaded, torch's matmuls),
        "bfloat16" or "int8" (int8kv.models.weights; a passed model is copied, not changed; the prefix-cache key
        root hashes the weights that run). `threads` (CPU): None runs each step on one thread or on every CPU the
        process may use, whichever is measured faster under the machine's current load (engine/step_threads.py);
        a number fixes it. `block_size`: None is 16 positions, 64
        for ``int4_kchan64_vtok_asym_sink4_win64_v1`` (its pages; another size is refused by name), which runs
        with prefix caching, forks (cache/paged_q4w.py) and the block store (its pages: engine/store_tier.py).
        `kv_events_config`: vLLM's KV events (engine/kv_events.py: JSON text, a dict or a KvEventsConfig); with
        `enable_kv_cache_events` each step publishes the blocks its prefix cache stored and evicted."""
        # Every setting is checked before the model is loaded or a byte of the pool allocated.
        self._closer = None
        self._kv_events: KvEvents | None = None
        if kv_events_config is not None and not isinstance(kv_events_config, KvEventsConfig):
            kv_events_config = KvEventsConfig.parse(kv_events_config)
        budget = parse_bytes(memory)
        if prefix_caching is not None and not isinstance(prefix_caching, bool):
            raise InvalidEngineConfig(f"prefix_caching must be None or a bool, got {prefix_caching!r}")
        if kv_store is True:
            kv_store = "embedded"
        if kv_store is not None and kv_store is not False:
            if not isinstance(kv_store, str | BlockStore):
                raise InvalidEngineConfig(f"kv_store must be a URL, a BlockStore or None, got {kv_store!r}")
            if prefix_caching is False:
                raise InvalidEngineConfig("kv_store needs prefix_caching=True (blocks are found by their keys)")
            check_namespace(kv_namespace)  # InvalidBlockKey
            check_secret(kv_store_secret)  # InvalidStoreSecret
            if kv_store_secret is not None and isinstance(kv_store, BlockStore):
                raise InvalidEngineConfig("kv_store_secret is for a store URL; an open BlockStore has its own secret")
        if implementation is not None and implementation not in IMPLEMENTATIONS:
            raise InvalidEngineConfig(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        try:
            check_weights(weights)
        except UnsupportedWeights as e:
            raise InvalidEngineConfig(str(e)) from None
        if backend is not None and backend not in BACKENDS:
            raise InvalidEngineConfig(f"backend must be None or one of {BACKENDS}, got {backend!r}")
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise InvalidEngineConfig(f"model_id must be a non-empty string or None, got {model_id!r}")
        if threads is not None:
            positive_int(threads, "threads", InvalidEngineConfig)
        positive_int(max_num_seqs, "max_num_seqs", InvalidEngineConfig)
        positive_int(max_num_batched_tokens, "max_num_batched_tokens", InvalidEngineConfig)
        try:
            self.format = as_format(kv_format)
        except ValueError as e:
            raise InvalidEngineConfig(str(e)) from None
        stateful = self.format.is_stateful
        if block_size is None:
            block_size = PAGE if stateful else 16
        block_size = positive_int(block_size, "block_size", InvalidEngineConfig)
        if stateful:
            prefix_caching = self._stateful_checks(block_size, prefix_caching, kv_store)
        if isinstance(model, torch.nn.Module):
            hf_model = model
        else:
            from ..models import load_model

            hf_model, loaded_tokenizer = load_model(model, weights=weights)  # "dense": a GGUF's float32 conversion
            tokenizer = tokenizer or loaded_tokenizer
        implementation = choose_implementation(hf_model, implementation)
        # A model of the caller's is copied; one loaded here is converted in place. The generic path probes the
        # architecture (does the model's own forward follow the engine's plan?) before the conversion: in
        # bfloat16 matmuls a K/V's F16 rounding flips roundings downstream, and SmolLM2's probe logits moved by
        # 0.025 (int8) / 0.10 (bfloat16) of their range against its own forward, beyond any tolerance that
        # still tells a wrong mask (0.65) from noise; the conversion changes no module the probe depends on.
        # Packing ("model") keeps every weight's value: the probe runs on the packed layers.
        probe_first = implementation == "transformers" and weights in ("bfloat16", "int8")
        try:
            if probe_first:
                hf_model = copy.deepcopy(hf_model) if hf_model is model else hf_model
                self.model = engine_model(hf_model, implementation, backend)
            hf_model = convert_weights(hf_model, weights, inplace=probe_first or hf_model is not model)
        except UnsupportedWeights as e:
            raise InvalidEngineConfig(str(e)) from None
        self.tokenizer = tokenizer
        self.eos_token_id = hf_model.config.eos_token_id
        if not probe_first:
            self.model = engine_model(hf_model, implementation, backend)
        # Per-sequence recurrent / conv state (engine/hf_model.py SequenceStates), None for attention-only models.
        self._states = getattr(self.model, "states", None)
        if self._states is not None:
            prefix_caching = self._without_prefix_cache(prefix_caching, kv_store)
        prefix_caching = prefix_caching is not False
        self.vocab_size = self.model.vocab_size
        self.max_positions = self.model.max_positions
        m = self.model
        # A block holds its tokens in every group's pool: each sized for its own shape (with several block tables,
        # one pool whose block holds one table group's layers).
        pool: dict[str, int] = {}
        if stateful:
            # Window pages and sink slots for the worst step first, the rest in sealed pages (cache/paged_q4w.py).
            layout = m.layouts_for(self.format)[0]  # every K/V layer on one table (engine/hf_model.py)
            num_blocks, pool["window_pages"], pool["sink_slots"] = plan_sizes(budget, layout, max_num_seqs,
                                                                             max_num_batched_tokens)  # fmt: skip
            per_block = sealed_page_bytes(layout)
            held = budget  # the window pages and sink slots, then whole sealed pages: at most the budget
        else:
            per_block = sum(la.with_format(self.format).bytes_per_block(block_size) for la in m.layouts)
            num_blocks = budget // per_block
            held = num_blocks * per_block
        if num_blocks < 1:
            extra = " after its window pages and sink slots" if stateful else ""
            raise KvPoolExhausted(f"memory budget {memory!r} holds no block{extra} ({per_block} bytes each)")
        _check_host_memory(held, memory)
        try:
            self.cache = m.make_cache(num_blocks, block_size, self.format, **pool)
        except UnsupportedFormat:  # a NotImplementedError, hence a RuntimeError: a refusal, not an allocation
            raise
        except (RuntimeError, MemoryError) as e:  # the allocator refused (memory taken by other processes)
            raise InvalidEngineConfig(f"cannot allocate the pool for memory budget {memory!r}: {e}") from None
        hasher, tier, self.fingerprint = None, None, None
        if prefix_caching:
            from ..store import model_fingerprint

            self.fingerprint = model_fingerprint(hf_model, model_id).digest
            # Several K/V shapes (one pool each): the keys cover every group's shape, the values are version 3.
            # The 4-bit cache exports no state: its keys cover its one layout (format name included).
            hasher = PrefixHasher(self.cache.layouts if stateful else self.cache.state_layouts, self.fingerprint,
                                  block_size)
            if kv_store and stateful:  # pages of the 4-bit format: sealed values and end values (store_tier.py)
                tier = PageStoreTier.open(kv_store, PageSpec(self.cache.layout, self.fingerprint), self.cache,
                                          kv_namespace, kv_store_secret)  # fmt: skip
                self._closer = weakref.finalize(self, tier.close)
            elif kv_store:
                spec = BlockSpec(self.cache.state_layouts, block_size, self.fingerprint)
                tier = StoreTier.open(kv_store, spec, self.cache, kv_namespace, kv_store_secret)
                self._closer = weakref.finalize(self, tier.close)  # also at interpreter exit
        self.kv_store = tier.store if tier is not None else None
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens, hasher, tier, self._states)
        if self._states is None:
            self.runner = ModelRunner(self.model, self.cache)
        else:
            from .hf_model import SequenceRunner

            self.runner = SequenceRunner(self.model, self.cache)
        self.threads = StepThreads(threads) if self.cache.device.type == "cpu" else None
        if kv_events_config is not None and kv_events_config.enable_kv_cache_events:
            self._kv_events = KvEvents(kv_events_config, self.cache.block_size, self.cache.allocator.num_groups)
            self.cache.allocator.events = self._kv_events.log
            weakref.finalize(self, self._kv_events.close)
        self.stats = EngineStats()
        # generate/step/score from several threads run one at a time (an engine step is not reentrant).
        self._lock = threading.RLock()
        self._live: dict[int, _Live] = {}  # online requests (add_request) whose last update is not yet popped

    def _stateful_checks(self, block_size: int, prefix_caching: bool | None, kv_store: Any) -> bool | None:
        """The 4-bit format's engine settings, refused by name before the model loads: its block size (a page of
        64). Prefix caching stays as asked (on by default: cache/paged_q4w.py); the block store holds its pages
        (engine/store_tier.py, PageStoreTier)."""
        name = self.format.value
        if block_size != PAGE:
            raise InvalidEngineConfig(f"the {name} format stores blocks of {PAGE} positions; block_size={block_size}")
        return prefix_caching

    def _without_prefix_cache(self, prefix_caching: bool | None, kv_store: Any) -> bool:
        """Prefix caching (and with it the block store) for a model with state layers: a cached block holds only
        attention K/V, not the recurrent / conv state the model's other layers reached at its end, so a hit would
        skip tokens those layers never saw. Off by default (logged); refused when asked for."""
        layers = sorted({spec.layer_type for spec in self.model.attention if spec.state})
        why = f"{type(self.model.hf).__name__} keeps a recurrent / conv state in its {', '.join(layers)} layers"
        if prefix_caching or (kv_store is not None and kv_store is not False):
            what = "prefix_caching=True" if prefix_caching else "kv_store (which needs prefix caching)"
            raise UnsupportedModel(f"{what} is not supported for this model: {why}, which no cached block holds")
        if prefix_caching is None:
            logger.info("prefix caching is off: %s, which no cached block holds", why)
        return False

    # -- public -------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int | list[int] | None:
        """The token(s) that end a request (unless SamplingParams.ignore_eos); from the model's config."""
        return self._eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, value: int | list[int] | None) -> None:
        ids = [] if value is None else list(value) if isinstance(value, list | tuple) else [value]
        if not all(is_int(t) for t in ids):
            raise InvalidEngineConfig(f"eos_token_id must be None, an int or a list of ints, got {value!r}")
        self._eos_token_id = value
        self.eos_ids = tuple(int(t) for t in ids)
        self._grammars: Grammars | None = None  # compiled for these stop tokens

    @property
    def grammars(self) -> Grammars:
        """Structured outputs' compiler and compiled grammars (engine/grammar.py), made at first use."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._grammars

    def generate(
        self,
        prompts: str | Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        on_step: Callable[[EngineStats], None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. A request refused up front raises (and none of the call is
        queued); one that fails mid-step comes back with finish_reason "error" while the others complete."""
        with self._lock:
            seqs = self._requests(prompts, params)
            self.scheduler.add(seqs)  # all or none
            try:
                while any(s.finish_reason is None for s in seqs):
                    if not self.step():
                        break  # nothing could be scheduled (cannot happen after check_fits; never spin)
                    if on_step is not None:
                        on_step(self.stats)
            finally:
                # Only reached with work left if something escaped step() (KeyboardInterrupt, a bug, an
                # on_step error): take this call's requests out so the engine stays usable.
                for seq in seqs:
                    if seq.finish_reason is None:
                        self.scheduler.fail(seq, "aborted: generate() was interrupted")
            return [self._output(s) for s in seqs]

    def chat(
        self,
        messages: Seq[Mapping[str, Any]] | Seq[Seq[Mapping[str, Any]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        on_step: Callable[[EngineStats], None] | None = None,
    ) -> list[RequestOutput]:
        """The assistant's reply to one conversation (a list of ``{"role", "content"}`` messages) or to each
        of a list of conversations, through the tokenizer's chat template: one output per conversation, as
        `generate` returns them. InvalidRequest (nothing queued) without a chat template or for a bad message."""
        many = isinstance(messages, Seq) and not isinstance(messages, str) and messages and not isinstance(
            messages[0], Mapping)
        conversations = messages if many else [messages]
        return self.generate([chat_prompt_ids(self.tokenizer, c) for c in conversations], params, on_step)

    def step(self) -> int:
        """Schedule, run the packed batch, sample, retire finished or failed requests; returns the batch size."""
        with self._lock:
            start, preempted = time.perf_counter(), self.scheduler.num_preemptions
            batch = self.scheduler.schedule()
            if not batch:
                return 0
            used = self.cache.num_blocks - self.cache.num_free_blocks  # the step's peak: before anyone finishes
            decode_phase = self.scheduler.in_decode_phase(batch)
            for item in batch:  # only an admission has hits; counted for the first one (before any preemption)
                if item.seq.num_preemptions == 0:
                    item.seq.num_cached_prompt += item.hit_tokens + item.store_tokens
            if self.threads is None:
                logits, errors = self.runner.run(batch)
            else:
                logits, errors = self.threads.run(sum(item.num_tokens for item in batch),
                                                  lambda: self.runner.run(batch))
            generated = self._retire(batch, logits, errors)
            self._record(batch, errors, generated, decode_phase, preempted, used, time.perf_counter() - start)
            if self._kv_events is not None:
                self._kv_events.flush()
            return len(batch)

    def score(self, token_ids: Seq[int], chunk_size: int = 256) -> torch.Tensor:
        """Teacher-forced logits [len, vocab] of one sequence, prefilled chunk by chunk through the cache.

        Each chunk's K/V is written first and then read back in the storage format, as in generation,
        so the logits carry exactly the error the format adds (llama.cpp's perplexity tool does the same).
        """
        with self._lock:
            chunk_size = positive_int(chunk_size, "chunk_size")
            ids = self._token_ids(token_ids)
            return torch.cat(list(self._score_chunks(ids, chunk_size)))

    def prompt_logprobs(self, token_ids: Seq[int], k: int = 0, chunk_size: int = 256) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability given the tokens before it, and the `k` (0-20) most likely
        alternatives there, from `score`'s teacher-forced logits; None for the first token (nothing predicts
        it). Converted chunk by chunk, so memory stays one chunk of logits."""
        with self._lock:
            chunk_size = positive_int(chunk_size, "chunk_size")
            ids = self._token_ids(token_ids)
            SamplingParams(logprobs=k)  # the same check as a generated token's
            out: list[TokenLogprob | None] = [None]
            done = 0
            for logits in self._score_chunks(ids, chunk_size):
                n = len(logits) - (done + len(logits) == len(ids))  # the last position predicts no prompt token
                out += token_logprobs(logits[:n], ids[done + 1 : done + 1 + n], k)
                done += len(logits)
            return out

    def _score_chunks(self, ids: list[int], chunk_size: int):
        """Yield the teacher-forced logits of `ids` chunk by chunk (`score`); the sequence is freed at the end."""
        if len(ids) > self.max_positions:
            raise InvalidRequest(f"{len(ids)} tokens exceed the model's {self.max_positions} positions")
        if not self.cache.allocator.can_add(len(ids)):
            raise KvPoolExhausted(f"{len(ids)} tokens do not fit in the free part of the pool")
        if self.format.is_stateful:  # its window pages are sized for chunks of the engine's token budget
            chunk_size = min(chunk_size, self.scheduler.max_num_batched_tokens)
        seq = Sequence(ids, SamplingParams(max_tokens=1))
        self.cache.add_sequence(seq.seq_id, 0)
        try:
            while seq.num_uncached:
                n = min(chunk_size, seq.num_uncached)
                seq.slots = self.cache.grow(seq.seq_id, n)
                yield self.runner.forward([Scheduled(seq, n)], all_logits=True)
                seq.num_cached += n
        finally:
            self.cache.free(seq.seq_id)
            if self._states is not None:
                self._states.free(seq.seq_id)

    def flush_kv_store(self, timeout: float | None = None) -> bool:
        """Wait until the blocks queued for the KV store are written; False if `timeout` passed first."""
        tier = self.scheduler.tier
        return True if tier is None else tier.flush(timeout)

    def close(self) -> None:
        """Flush (at most 5 s) and close the KV store this engine opened, and its embedded server; idempotent.
        The engine keeps working without a store."""
        with self._lock:
            self.scheduler.tier = None
            if self._closer is not None:
                self._closer()
            if self._kv_events is not None:
                self._kv_events.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def kv_bytes_per_token(self) -> int:
        """Bytes of K/V one token takes while every block table holds it (a sliding table gives its blocks back
        once they leave the window)."""
        # The cache's layouts: a pool per table group (the 4-bit format: every layer on one table, which keeps
        # every page). The 4-bit format's figure is its sealed rows' (the long-context cost, F16 sinks and window
        # left out), a whole number of bytes for a head_dim that is a multiple of 16.
        return math.ceil(self.cache.num_tables * sum(la.bytes_per_token for la in self.cache.layouts))

    # -- online: requests join, stream and leave between steps ---------------------------------------------
    # The server's engine thread: add_request() whenever a request arrives, step() while has_unfinished(),
    # pop_updates() after each step for every request's new tokens, abort_request() when a client goes away.
    def add_request(self, prompt: str | Seq[int] | torch.Tensor, params: SamplingParams | None = None) -> int:
        """Queue one request and return its id; refused up front (InvalidRequest / KvPoolExhausted, nothing
        queued) for exactly what `generate` refuses. Its tokens come out of `pop_updates`."""
        with self._lock:
            (seq,) = self._requests([prompt], params)
            self.scheduler.add([seq])
            self._live[seq.seq_id] = _Live(seq)
            return seq.seq_id

    def add_forked_request(
        self, prompt: str | Seq[int] | torch.Tensor, params: SamplingParams | Seq[SamplingParams] | None = None,
        n: int | None = None,
    ) -> list[int]:
        """Queue n choices of one prompt whose prefill runs once, and return their n request ids (choice order).

        `params`: one SamplingParams per choice (n = their number), or one for all with `n` (choice j then has
        seed + j when seeded, so each choice equals an independent `add_request` with that seed). The first
        choice's sequence prefills the prompt; when its first token is due, the other n - 1 are forked off its
        blocks copy-on-write (`Scheduler.fork`), each choice samples its first token from the same prompt
        logits with its own generator, and all decode as ordinary sequences. The group is refused up front,
        nothing queued, for what `add_request` refuses and when it cannot run whole: more than `max_num_seqs`
        choices (InvalidRequest) or more blocks than the pool (the prompt's full blocks once plus each choice's
        own, KvPoolExhausted). Each id streams, finishes and aborts on its own (`abort_request`)."""
        with self._lock:
            if n is not None:
                n = positive_int(n, "n")
                if not isinstance(params, SamplingParams | None):
                    raise InvalidRequest("with n, params is one SamplingParams for all choices")
                one = params or SamplingParams()
                params = [one if one.seed is None else replace(one, seed=one.seed + j) for j in range(n)]
            elif params is None or isinstance(params, SamplingParams):
                params = [params or SamplingParams()]
            elif not isinstance(params, Seq) or not params:
                raise InvalidRequest("params must be a SamplingParams (with n) or a non-empty list, one per choice")
            ids = self._encode(prompt)
            seqs = self._requests([ids] * len(params), list(params))
            first, forks = seqs[0], seqs[1:]
            for seq in forks:
                seq.prompt = first.prompt  # one list: the choices share the prompt
                seq.fork_of = first
            first.forks = forks
            self.scheduler.add([first])  # check_fits sees the whole group
            for seq in seqs:
                self._live[seq.seq_id] = _Live(seq)
            return [seq.seq_id for seq in seqs]

    def abort_request(self, request_id: int) -> bool:
        """Take a request out (running or waiting) and free its blocks now; False if it is not live (unknown,
        or finished and already popped). Its pending update, if any, is dropped. For a choice of a forked
        group only that choice ends; the blocks it shares stay with the others (Scheduler.abort)."""
        with self._lock:
            live = self._live.pop(request_id, None)
            if live is None:
                return False
            if live.seq.finish_reason is None:
                self.scheduler.abort(live.seq)
            return True

    def pop_updates(self) -> list[RequestUpdate]:
        """Per live request, the tokens it produced since the last call; a finished request appears once more
        with `finished` set (and its last tokens), then is forgotten. Requests with nothing new are left out."""
        with self._lock:
            out = []
            for request_id, live in list(self._live.items()):
                seq, sent = live.seq, live.sent
                done = seq.finish_reason is not None
                if len(seq.output) == sent and not done:
                    continue
                live.sent = len(seq.output)
                new_logprobs = seq.logprobs[sent:] if seq.params.logprobs is not None else None
                out.append(RequestUpdate(request_id, seq.output[sent:], done, seq.finish_reason, seq.error,
                                         len(seq.prompt), len(seq.output), new_logprobs, seq.num_cached_prompt,
                                         seq.admitted_at))
                if done:
                    del self._live[request_id]
            return out

    def has_unfinished(self) -> bool:
        """Anything queued or running (from add_request or generate): step() has work."""
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        """Requests holding a seat in the running batch (a forked group's choices all hold one from its start)."""
        return self.scheduler.num_choices(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a seat (a queued forked group counts its n choices)."""
        return self.scheduler.num_choices(self.scheduler.waiting)

    # -- requests -----------------------------------------------------------------
    def _requests(
        self, prompts: str | Seq[str] | Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None
    ) -> list[Sequence]:
        """Validated sequences for a call; raises InvalidRequest before anything is queued."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Seq):
            raise InvalidRequest(f"prompts must be a list of strings or token-id lists, got {type(prompts).__name__}")
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        elif isinstance(params, Seq) and all(isinstance(p, SamplingParams) for p in params):
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise InvalidRequest(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        else:
            raise InvalidRequest("params must be a SamplingParams or one per prompt")
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            ids = self._encode(prompt, i)
            if len(ids) + p.max_tokens > self.max_positions:
                raise InvalidRequest(
                    f"prompt {i}: {len(ids)} prompt + {p.max_tokens} new tokens exceed the model's "
                    f"{self.max_positions} positions (max_position_embeddings)"
                )
            if p.logit_bias and p.logit_bias[-1][0] >= self.vocab_size:
                raise InvalidRequest(f"prompt {i}: logit_bias names token id {p.logit_bias[-1][0]}, not in "
                                     f"[0, {self.vocab_size}) (the vocabulary)")
            seq = Sequence(ids, p)
            seq.generator = make_generator(p, seq.seq_id)
            if p.guide is not None:
                seq.matcher = self.grammars.matcher(p.guide)
            seqs.append(seq)
        return seqs

    def _encode(self, prompt: str | Seq[int] | torch.Tensor, index: int = 0) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("text prompts need a tokenizer; pass token ids or a tokenizer")
            encoded = self.tokenizer(prompt)
            ids = encoded.get("input_ids") if hasattr(encoded, "get") else encoded
            if ids is None:
                raise InvalidRequest(f"prompt {index}: the tokenizer returned no input_ids")
            return self._token_ids(ids, index)
        return self._token_ids(prompt, index)

    def _token_ids(self, ids: Seq[int] | torch.Tensor, index: int = 0) -> list[int]:
        """A prompt as a list of ints in [0, vocab_size); InvalidRequest for anything else (3.7, True, -1)."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise InvalidRequest(f"prompt {index}: a tensor prompt must be 1-d integer, got {ids.dtype} "
                                     f"{tuple(ids.shape)}")
            ids = ids.tolist()
        if isinstance(ids, str | bytes) or not isinstance(ids, Seq):
            raise InvalidRequest(f"prompt {index}: expected a string or a list of token ids, got {type(ids).__name__}")
        if not ids:
            raise InvalidRequest(f"prompt {index} is empty (a request needs at least one token)")
        for t in ids:
            if not is_int(t) or not 0 <= t < self.vocab_size:
                raise InvalidRequest(
                    f"prompt {index}: token id {t!r} is not an int in [0, {self.vocab_size}) (the vocabulary)"
                )
        return [int(t) for t in ids]

    # -- one step -----------------------------------------------------------------
    def _retire(self, batch: list[Scheduled], logits: torch.Tensor, errors: list[Exception | None]) -> int:
        """Advance each item, sample the sequences that are fully cached, finish or fail them; tokens sampled."""
        due: list[int] = []
        for row, (item, error) in enumerate(zip(batch, errors, strict=True)):
            if error is not None:
                self.stats.failed_requests += len(item.seq.forks)  # forks waiting on it fail with it
                self.scheduler.fail(item.seq, error)
            elif self.scheduler.advance(item):
                due.append(row)
        if not due:
            return 0
        # A sequence whose prefill just ended with forks waiting on it is forked here, and every choice of the
        # group samples its first token from the same row of logits (with its own params and generator).
        picked: list[int] = []
        seqs: list[Sequence] = []
        for row in due:
            seq = batch[row].seq
            group = [seq, *self.scheduler.fork(seq)] if seq.forks else [seq]
            for fork in group[1:]:
                fork.num_cached_prompt = seq.num_cached_prompt  # the prompt they share was found so
            seqs.extend(group)
            picked.extend([row] * len(group))
        rows = logits if picked == list(range(len(batch))) else logits[picked]
        masked, dead = self.grammars.mask(rows, [s.matcher for s in seqs])
        tokens = sample(masked, [s.params for s in seqs], [s.generator for s in seqs],
                        [(s.prompt, s.output) for s in seqs])
        for j in dead:
            tokens[j] = InvalidRequest("the request's structured output allows no token of this model's vocabulary "
                                       "here")
        self._logprobs(rows, seqs, tokens)  # of the model's own distribution, before penalties and masks
        generated = 0
        for seq, token in zip(seqs, tokens, strict=True):
            if not isinstance(token, Exception) and seq.matcher is not None and not grammar.accept(seq.matcher, token):
                token = RuntimeError(f"the grammar refused token {token} that its mask allowed")
            if isinstance(token, Exception):
                self.scheduler.fail(seq, token)
            else:
                generated += 1
                if seq.append(token, self.eos_ids, seq.matcher is not None and grammar.finished(seq.matcher)):
                    self.scheduler.finish(seq)
        return generated

    @staticmethod
    def _logprobs(rows: torch.Tensor, seqs: list[Sequence], tokens: list) -> None:
        """Append each sampled token's TokenLogprob to the sequences that asked (nothing runs otherwise)."""
        want = [j for j, (s, t) in enumerate(zip(seqs, tokens, strict=True))
                if s.params.logprobs is not None and not isinstance(t, Exception)]
        if not want:
            return
        k = max(seqs[j].params.logprobs for j in want)
        for j, entry in zip(want, token_logprobs(rows[want], [tokens[j] for j in want], k), strict=True):
            seqs[j].logprobs.append(replace(entry, top=entry.top[: seqs[j].params.logprobs]))

    def _record(
        self,
        batch: list[Scheduled],
        errors: list,
        generated: int,
        decode_phase: bool,
        preempted: int,
        blocks_used: int,
        elapsed: float,
    ) -> None:
        s = self.stats
        s.peak_blocks_used = max(s.peak_blocks_used, blocks_used)
        ok = [item for item, e in zip(batch, errors, strict=True) if e is None]
        decode = sum(1 for item in ok if item.is_decode)
        s.steps += 1
        s.decode_tokens += decode
        s.prefill_tokens += sum(item.num_tokens for item in ok) - decode
        s.generated_tokens += generated
        s.failed_requests += sum(e is not None for e in errors)
        s.preemptions += self.scheduler.num_preemptions - preempted
        s.seconds += elapsed
        for item in batch:
            s.prefix_queried_tokens += item.queried_tokens
            s.prefix_hit_tokens += item.hit_tokens
            s.store_hit_tokens += item.store_tokens
            s.store_faults += item.store_faults
        if decode_phase:
            s.decode_phase_steps += 1
            s.decode_phase_tokens += generated
            s.decode_phase_seconds += elapsed

    def _output(self, seq: Sequence) -> RequestOutput:
        text = None if self.tokenizer is None else self.tokenizer.decode(seq.output, skip_special_tokens=True)
        return RequestOutput(
            list(seq.prompt), list(seq.output), text, seq.num_preemptions, seq.finish_reason or "length", seq.error,
            list(seq.logprobs) if seq.params.logprobs is not None else None, seq.num_cached_prompt,
        )


def _check_host_memory(pool_bytes: int, memory: int | str) -> None:
    """Refuse a CPU pool larger than the machine's physical memory before trying to allocate it."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system: let the allocation decide
        return
    if pool_bytes > physical:
        raise InvalidEngineConfig(
            f"memory budget {memory!r} asks for a {pool_bytes:,}-byte pool; this machine has {physical:,} bytes"
        )
