"""Prefix reuse: prefill a long prompt, or load its saved KV state instead.

    python -m int8kv.bench prefix [--tokens 1024] [--repeat 3] [--threads N] [--model PATH] [--json PATH]

For INT8 and F16 storage: the prefill of a ``--tokens`` prompt into an :class:`~int8kv.hf.Int8KvCache`,
``save_kv`` of the result, and ``load_kv`` of the file into a fresh cache (model fingerprint checked against
a fingerprint computed once, as a server would). Also checks that the next-token logits after the loaded
state are bit-identical to those after the prefilled one. The prompt is seeded random token ids: prefill
cost does not depend on which tokens they are. Files go to a temporary directory (page cache warm, as for a
prompt cache that is reused).

``--threads 1`` gives steadier figures on a shared machine: there every multi-threaded torch op waits for a
busy core to wake its second thread (~10 ms per op), which swamps both a prefill and a load.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..cli_common import bench_parser
from ..formats import KvStorageFormat
from ..progress import progress
from ..store import load_kv, model_fingerprint, save_kv
from .timing import emit, set_threads

FORMATS = (KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1, KvStorageFormat.F16)


def _best(fn: Any, repeat: int) -> tuple[float, Any]:
    """Best wall time of ``repeat`` calls and the last result (no warm-up: a prefill is too long to waste)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def run(tokens: int = 1024, repeat: int = 3, model_path: str | None = None, threads: int | None = None) -> dict:
    from ..hf import Int8KvCache
    from ..models import load_model

    if threads is not None:
        set_threads(threads)

    start = time.perf_counter()
    model, _ = load_model(model_path, quiet=True)
    load_model_s = time.perf_counter() - start
    config = model.config
    start = time.perf_counter()
    fingerprint = model_fingerprint(model)
    fingerprint_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(config.vocab_size), (1, tokens), generator=gen)
    next_id = torch.randint(0, int(config.vocab_size), (1, 1), generator=gen)

    def prefill(fmt: KvStorageFormat) -> Any:
        cache = Int8KvCache(config, fmt)
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        return cache

    def next_logits(cache: Any) -> torch.Tensor:
        with torch.no_grad():
            return model(next_id, cache=cache, use_cache=True).logits

    def measure(fmt: KvStorageFormat, path: Path) -> dict[str, Any]:
        prefill_s, cache = _best(lambda: prefill(fmt), repeat)
        save_s, info = _best(lambda: save_kv(path, cache, model=fingerprint, token_ids=ids), repeat)
        load_s, loaded = _best(lambda: load_kv(path, Int8KvCache(config, fmt), model=fingerprint), repeat)
        return {
            "prefill_s": prefill_s,
            "save_s": save_s,
            "load_s": load_s,
            "saved_s": prefill_s - load_s,
            "speedup": prefill_s / load_s,
            "file_bytes": os.path.getsize(path),
            "kv_bytes": info["kv_bytes"],
            "identical_next_logits": bool(torch.equal(next_logits(cache), next_logits(loaded.cache))),
        }

    with tempfile.TemporaryDirectory(prefix="int8kv-prefix-") as tmp:
        rows = {
            fmt.value: measure(fmt, Path(tmp) / f"prompt-{fmt.value}.kv")
            for fmt in progress(FORMATS, "prefix: prefill vs load_kv per format")
        }
    int8, f16 = (rows[f.value] for f in FORMATS)
    return {
        "model": fingerprint.architecture or fingerprint.model_type,
        "fingerprint": fingerprint.digest,
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "load_model_s": load_model_s,
        "fingerprint_s": fingerprint_s,
        "formats": rows,
        "int8_over_f16_file": int8["file_bytes"] / f16["file_bytes"],
    }


def report(result: dict) -> str:
    lines = [
        f"prefix reuse on {result['model']} [{result['fingerprint']}], {result['tokens']}-token prompt, "
        f"torch threads {result['threads']} (best of N; weights fingerprint, computed once: "
        f"{result['fingerprint_s']:.2f} s)",
        f"{'format':<34}{'prefill s':>10}{'load s':>9}{'saved s':>9}{'x faster':>9}{'save s':>8}{'file MiB':>10}"
        f"{'same logits':>12}",
    ]
    for name, row in result["formats"].items():
        lines.append(
            f"{name:<34}{row['prefill_s']:>10.3f}{row['load_s']:>9.4f}{row['saved_s']:>9.3f}{row['speedup']:>9.1f}"
            f"{row['save_s']:>8.3f}{row['file_bytes'] / 2**20:>10.2f}"
            f"{'yes' if row['identical_next_logits'] else 'NO':>12}"
        )
    lines.append(f"INT8 file / F16 file: {result['int8_over_f16_file']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser("prefix", __doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs, best kept")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--model", metavar="PATH", default=None, help="model (default: packaged SmolLM2-135M)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeat < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--tokens, --repeat and --threads must be >= 1")
    result = run(args.tokens, args.repeat, args.model, args.threads)
    return emit(result, report(result), args.json)


if __name__ == "__main__":
    main()
