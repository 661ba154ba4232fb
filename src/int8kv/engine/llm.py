"""The engine's front door: prompts in, tokens out, with continuous batching over a paged cache.

    llm = LLM(model, kv_format="int8", memory="512MiB")
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from ..cache.paged import PagedKvCache
from ..errors import KvPoolExhausted
from ..formats import KvStorageFormat
from .model import Batch, DecoderModel
from .scheduler import Scheduled, Scheduler
from .sequence import SamplingParams, Sequence

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(value: int | str) -> int:
    """'512MiB', '8GiB', '1.5GB' or a plain number of bytes."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):]
    if unit not in _UNITS or not number:
        raise ValueError(f"cannot read a memory size from {value!r}; use e.g. 512MiB, 8GiB, 1GB")
    return int(float(number) * _UNITS[unit])


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    num_preemptions: int


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    seconds: float = 0.0
    peak_blocks_used: int = 0
    # Steps in which every scheduled sequence decoded one token: the steady-state decode rate.
    decode_steps: int = 0
    decode_step_tokens: int = 0
    decode_step_seconds: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_step_tokens / self.decode_step_seconds if self.decode_step_seconds else 0.0


class LLM:
    def __init__(
        self,
        model: str | torch.nn.Module,
        kv_format: KvStorageFormat | str = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1,
        memory: int | str = "256MiB",
        block_size: int = 16,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        tokenizer=None,
    ) -> None:
        if isinstance(model, torch.nn.Module):
            hf_model = model
        else:
            from ..models import load_model

            hf_model, loaded_tokenizer = load_model(model)
            tokenizer = tokenizer or loaded_tokenizer
        self.tokenizer = tokenizer
        self.eos_token_id = hf_model.config.eos_token_id
        self.model = DecoderModel(hf_model)
        self.format = _as_format(kv_format)
        m = self.model
        num_blocks = PagedKvCache.blocks_for_memory(
            parse_bytes(memory), block_size, m.num_layers, m.num_kv_heads, m.head_dim, self.format
        )
        if num_blocks < 1:
            per_block = PagedKvCache.bytes_per_block(block_size, m.num_layers, m.num_kv_heads, m.head_dim, self.format)
            raise KvPoolExhausted(f"memory budget {memory!r} holds no block ({per_block} bytes each)")
        self.cache = m.make_cache(num_blocks, block_size, self.format)
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens)
        self.stats = EngineStats()
        self._generators: dict[int, torch.Generator | None] = {}

    # -- public -------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]],
        params: SamplingParams | None = None,
        on_step: Callable[[EngineStats], None] | None = None,
    ) -> list[RequestOutput]:
        params = params or SamplingParams()
        seqs = [Sequence(self._encode(p), params) for p in prompts]
        for seq in seqs:
            self.scheduler.check_fits(seq)  # all checked before any is queued: a refusal changes nothing
        for seq in seqs:
            self.scheduler.add(seq)
            self._generators[seq.seq_id] = self._generator(seq)
        while self.scheduler.has_work():
            self.step()
            if on_step is not None:
                on_step(self.stats)
        return [self._output(s) for s in seqs]

    def step(self) -> None:
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        used = self.cache.num_blocks - self.cache.num_free_blocks
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, used)
        batch = self._batch(scheduled)
        logits = self.model.forward(self.cache, batch)
        for row, item in enumerate(scheduled):
            seq = item.seq
            seq.num_cached += item.num_tokens
            if seq.num_uncached == 0:  # the whole sequence is in the cache: sample its next token
                seq.output.append(self._sample(logits[row], seq))
                if self._done(seq):
                    self.scheduler.finish(seq)
                    self._generators.pop(seq.seq_id, None)
        decode = sum(1 for s in scheduled if s.num_tokens == 1 and s.seq.num_cached > len(s.seq.prompt))
        self.stats.steps += 1
        self.stats.decode_tokens += decode
        self.stats.prefill_tokens += sum(s.num_tokens for s in scheduled) - decode
        self.stats.preemptions = self.scheduler.num_preemptions
        elapsed = time.perf_counter() - start
        self.stats.seconds += elapsed
        if scheduled and decode == len(scheduled):
            self.stats.decode_steps += 1
            self.stats.decode_step_tokens += decode
            self.stats.decode_step_seconds += elapsed

    def score(self, token_ids: Seq[int], chunk_size: int = 256) -> torch.Tensor:
        """Teacher-forced logits [len, vocab] of one sequence, prefilled chunk by chunk through the cache.

        Each chunk's K/V is written first and then read back in the storage format, as in generation,
        so the logits carry exactly the error the format adds (llama.cpp's perplexity tool does the same).
        """
        ids = self._encode(list(token_ids))
        if self.cache.allocator.blocks_for_tokens(len(ids)) > self.cache.num_free_blocks:
            raise KvPoolExhausted(f"{len(ids)} tokens do not fit in the free part of the pool")
        seq = Sequence(ids, SamplingParams(max_tokens=1))
        self.cache.add_sequence(seq.seq_id, 0)
        try:
            out = []
            while seq.num_uncached:
                n = min(chunk_size, seq.num_uncached)
                seq.slots = self.cache.grow(seq.seq_id, n)
                batch = self._batch([Scheduled(seq, n)])
                out.append(self.model.forward(self.cache, batch, all_logits=True))
                seq.num_cached += n
            return torch.cat(out)
        finally:
            self.cache.free(seq.seq_id)

    # -- internals ----------------------------------------------------------------
    def _encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids or a tokenizer")
            return list(self.tokenizer(prompt)["input_ids"])
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("a prompt needs at least one token")
        return ids

    def _batch(self, scheduled: list[Scheduled]) -> Batch:
        ids, pos, slots, counts = [], [], [], [0]
        for item in scheduled:
            seq, start = item.seq, item.seq.num_cached
            ids.extend(seq.tokens[start : start + item.num_tokens])
            pos.extend(range(start, start + item.num_tokens))
            slots.append(seq.slots)
            counts.append(counts[-1] + item.num_tokens)
        block_tables, context_lens = self.cache.batch_tensors([s.seq.seq_id for s in scheduled])
        return Batch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            slots=torch.cat(slots),
            cu_seqlens_q=torch.tensor(counts, dtype=torch.int32),
            block_tables=block_tables,
            context_lens=context_lens,
            is_decode=all(s.num_tokens == 1 for s in scheduled),
        )

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.temperature == 0:
            return None
        gen = torch.Generator()
        gen.manual_seed(seq.params.seed if seq.params.seed is not None else seq.seq_id)
        return gen

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        if p.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.double() / p.temperature, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self._generators[seq.seq_id]))

    def _done(self, seq: Sequence) -> bool:
        if len(seq.output) >= seq.params.max_tokens:
            return True
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        return not seq.params.ignore_eos and seq.output[-1] in eos

    def _output(self, seq: Sequence) -> RequestOutput:
        text = None if self.tokenizer is None else self.tokenizer.decode(seq.output, skip_special_tokens=True)
        return RequestOutput(list(seq.prompt), list(seq.output), text, seq.num_preemptions)

    def kv_bytes_per_token(self) -> int:
        m = self.model
        return self.format.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim)


def _as_format(value: KvStorageFormat | str) -> KvStorageFormat:
    if isinstance(value, KvStorageFormat):
        return value
    try:
        return KvStorageFormat.parse(value)
    except ValueError:
        return KvStorageFormat.from_dtype(value)
