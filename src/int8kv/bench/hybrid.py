"""KV pages the engine holds for a model mixing sliding and full layers, against every block kept.

    python -m int8kv.bench hybrid [--tokens 8192] [--window 1024] [--sliding 5] [--full 1] [--periods 1]
                                  [--block-size 16] [--chunk 512] [--json PATH]

A tiny random Gemma 3 text model (hidden 64, 4 query heads, 1 KV head of dim 32) with the layer pattern repeated
``--periods`` times: ``--sliding`` layers of window ``--window``, then ``--full`` full layers. One prompt of
``--tokens`` random tokens is prefilled through the engine in chunks of ``--chunk`` (INT8 storage, no prefix
cache); after the prefill (one token generated) the allocator's pages in use per block table are read, and the
step's peak (`EngineStats.peak_blocks_used`: the last chunk reserved, before the window's blocks go back). The
baseline is one block table for every layer, every block kept: ``blocks_for_tokens(tokens)`` blocks of all the
K/V layers, counted here in bytes and in pages of one table group's layers.
"""

from __future__ import annotations

from typing import Any

from ..cli_common import bench_parser
from ..formats import KvStorageFormat
from .timing import emit

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1


def mixed_model(sliding: int, full: int, periods: int, window: int, positions: int) -> Any:
    """A tiny random Gemma 3 text model whose layers are ``periods`` x (``sliding`` sliding, ``full`` full)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    types = (["sliding_attention"] * sliding + ["full_attention"] * full) * periods
    config = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(types),
                              num_attention_heads=4, num_key_value_heads=1, head_dim=32, layer_types=types,
                              sliding_window=window, max_position_embeddings=positions, eos_token_id=None,
                              pad_token_id=0, bos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval()


def run(tokens: int, window: int, sliding: int, full: int, periods: int, block_size: int, chunk: int) -> dict:
    import torch

    from ..cache.state import KvLayout
    from ..engine import LLM, SamplingParams

    model = mixed_model(sliding, full, periods, window, tokens + 16)
    layers = (sliding + full) * periods
    every = KvLayout(layers, 1, 32, INT8)  # one table for every layer
    all_blocks = -(-tokens // block_size)
    # Room for every block kept, so the pool never limits the run.
    memory = 2 * all_blocks * every.bytes_per_block(block_size)
    llm = LLM(model, kv_format=INT8, memory=memory, block_size=block_size, max_num_batched_tokens=chunk,
              prefix_caching=False)  # fmt: skip
    alloc = llm.cache.allocator
    held: list[dict] = []

    def record(stats: Any) -> None:
        for seq in llm.scheduler.running:
            held.append({"context": alloc.context_len(seq.seq_id),
                         "pages": [alloc.blocks_in_use(g) for g in range(alloc.num_groups)]})  # fmt: skip

    prompt = torch.randint(1, 256, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True), on_step=record)
    after = next(h for h in held if h["context"] == tokens)
    page = llm.cache.layout.bytes_per_block(block_size)
    engine_pages = sum(after["pages"])
    group_layers = llm.cache.layout.num_layers
    return {
        "layers": layers, "pattern": f"{periods} x ({sliding} sliding, {full} full)", "window": window,
        "tokens": tokens, "block_size": block_size, "chunk": chunk, "windows": list(alloc.windows),
        "layers_per_page": group_layers, "page_bytes": page,
        "pages_per_table": after["pages"], "engine_pages": engine_pages,
        "engine_bytes": engine_pages * page, "peak_pages_in_step": llm.stats.peak_blocks_used,
        "all_blocks_pages": all_blocks * layers // group_layers,
        "all_blocks_bytes": all_blocks * every.bytes_per_block(block_size),
        "ratio": engine_pages * page / (all_blocks * every.bytes_per_block(block_size)),
    }  # fmt: skip


def report(result: dict) -> str:
    mib = 2**20
    return "\n".join([
        f"{result['layers']} layers, {result['pattern']}, window {result['window']}: {result['tokens']} tokens, "
        f"blocks of {result['block_size']}, prefill chunks of {result['chunk']}, INT8",
        f"block tables (windows): {result['windows']}; a page holds {result['layers_per_page']} layer(s), "
        f"{result['page_bytes']} bytes",
        f"pages in use after the prefill, per table: {result['pages_per_table']}",
        f"engine: {result['engine_pages']} pages ({result['engine_bytes'] / mib:.2f} MiB; step peak "
        f"{result['peak_pages_in_step']} pages)",
        f"every block kept: {result['all_blocks_pages']} pages ({result['all_blocks_bytes'] / mib:.2f} MiB)",
        f"engine / every block kept: {result['ratio']:.3f}x",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser("hybrid", __doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="prompt tokens (the context measured)")
    parser.add_argument("--window", type=int, default=1024, help="sliding_window of the sliding layers")
    parser.add_argument("--sliding", type=int, default=5, help="sliding layers per period")
    parser.add_argument("--full", type=int, default=1, help="full layers per period")
    parser.add_argument("--periods", type=int, default=1, help="repeats of the pattern")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    args = parser.parse_args(argv)
    if min(args.tokens, args.window, args.sliding, args.full, args.periods, args.block_size, args.chunk) < 1:
        parser.error("--tokens, --window, --sliding, --full, --periods, --block-size and --chunk must be >= 1")
    result = run(args.tokens, args.window, args.sliding, args.full, args.periods, args.block_size, args.chunk)
    return emit(result, report(result), args.json)


if __name__ == "__main__":
    main()
