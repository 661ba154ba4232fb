"""Runs a scheduled step on the model: packs it into one `Batch`, calls the forward, isolates failures.

Packing costs O(tokens scheduled), not O(context): a decode step of a sequence adds one token id, one
position and one slot, and its block table is an int32 tensor kept on the sequence that only gains entries
when the sequence gains a block (every `block_size` tokens). Rebuilding block tables from lists each step
(`PagedKvCache.batch_tensors`) and concatenating prompt + output to slice one token both grew with the context,
so both are gone from the per-step path.
"""

from __future__ import annotations

import torch

from ..cache.paged import PagedKvCache
from .model import Batch
from .scheduler import Scheduled
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model, cache: PagedKvCache) -> None:
        """`model`: a DecoderModel or a TransformersModel (engine/hf_model.py): plan, forward, vocab_size."""
        self.model = model
        self.cache = cache
        self.vocab_size = model.vocab_size

    def prepare(self, scheduled: list[Scheduled]) -> Batch:
        """The packed `Batch` of a step (every item's slots already reserved by the scheduler)."""
        ids: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_cached
            ids.extend(seq.token_slice(start, start + item.num_tokens))
            starts.append(start)
            counts.append(item.num_tokens)
            self._sync_block_table(seq, start + item.num_tokens)
        device = self.cache.device
        is_decode = all(n == 1 for n in counts)
        start_t = torch.tensor(starts, dtype=torch.int64)
        lens = [s + n for s, n in zip(starts, counts, strict=True)]
        if is_decode:
            positions = start_t
            cu = torch.arange(len(counts) + 1, dtype=torch.int32)
        else:
            count_t = torch.tensor(counts, dtype=torch.int64)
            cu64 = torch.zeros(len(counts) + 1, dtype=torch.int64)
            torch.cumsum(count_t, 0, out=cu64[1:])
            # Token t of item b sits at position starts[b] + (t - cu[b]).
            positions = torch.arange(int(cu64[-1])) + torch.repeat_interleave(start_t - cu64[:-1], count_t)
            cu = cu64.to(torch.int32)
        return Batch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=positions.to(device),
            slots=torch.cat([item.seq.slots for item in scheduled], -1),
            cu_seqlens_q=cu.to(device),
            block_tables=self._block_tables(scheduled),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            is_decode=is_decode,
        )

    def _sync_block_table(self, seq: Sequence, length: int) -> None:
        """Bring `seq.block_table` up to the blocks holding `length` tokens, copying only the new entries (of every
        block table: `[cap]` with one, `[tables, cap]` with several)."""
        need = self.cache.allocator.blocks_for_tokens(length)
        have = seq.num_table_blocks
        if need <= have:
            return
        table = seq.block_table
        if table is None or table.shape[-1] < need:
            # Sized once for the whole request (prompt + max_tokens), so it is normally allocated once.
            cap = max(need, self.cache.allocator.blocks_for_tokens(len(seq.prompt) + seq.params.max_tokens))
            tables = self.cache.num_tables
            grown = torch.zeros((cap,) if tables == 1 else (tables, cap), dtype=torch.int32, device=self.cache.device)
            if table is not None and have:
                grown[..., :have] = table[..., :have]
            seq.block_table = table = grown
        table[..., have:need] = self.cache.table_rows(seq.seq_id, have, need)
        seq.num_table_blocks = need

    def _block_tables(self, scheduled: list[Scheduled]) -> torch.Tensor:
        """`[batch, max_blocks]` int32 (`[tables, batch, max_blocks]` with several block tables), each row a
        sequence's table padded with block 0 (never read)."""
        width = max(item.seq.num_table_blocks for item in scheduled)
        lead = () if self.cache.num_tables == 1 else (self.cache.num_tables,)
        out = torch.zeros(*lead, len(scheduled), width, dtype=torch.int32, device=self.cache.device)
        for row, item in enumerate(scheduled):
            n = item.seq.num_table_blocks
            out[..., row, :n] = item.seq.block_table[..., :n]
        return out

    def forward(self, scheduled: list[Scheduled], all_logits: bool = False) -> torch.Tensor:
        """Logits `[batch, vocab]` of each item's last token (`[tokens, vocab]` with all_logits)."""
        return self.model.forward(self.cache, self.prepare(scheduled), all_logits=all_logits)

    def run(self, scheduled: list[Scheduled]) -> tuple[torch.Tensor, list[Exception | None]]:
        """Logits `[batch, vocab]` of the step and, per item, the error that item raised (None if it ran).

        The step runs as one batch; if that raises, each item is run alone so that only the item(s) that fail
        by themselves are reported, and the others' logits are exactly what they would have been (a row's
        logits do not depend on its batch mates). K/V rows the failed batch wrote sit at slots the items had
        reserved and whose `num_cached` did not advance: the retry rewrites the survivors' rows before any read,
        and a failed item's blocks go back to the pool, where the next owner writes before reading.
        """
        try:
            return self.forward(scheduled), [None] * len(scheduled)
        except Exception as batch_error:  # noqa: BLE001 - isolated below, re-reported per item
            if len(scheduled) == 1:
                return torch.full((1, self.vocab_size), float("nan")), [batch_error]
        rows: list[torch.Tensor] = []
        errors: list[Exception | None] = []
        for item in scheduled:
            try:
                rows.append(self.forward([item])[0])
                errors.append(None)
            except Exception as e:  # noqa: BLE001
                rows.append(torch.full((self.vocab_size,), float("nan")))
                errors.append(e)
        return torch.stack(rows), errors
