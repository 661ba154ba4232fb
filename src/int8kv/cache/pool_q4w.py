"""KV storage in ``int4_kchan64_vtok_asym_sink4_win64_v1`` (int8kv.quant4w): pages of 64 positions, sealed into
4-bit codes once 64 positions follow them, the sinks and the window held as F16 rows beside them.

What the pool holds, per layer (``H`` KV heads, ``d`` head_dim; the format object's parts):

  sealed pages   k codes [num_blocks, 64, H, d / 2] uint8, k scale / min [num_blocks, H, d] float16,
                 v codes [num_blocks, 64, H, d / 2] uint8, v scale / min [num_blocks, 64, H] float16
  window pages   k / v [window_pages, 64, H, d] float16: the F16 rows of pages not yet sealed (and of pages
                 sealed by this step while a query of it still reads them in F16)
  sink rows      k / v [sink_slots, 4, H, d] float16: positions 0-3 of a sequence, for good

A block id names a sealed page (``num_blocks`` of them, the allocator's ids, slot = block * 64 + offset); a
block in its F16 phase also holds one of ``window_pages`` window pages, and a sequence's first block one of
``sink_slots`` sink slots (both taken and given back here, by block id). A step that writes ``m`` positions of
a sequence holds at most ``ceil(m / 64) + 2`` window pages for it (its last two pages after a decode step).

Writes go by step (:meth:`write_step`, with the step's plan): the rows of each sequence are the positions
``[context_len - queries, context_len)``; a write at offset 0 of a page starts that page afresh (a block id
reused by the allocator). After the rows, every page ``b`` of a sequence with ``context_len >= 64 b + 128`` is
sealed (its F16 rows encoded, bit for bit :func:`int8kv.quant4w.seal_block`), and a page's F16 rows are given
back once every query of a step reads it sealed (queries at ``p >= 64 b + 127``: in the step that sealed it, or
at the start of the sequence's next step, before any window page is taken), so each query reads what its
own decode step would: :meth:`stored_form` of its prefix. The stored form of ``n`` positions is therefore
``quant4w.encode_sequence`` of them, whatever chunks wrote them (tests/test_pool_q4w.py).

Reads: the reference backend through :meth:`stored_form`; the CPU and Triton backends' kernels
(int8kv.ops.cpu_q4w, int8kv.ops.triton_q4w) in place, through :meth:`layer_pages` and :meth:`page_books`, after
:meth:`check_reads`. The writes are torch code on the pool's device (sealing goes through numpy on the host), so
the write path serves this pool the same way under every backend.

Sharing (the engine's prefix cache and forks, cache/paged_q4w.py): a page written by one sequence may be read by
others that took it as a prefix hit or were forked off it. Its F16 rows are given back only while no sequence
:meth:`pin` s it (the pins are the owner's book: a sequence pins the pages whose F16 rows its next queries read);
every give-back above (in a step, at its start, :meth:`settle`) skips a pinned page, so a sharer still reading a
page in F16 keeps it, and :meth:`give_back_sealed` gives back those of shared pages no pin holds any more (their
holders have all passed them). Sealing a shared page is idempotent: a page is sealed once per layer, from the one
window page every sharer reads, so two sharers can never seal it differently. The window pages and sink slots
of pages no sequence holds (cached for later hits) may be kept (:meth:`keep`): they stay held, and a step short
of window pages or sink slots takes them back, least recently kept first, so they are as good as free for sizing.
:meth:`usable_prefix` says how many pages of a chain a new sequence can start from: the sink slot of the first
page, the F16 rows of the last one (which the first new query reads in F16) and every page before it sealed in
every layer.

Copies and cuts: :meth:`copy_block` copies one block into another of this pool (the engine's copy-on-write of a
forked sequence's shared partial last page: its F16 rows in a window page of its own, and a sink slot of its own
for a first page), :meth:`remapped` copies block ids into a new pool (more blocks, window pages or sink slots: the
transformers drop-in's growth; rows picked in another order or twice: its beam search), and :meth:`truncate`
cuts sequences back to a shorter length while the F16 rows that length reads are still held (refused by name
once they were given back).

States: :meth:`export_sequence` (a sequence's :meth:`stored_form` in every layer) and :meth:`import_sequence`
(that stored form written back into fresh pages: sealed pages, window pages and a sink slot, as a pool holds
them between steps), so that a sequence exported at ``n`` positions and imported into another pool continues
exactly as it would have (int8kv.cache.state_q4w).

Not implemented (refused by name, UnsupportedFormat): writes by slot without a plan, export / import of rows by
slot.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import KvPoolExhausted, LayerOutOfRange, ShapeMismatch, UnsupportedFormat
from ..formats import INT4_SINK_WINDOW_V1
from ..quant4w import Q4WRows, f16_positions

PAGE, SINKS, WINDOW = INT4_SINK_WINDOW_V1.page, INT4_SINK_WINDOW_V1.sinks, INT4_SINK_WINDOW_V1.window


#: Set to "1" to hold this pool on a CUDA device anyway (bench/gpu_check.py does, to check the kernel there).
UNVERIFIED_GPU_ENV = "INT8KV_UNVERIFIED_GPU_KERNELS"


def check_gpu(device: torch.device | str) -> None:
    """Refuse (UnsupportedFormat) a CUDA device unless ``INT8KV_UNVERIFIED_GPU_KERNELS=1``: this format's Triton
    kernel (ops/triton_q4w.py) is not verified on a GPU, where it has faulted with an illegal memory access, which
    ends the process's CUDA context (docs/performance.md, "GPU"). Under ``TRITON_INTERPRET=1`` it matches the
    float64 reference and every access it makes lies inside its tensors (tests/test_triton_bounds.py)."""
    if torch.device(device).type == "cuda" and os.environ.get(UNVERIFIED_GPU_ENV) != "1":
        raise UnsupportedFormat(
            f"the {INT4_SINK_WINDOW_V1.name} format is not served on a GPU yet: its Triton kernel faulted (an "
            "illegal memory access) on its first GPU run; hold it on the CPU, or set "
            f"{UNVERIFIED_GPU_ENV}=1 to run the unverified kernel anyway"
        )


def _positive(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ShapeMismatch(f"{what} must be a positive int, got {value!r}")
    return value


class Int4SinkWindowPool:
    """``num_blocks`` pages of 64 positions for ``num_layers`` layers of ``num_kv_heads`` x ``head_dim``, with
    ``window_pages`` F16 window pages and ``sink_slots`` sink slots (module docs)."""

    #: The write path hands this pool whole steps (ops.write.append_paged_kv with a plan), not rows by slot.
    writes_by_step = True

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, window_pages: int,
                 sink_slots: int, device: torch.device | str = "cpu") -> None:
        dims = [_positive(v, w) for v, w in ((num_layers, "num_layers"), (num_kv_heads, "num_kv_heads"),
                                             (head_dim, "head_dim"), (num_blocks, "num_blocks"),
                                             (window_pages, "window_pages"), (sink_slots, "sink_slots"))]
        if head_dim % 2:
            raise ShapeMismatch(f"4-bit rows need an even head_dim, got {head_dim}")
        check_gpu(device)
        self.num_layers, self.num_kv_heads, self.head_dim, self.num_blocks = dims[:4]
        self.format = INT4_SINK_WINDOW_V1
        self.block_size = PAGE
        fmt, lead, heads = self.format, (num_layers, num_blocks), num_kv_heads

        def page(parts) -> tuple[torch.Tensor, ...]:
            return tuple(torch.zeros((*lead, *(() if p.per_block else (PAGE,)), heads, *p.shape(head_dim)),
                                     dtype=p.dtype, device=device) for p in parts)

        self._k, self._v = page(fmt.k_page_parts), page(fmt.v_page_parts)
        self.device = self._k[0].device
        rows = (num_layers, window_pages, PAGE, heads, head_dim)
        self._k_win = torch.zeros(rows, dtype=torch.float16, device=device)
        self._v_win = torch.zeros_like(self._k_win)
        sinks = (num_layers, sink_slots, SINKS, heads, head_dim)
        self._k_sink = torch.zeros(sinks, dtype=torch.float16, device=device)
        self._v_sink = torch.zeros_like(self._k_sink)
        # Books, by block id: the window page and sink slot held (-1: none), which layers have sealed the page
        # and which still hold its F16 rows.
        self._window_of = np.full(num_blocks, -1, np.int64)
        self._sink_of = np.full(num_blocks, -1, np.int64)
        self._free_windows = list(range(window_pages - 1, -1, -1))
        self._free_sinks = list(range(sink_slots - 1, -1, -1))
        self._sealed = np.zeros((num_layers, num_blocks), bool)
        self._f16_held = np.zeros((num_layers, num_blocks), bool)
        # Sharing: how many sequences pin each page's F16 rows (none given back while pinned), and the pages
        # no sequence holds whose window page / sink slot are kept for prefix hits, least recently kept first.
        self._pins = np.zeros(num_blocks, np.int64)
        self._spare_w: OrderedDict[int, None] = OrderedDict()
        self._spare_s: OrderedDict[int, None] = OrderedDict()
        #: Counts the calls that may change the books above (write_step, release): a kernel that checked a
        #: step's reads (check_reads) at one generation need not check them again at the same one.
        self.generation = 0

    def __repr__(self) -> str:
        return (f"Int4SinkWindowPool({self.num_layers} layers, {self.num_kv_heads} x {self.head_dim}, "
                f"num_blocks={self.num_blocks}, window_pages={self.window_pages}, sink_slots={self.sink_slots}, "
                f"device={self.device})")

    # -- sizes ------------------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_blocks * PAGE

    def memory_bytes(self) -> int:
        """Bytes held (allocated up front): sealed pages, window pages and sink slots."""
        return sum(t.numel() * t.element_size() for t in self.storage())

    def storage(self) -> tuple[torch.Tensor, ...]:
        return (*self._k, *self._v, self._k_win, self._v_win, self._k_sink, self._v_sink)

    def windows_held(self) -> int:
        return int((self._window_of >= 0).sum())

    def sinks_held(self) -> int:
        return int((self._sink_of >= 0).sum())

    @property
    def window_pages(self) -> int:
        """Window pages the pool holds (taken and given back by its writes)."""
        return int(self._k_win.shape[1])

    @property
    def sink_slots(self) -> int:
        """Sink slots the pool holds (taken and given back by its writes)."""
        return int(self._k_sink.shape[1])

    def check_layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise LayerOutOfRange(f"layer {layer!r} outside [0, {self.num_layers})")
        return layer

    # -- what a plain pool does, refused by name ----------------------------------------------------------------
    def _refuse(self, what: str):
        raise UnsupportedFormat(f"{what} is not implemented for the {self.format.name} pool")

    def write_rows(self, layer, slots, k, v) -> None:
        self._refuse("writing rows by slot without the step's plan (use append_paged_kv(..., plan=))")

    def export_rows(self, layer, slots):
        self._refuse("exporting rows")

    def layer_parts(self, layer: int):
        self._refuse("reading parts by slot (a kernel for this format)")

    # -- writes -----------------------------------------------------------------------------------------------
    def _step(self, plan) -> list[tuple[list[int], int, int, int]]:
        """Per sequence of ``plan``: (block table, first position written, length, first row in the step's
        rows); the step's window pages and sink slots taken, once per plan, before any layer writes (refused as
        a whole, KvPoolExhausted, with nothing taken)."""
        def build():
            tables = plan.block_tables.tolist()
            lens = plan.context_lens.tolist()
            cu = plan.cu_seqlens_q.tolist()
            seqs = [(tables[b], lens[b] - (cu[b + 1] - cu[b]), lens[b], cu[b]) for b in range(plan.batch)]
            fresh, need_w, need_s, done = set(), [], [], set()
            # The pages the step's sequences span (a table is padded past them): kept no more once it is taken.
            held = {b for table, _, n, _ in seqs for b in table[: -(-n // PAGE)]}
            for table, first, n, _ in seqs:
                # Pages every layer sealed before this step: all of its queries (p >= first) read them sealed.
                done.update(b for b in table[: max(0, (first - WINDOW) // PAGE)]
                            if self._window_of[b] >= 0 and self._sealed[:, b].all() and not self._pins[b])
                for t in range(first // PAGE, (n - 1) // PAGE + 1 if n > first else 0):
                    blk = table[t]
                    if t * PAGE >= first:  # written from offset 0: the page starts afresh
                        fresh.add(blk)
                    if blk in fresh or self._window_of[blk] < 0:
                        need_w.append(blk)
                if first < SINKS and (table[0] in fresh or self._sink_of[table[0]] < 0):
                    need_s.append(table[0])
            need_w, need_s = sorted(set(need_w)), sorted(set(need_s))
            back_w = sum(1 for b in need_w if self._window_of[b] >= 0)  # a fresh page's old window comes back
            stale_s = [b for b in fresh if b not in need_s and self._sink_of[b] >= 0]  # no longer a first page
            back_s = sum(1 for b in need_s if self._sink_of[b] >= 0) + len(stale_s)
            kept_w, kept_s = self._kept_beside(held)
            free_w = len(self._free_windows) + len(done) + kept_w
            free_s = len(self._free_sinks) + kept_s
            if len(need_w) > free_w + back_w or len(need_s) > free_s + back_s:
                raise KvPoolExhausted(
                    f"the step needs {len(need_w)} window pages and {len(need_s)} sink slots; "
                    f"{free_w} and {free_s} are free (kept ones included)")
            self.claim(sorted(held))
            for blk in done:
                self._give_back_window(blk)
            for blk in fresh:
                self._sealed[:, blk] = False
                self._f16_held[:, blk] = False
            self.release(stale_s, sinks_only=True)
            for books, need, windows in ((self._window_of, need_w, True), (self._sink_of, need_s, False)):
                for blk in need:
                    if books[blk] < 0:
                        books[blk] = self._take(windows)
            for blk in need_w:
                self._f16_held[:, blk] = True
            return seqs

        return plan.derived(("int4-sink-window pages", id(self)), build)

    def write_step(self, layer: int, plan, k16: torch.Tensor, v16: torch.Tensor) -> None:
        """Store the step's F16 rows ``[num_queries, H, d]`` of ``layer`` (checked and rounded by the write
        path), then seal the pages that 64 positions now follow and give back the F16 rows no query reads."""
        self.generation += 1
        for table, first, n, row in self._step(plan):
            pos = torch.arange(first, n)
            rows = slice(row, row + n - first)
            win = torch.as_tensor(self._window_of[[table[t] for t in (pos // PAGE).tolist()]], device=self.device)
            off = (pos % PAGE).to(self.device)
            self._k_win[layer, win, off] = k16[rows]
            self._v_win[layer, win, off] = v16[rows]
            if first < SINKS:
                sink, upto = int(self._sink_of[table[0]]), min(n, SINKS)
                self._k_sink[layer, sink, first:upto] = k16[row : row + upto - first]
                self._v_sink[layer, sink, first:upto] = v16[row : row + upto - first]
            for t in range(max(0, (n - WINDOW) // PAGE)):  # pages sealed at this length
                blk = table[t]
                if not self._sealed[layer, blk]:
                    w = int(self._window_of[blk])
                    k_parts, v_parts = self.format.seal(self._k_win[layer, w], self._v_win[layer, w], t == 0)
                    for dst, src in ((self._k, k_parts), (self._v, v_parts)):
                        for tensor, part in zip(dst, src, strict=True):
                            tensor[layer, blk] = part
                    self._sealed[layer, blk] = True
                if self._f16_held[layer, blk] and first >= PAGE * t + PAGE + WINDOW - 1 and not self._pins[blk]:
                    self._f16_held[layer, blk] = False  # every query of this step reads it sealed
                    if not self._f16_held[:, blk].any():
                        self._free_windows.append(int(self._window_of[blk]))
                        self._window_of[blk] = -1

    def _kept_beside(self, blocks) -> tuple[int, int]:
        """``(window pages, sink slots)`` kept for prefix hits (:meth:`keep`) by pages outside ``blocks``: what
        :meth:`_take` may take back for them."""
        return (sum(1 for b in self._spare_w if b not in blocks), sum(1 for b in self._spare_s if b not in blocks))

    def _take(self, windows: bool) -> int:
        """A free window page (``windows``) or sink slot, the one kept longest for a prefix hit taken back when
        none is free (the caller counted it in, :meth:`_kept_beside`)."""
        free, spare = (self._free_windows, self._spare_w) if windows else (self._free_sinks, self._spare_s)
        if not free:
            self.release([spare.popitem(last=False)[0]], sinks_only=not windows, windows_only=windows)
        return free.pop()

    def _give_back_window(self, blk: int) -> None:
        """Block ``blk``'s window page back to the free list, its F16 rows no longer held in any layer."""
        self._f16_held[:, blk] = False
        self._free_windows.append(int(self._window_of[blk]))
        self._window_of[blk] = -1

    def settle(self, block_table, length: int) -> int:
        """Give back the window pages of a sequence's pages that every query at positions ``>= length`` reads
        sealed (``length >= 64 b + 128``, sealed in every layer), as its next step would before taking any:
        for an owner holding sequences between steps (``length``: the sequence's context, no shorter), so that
        a sequence holds at most its last two pages' F16 rows between steps. Returns how many went back."""
        return self.give_back_sealed(block_table[: max(0, (length - WINDOW) // PAGE)])

    def give_back_sealed(self, blocks) -> int:
        """Give back the window pages of those of ``blocks`` that every layer sealed and no sequence pins: for an
        owner whose sequences holding them all read them sealed from now on (a page a sharer no longer pins,
        :meth:`settle` of a sequence's passed pages). Returns how many went back."""
        self.generation += 1
        back = 0
        for blk in blocks:
            if self._window_of[blk] >= 0 and self._sealed[:, blk].all() and not self._pins[blk]:
                self._give_back_window(blk)
                back += 1
        return back

    def release(self, blocks, sinks_only: bool = False, windows_only: bool = False) -> None:
        """Give back the window pages and sink slots of ``blocks`` (block ids the owner freed: a sequence that
        ends before its pages are sealed leaves them held until then, or until the block is written afresh);
        they are kept no more (:meth:`keep`)."""
        self.generation += 1
        for blk in blocks:
            books = []
            if not windows_only:
                books.append((self._sink_of, self._free_sinks, self._spare_s))
            if not sinks_only:
                books.append((self._window_of, self._free_windows, self._spare_w))
                self._f16_held[:, blk] = False
            for where, free, spare in books:
                spare.pop(blk, None)
                if where[blk] >= 0:
                    free.append(int(where[blk]))
                    where[blk] = -1

    # -- sharing ----------------------------------------------------------------------------------------------
    def _blocks(self, blocks: Sequence[int]) -> list[int]:
        out = [int(b) for b in blocks]
        if any(not 0 <= b < self.num_blocks for b in out):
            raise ShapeMismatch(f"block ids must lie in [0, {self.num_blocks}), got {out}")
        return out

    def pin(self, blocks: Sequence[int]) -> None:
        """One more sequence reads the F16 rows of each of ``blocks``: no give-back takes them while pinned."""
        for b in self._blocks(blocks):
            self._pins[b] += 1

    def unpin(self, blocks: Sequence[int]) -> None:
        """Undo one :meth:`pin` of each of ``blocks`` (ShapeMismatch, nothing changed, for a page not pinned)."""
        blocks = self._blocks(blocks)
        counts = np.bincount(np.asarray(blocks, np.int64), minlength=self.num_blocks)
        if (counts > self._pins).any():
            raise ShapeMismatch(f"unpinning pages that are not pinned: {sorted(set(blocks))}")
        self._pins -= counts

    def pins(self, block: int) -> int:
        """How many sequences pin ``block``'s F16 rows."""
        return int(self._pins[self._blocks([block])[0]])

    def keep(self, blocks: Sequence[int]) -> None:
        """Keep the window pages and sink slots ``blocks`` hold (pages no sequence holds now, cached for prefix
        hits) until a step needs them (taken back least recently kept first) or :meth:`claim` / :meth:`release`;
        ShapeMismatch (nothing changed) for a pinned page: a sequence still reads it."""
        blocks = self._blocks(blocks)
        if any(self._pins[b] for b in blocks):
            raise ShapeMismatch(f"pages {[b for b in blocks if self._pins[b]]} are pinned: a sequence reads them")
        for b in blocks:
            for where, spare in ((self._window_of, self._spare_w), (self._sink_of, self._spare_s)):
                spare.pop(b, None)
                if where[b] >= 0:
                    spare[b] = None

    def claim(self, blocks: Sequence[int]) -> None:
        """A sequence holds ``blocks`` again (a prefix hit): what they hold is kept no more, a step no longer
        takes it back."""
        for b in self._blocks(blocks):
            self._spare_w.pop(b, None)
            self._spare_s.pop(b, None)

    def kept(self) -> tuple[int, int]:
        """``(window pages, sink slots)`` held for pages no sequence holds (:meth:`keep`)."""
        return len(self._spare_w), len(self._spare_s)

    def usable_prefix(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` (a sequence's first pages, full and written) a new sequence can take and go on
        from, at position ``64 k``: the longest ``k`` whose last page still holds its F16 rows in every layer
        (the first new query reads them in F16), whose earlier pages are sealed in every layer and whose first
        page holds its sink slot; 0 when none."""
        blocks = self._blocks(blocks)
        if not blocks or self._sink_of[blocks[0]] < 0:
            return 0
        sealed = 0
        while sealed < len(blocks) and self._sealed[:, blocks[sealed]].all():
            sealed += 1
        for k in range(min(len(blocks), sealed + 1), 0, -1):
            b = blocks[k - 1]
            if self._window_of[b] >= 0 and self._f16_held[:, b].all():
                return k
        return 0

    # -- copies and cuts ---------------------------------------------------------------------------------------
    def can_copy(self, src: int, dst: int | None = None) -> bool:
        """Whether :meth:`copy_block` of ``src`` (into ``dst``, or a block holding nothing of its own) finds the
        window page and sink slot it needs: free ones, kept ones (:meth:`keep`) and what ``dst`` holds."""
        src = self._blocks([src])[0]
        own = [] if dst is None else [b for b in self._blocks([dst]) if b != src]
        kept_w, kept_s = self._kept_beside({src})  # dst's kept ones among them
        back_w = sum(1 for b in own if self._window_of[b] >= 0 and b not in self._spare_w)
        back_s = sum(1 for b in own if self._sink_of[b] >= 0 and b not in self._spare_s)
        return (self._window_of[src] < 0 or len(self._free_windows) + kept_w + back_w > 0) and (
            self._sink_of[src] < 0 or len(self._free_sinks) + kept_s + back_s > 0)

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` becomes a copy of block ``src`` (copy-on-write of a shared page: the engine's forks,
        cache/paged_q4w.py): in every layer its sealed page and books (sealed, F16 rows held), and the F16 rows
        ``src`` holds in a window page and a sink slot of ``dst``'s own (what ``dst`` held goes back first). The
        copy starts unpinned (pins are the owner's) and ``src`` is held (:meth:`claim`). Refused with nothing
        changed: ShapeMismatch for ``src == dst``, KvPoolExhausted when no window page or sink slot is left
        for it (:meth:`can_copy`)."""
        src, dst = self._blocks([src, dst])
        if src == dst:
            raise ShapeMismatch(f"copying block {src} onto itself")
        if not self.can_copy(src, dst):
            raise KvPoolExhausted(f"copying block {src} needs a window page or a sink slot; none is free (kept "
                                  "ones included)")
        self.claim([src])
        self.release([dst])  # bumps the generation
        for t in (*self._k, *self._v):
            t[:, dst] = t[:, src]
        self._sealed[:, dst] = self._sealed[:, src]
        self._f16_held[:, dst] = self._f16_held[:, src]
        for books, rows, windows in ((self._window_of, (self._k_win, self._v_win), True),
                                     (self._sink_of, (self._k_sink, self._v_sink), False)):
            if books[src] >= 0:
                books[dst] = self._take(windows)
                for t in rows:
                    t[:, int(books[dst])] = t[:, int(books[src])]

    def remapped(self, sources, window_pages: int | None = None, sink_slots: int | None = None
                 ) -> Int4SinkWindowPool:
        """A new pool of ``len(sources)`` blocks whose block ``i`` is a copy of this pool's block ``sources[i]``
        (-1: an empty block): its sealed pages and books, and its window page and sink slot (each copy takes its
        own). ``window_pages`` / ``sink_slots`` default to this pool's, raised to what the copies hold. This pool
        is unchanged (a failure, e.g. out of memory, leaves it as it was)."""
        src = np.asarray(sources, np.int64).reshape(-1)
        if src.size == 0 or (src < -1).any() or (src >= self.num_blocks).any():
            raise ShapeMismatch(f"sources must be block ids in [-1, {self.num_blocks}), got {src.tolist()}")
        keep = src >= 0
        held_w = int((self._window_of[src[keep]] >= 0).sum())
        held_s = int((self._sink_of[src[keep]] >= 0).sum())
        new = Int4SinkWindowPool(
            self.num_layers, self.num_kv_heads, self.head_dim, int(src.size),
            max(held_w, 1, window_pages if window_pages is not None else self.window_pages),
            max(held_s, 1, sink_slots if sink_slots is not None else self.sink_slots), self.device)
        to, fro = torch.as_tensor(np.nonzero(keep)[0]), torch.as_tensor(src[keep])
        for dst, s in zip(new._k + new._v, self._k + self._v, strict=True):
            dst[:, to] = s[:, fro]
        new._sealed[:, to.numpy()] = self._sealed[:, fro.numpy()]
        new._f16_held[:, to.numpy()] = self._f16_held[:, fro.numpy()]
        for i, b in zip(to.tolist(), fro.tolist(), strict=True):
            for books, free, rows, old_books, old_rows in (
                    (new._window_of, new._free_windows, (new._k_win, new._v_win), self._window_of,
                     (self._k_win, self._v_win)),
                    (new._sink_of, new._free_sinks, (new._k_sink, new._v_sink), self._sink_of,
                     (self._k_sink, self._v_sink))):
                if old_books[b] >= 0:
                    books[i] = free.pop()
                    for dst, s in zip(rows, old_rows, strict=True):
                        dst[:, books[i]] = s[:, old_books[b]]
        return new

    def truncate(self, block_tables, length: int) -> None:
        """Cut the sequences of ``block_tables`` (lists of block ids) back to their first ``length`` positions, so
        that the next step writes from ``length`` on: the pages holding positions at or after ``length`` are no
        longer sealed, those wholly after it give back their window pages (and, at ``length`` 0, the sink slot).
        Refused (UnsupportedFormat, nothing changed) when the F16 rows a query at ``length`` reads were given
        back (a page sealed since, whose positions the window of ``length + 1`` holds as F16 rows)."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ShapeMismatch(f"length must be an int >= 0, got {length!r}")
        tables = [list(t) for t in block_tables]
        lo, hi = max(0, (length + 1 - WINDOW) // PAGE), -(-length // PAGE)  # pages whose F16 rows length reads
        for table in tables:
            if len(table) < hi or any(self._window_of[table[t]] < 0 for t in range(lo, hi)) or (
                    0 < length and self._sink_of[table[0]] < 0):
                raise UnsupportedFormat(
                    f"cannot cut back to {length} positions: the {self.format.name} pool gave back the F16 rows "
                    "that length reads (the pages were sealed since)")
        self.generation += 1
        for table in tables:
            if length == 0:
                self.release(table)
                self._sealed[:, table] = False
                continue
            for t in range(length // PAGE, len(table)):  # pages holding positions >= length
                self._sealed[:, table[t]] = False
            self.release(table[hi:])
            for t in range(lo, hi):
                self._f16_held[:, table[t]] = True

    # -- reads ------------------------------------------------------------------------------------------------
    def layer_pages(self, layer: int) -> tuple[torch.Tensor, ...]:
        """One layer's storage as a kernel reads it (views of the pool's tensors, no copy): ``(k_codes, k_scale,
        k_min, v_codes, v_scale, v_min, k_window, v_window, k_sink, v_sink)``, the shapes of the module docs
        without the layer axis."""
        return (*(t[layer] for t in self._k), *(t[layer] for t in self._v), self._k_win[layer], self._v_win[layer],
                self._k_sink[layer], self._v_sink[layer])

    def page_books(self) -> tuple[np.ndarray, np.ndarray]:
        """``(window_of, sink_of)``, int64 ``[num_blocks]``: the window page and the sink slot each block id holds
        (-1: none). The pool's own arrays, updated in place by its writes: for kernels to read, never to write."""
        return self._window_of, self._sink_of

    def check_reads(self, layer: int, sealed: np.ndarray, f16: np.ndarray, firsts: np.ndarray) -> None:
        """Refuse (UnsupportedFormat) a read of the block ids ``sealed`` as ``layer``'s sealed pages, of ``f16`` as
        F16 rows (window pages) and of ``firsts`` (sequences' first pages) for their sink rows, unless the pool
        holds each so: what :meth:`stored_form` refuses, for a kernel reading the pages in place."""
        if not self._sealed[layer, sealed].all():
            raise UnsupportedFormat(f"layer {layer} has not sealed the pages this step reads")
        if (self._window_of[f16] < 0).any() or (self._sink_of[firsts] < 0).any():
            raise UnsupportedFormat("the F16 rows this step reads were given back")

    def stored_form(self, layer: int, block_table: list[int], length: int) -> Q4WRows:
        """The stored form of a sequence's first ``length`` positions (numpy), as the decode step at position
        ``length - 1`` reads it: sealed pages for ``length >= 64 b + 128``, the sinks and the window from the
        F16 rows. Refused (UnsupportedFormat) when the F16 rows it needs were given back (a query below the
        step's first) or a page it needs is not sealed in this layer."""
        c = max(0, (length - WINDOW) // PAGE)
        blocks = [block_table[t] for t in range(c)]
        if any(not self._sealed[layer, b] for b in blocks):
            raise UnsupportedFormat(f"layer {layer} has not sealed the pages a length of {length} reads")
        k = [t[layer, blocks].cpu().numpy() for t in self._k]
        v = [t[layer, blocks].cpu().numpy() for t in self._v]
        sinks, window = f16_positions(length)

        def f16(win: torch.Tensor, sink: torch.Tensor, positions: range, sink_rows: bool) -> np.ndarray:
            if not positions:
                return np.zeros((0, self.num_kv_heads, self.head_dim), np.float16)
            if sink_rows:
                s = int(self._sink_of[block_table[0]])
                return sink[layer, s, : len(positions)].cpu().numpy()
            pos = np.arange(positions.start, positions.stop)
            pages = self._window_of[[block_table[t] for t in pos // PAGE]]
            if (pages < 0).any():
                raise UnsupportedFormat(f"the F16 rows a length of {length} reads were given back")
            return win[layer, torch.as_tensor(pages), torch.as_tensor(pos % PAGE)].cpu().numpy()

        return Q4WRows(
            k_codes=k[0], k_scale=k[1], k_min=k[2], k_sink=f16(self._k_win, self._k_sink, sinks, True),
            k_window=f16(self._k_win, self._k_sink, window, False), v_codes=v[0], v_scale=v[1], v_min=v[2],
            v_sink=f16(self._v_win, self._v_sink, sinks, True), v_window=f16(self._v_win, self._v_sink, window, False),
        )

    # -- pages for the block store -----------------------------------------------------------------------------
    def holds_rows(self, blocks: Sequence[int]) -> bool:
        """True if any of ``blocks`` holds a window page or a sink slot (a page written since it was handed out)."""
        blocks = self._blocks(blocks)
        return bool((self._window_of[blocks] >= 0).any() or (self._sink_of[blocks] >= 0).any())

    def sealed_page(self, block: int, first: bool) -> dict[str, np.ndarray]:
        """Block ``block``'s sealed parts in every layer as numpy copies (``k_codes`` / ``v_codes`` ``[L, 64, H, d /
        2]``, ``k_scale`` / ``k_min`` ``[L, H, d]``, ``v_scale`` / ``v_min`` ``[L, 64, H]``) and, for a sequence's
        ``first`` page, its sink rows ``k_sink`` / ``v_sink`` ``[L, 4, H, d]``: a block store's sealed value.
        Refused (UnsupportedFormat) unless every layer sealed it (and, first, it holds its sink slot)."""
        b = self._blocks([block])[0]
        if not self._sealed[:, b].all():
            raise UnsupportedFormat(f"page {b} is not sealed in every layer")
        names = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")
        out = {name: t[:, b].cpu().numpy().copy() for name, t in zip(names, (*self._k, *self._v), strict=True)}
        if first:
            s = int(self._sink_of[b])
            if s < 0:
                raise UnsupportedFormat(f"page {b} holds no sink rows")
            out["k_sink"] = self._k_sink[:, s].cpu().numpy().copy()
            out["v_sink"] = self._v_sink[:, s].cpu().numpy().copy()
        return out

    def page_rows(self, block: int) -> dict[str, np.ndarray]:
        """Block ``block``'s 64 F16 rows in every layer (``k_rows`` / ``v_rows`` ``[L, 64, H, d]``, numpy copies):
        a block store's end value. Refused (UnsupportedFormat) once they were given back in a layer."""
        b = self._blocks([block])[0]
        w = int(self._window_of[b])
        if w < 0 or not self._f16_held[:, b].all():
            raise UnsupportedFormat(f"page {b} no longer holds its F16 rows in every layer")
        return {"k_rows": self._k_win[:, w].cpu().numpy().copy(), "v_rows": self._v_win[:, w].cpu().numpy().copy()}

    # -- states -------------------------------------------------------------------------------------------------
    def export_sequence(self, block_table, length: int) -> tuple[Q4WRows, ...]:
        """The stored form of a sequence's first ``length`` positions in every layer (:meth:`stored_form` of
        each): what a state of the sequence holds. Refused (UnsupportedFormat) as :meth:`stored_form` refuses,
        and when the sequence's first page holds no sink slot."""
        table = [int(b) for b in block_table]
        if isinstance(length, bool) or not isinstance(length, int) or length < 0 or len(table) < -(-length // PAGE):
            raise ShapeMismatch(f"length must be an int in [0, {len(table) * PAGE}] (the table's pages), got "
                                f"{length!r}")
        if length and self._sink_of[table[0]] < 0:
            raise UnsupportedFormat(f"the {self.format.name} pool holds no sink rows for this sequence")
        return tuple(self.stored_form(layer, table, length) for layer in range(self.num_layers))

    def import_sequence(self, block_table, rows) -> None:
        """Store a sequence's stored form (``rows``: one :class:`Q4WRows` per layer, one length ``n``, values
        checked by the caller: a :class:`~int8kv.cache.state_q4w.Q4WState`'s) in the pages of ``block_table``
        (block ids the owner allocated for ``n`` positions): its sealed blocks as sealed pages, the window's F16
        rows in window pages (one per page from the last sealed one on) and the sinks in a sink slot, as a
        native pool holds them between steps (:meth:`settle`d). The pages' earlier window pages and sink slot
        come back first. Refused (ShapeMismatch, KvPoolExhausted) with nothing taken or written."""
        from .state_q4w import rows_shape_problem

        rows = tuple(rows)
        if len(rows) != self.num_layers or not all(isinstance(r, Q4WRows) for r in rows):
            raise ShapeMismatch(f"rows must hold one Q4WRows per layer ({self.num_layers})")
        n = len(rows[0])
        for layer, r in enumerate(rows):
            problem = rows_shape_problem(r, n, self.num_kv_heads, self.head_dim)
            if problem is not None:
                raise ShapeMismatch(f"layer {layer}: {problem}")
        pages = -(-n // PAGE)
        table = [int(b) for b in block_table][:pages]
        if len(table) < pages or len(set(table)) != pages or any(not 0 <= b < self.num_blocks for b in table):
            raise ShapeMismatch(f"{n} positions need {pages} distinct block ids in [0, {self.num_blocks}), got "
                                f"{list(block_table)}")
        c = max(0, (n - WINDOW) // PAGE)
        need_w, need_s = pages - c, 1 if n else 0
        kept_w, kept_s = self._kept_beside(table)  # the table's own come back below
        free_w = len(self._free_windows) + int((self._window_of[table] >= 0).sum()) + kept_w
        free_s = len(self._free_sinks) + int((self._sink_of[table] >= 0).sum()) + kept_s
        if need_w > free_w or need_s > free_s:
            raise KvPoolExhausted(
                f"the state needs {need_w} window pages and {need_s} sink slot; {free_w} and {free_s} are free "
                "(kept ones included)")
        self.release(table)  # bumps the generation
        self._sealed[:, table] = False
        sealed, f16 = table[:c], table[c:]
        self._sealed[:, sealed] = True
        for blk in f16:
            self._window_of[blk] = self._take(True)
        self._f16_held[:, f16] = True
        if n:
            self._sink_of[table[0]] = self._take(False)
        sinks, window = f16_positions(n)
        dev = self.device

        def put(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.array(x)).to(dev)

        blocks = torch.as_tensor(sealed, dtype=torch.long, device=dev)
        pos = np.arange(window.start, window.stop)
        win = torch.as_tensor(self._window_of[[table[p // PAGE] for p in pos]], dtype=torch.long, device=dev)
        off = torch.as_tensor(pos % PAGE, dtype=torch.long, device=dev)
        for layer, r in enumerate(rows):
            for dst, parts in ((self._k, (r.k_codes, r.k_scale, r.k_min)), (self._v, (r.v_codes, r.v_scale, r.v_min))):
                for tensor, part in zip(dst, parts, strict=True):
                    tensor[layer, blocks] = put(part)
            for rows_t, sink_t, sink_rows, window_rows in ((self._k_win, self._k_sink, r.k_sink, r.k_window),
                                                           (self._v_win, self._v_sink, r.v_sink, r.v_window)):
                rows_t[layer, win, off] = put(window_rows)
                if n:
                    s = put(sink_rows)
                    sink_t[layer, int(self._sink_of[table[0]]), : len(sinks)] = s
                    if not c:  # the first page's F16 rows hold the sinks too, as a write puts them there
                        rows_t[layer, int(self._window_of[table[0]]), : len(sinks)] = s
