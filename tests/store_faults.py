"""What store faults cost an engine's admissions: ``python tests/store_faults.py [ADMISSIONS]``.

For each fault (a Valkey node, the embedded server and one node of a 3-node cluster paused with SIGSTOP or
killed; a FIFO under a block's name in a ``disk:`` store) an engine on a tiny random Llama writes a prompt,
the fault is made, and ADMISSIONS (default 8) prompts the pool does not hold are generated one per call, with
the store's back-off off (``retry_after = 0``: every admission asks the stuck store, the worst case) and on
(the default 1 s). Prints one line per fault: the wait of an admission on the store (mean and max, ms), and
the same engine's wait on a healthy store first. Servers are loopback children stopped by their own pid.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
from test_engine import SMALL, tiny
from valkey_servers import StoreFault

from int8kv.blockstore import BlockStore
from int8kv.cache.prefix import PrefixHasher
from int8kv.engine import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
BS = 16


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, SMALL["vocab_size"], (2 * BS + 3,), generator=g).tolist() for _ in range(n)]


def waits(llm: LLM, batch: list[list[int]]) -> tuple[float, float]:
    tier = llm.scheduler.tier
    tier.slowest_fetch_s, count, total = 0.0, tier.fetches, tier.fetch_seconds
    for p in batch:
        llm.generate([p], PARAMS)
    return (tier.fetch_seconds - total) / (tier.fetches - count), tier.slowest_fetch_s


def measure(model, fault: str, n: int, retry_after: float, tmp: str) -> str:
    broken = None if fault == "disk-fifo" else StoreFault(fault)
    url = broken.url if broken else f"disk:{tempfile.mkdtemp(dir=tmp)}"
    llm = LLM(model, memory="1MiB", kv_store=url, kv_namespace="faults")
    try:
        healthy = waits(llm, prompts(n, 1))
        llm.flush_kv_store(timeout=30)
        llm.kv_store.retry_after = retry_after
        llm.kv_store.read_deadline = BlockStore.read_deadline  # the default, whatever the environment says
        batch = prompts(n, 2)
        if broken:
            broken.make(llm.kv_store)
        else:  # a FIFO under the first block of every prompt
            for p in batch:
                path = llm.kv_store.path_of(PrefixHasher(llm.cache.layout, llm.fingerprint, BS).block_keys(p)[0])
                path.parent.mkdir(exist_ok=True)
                os.mkfifo(path)
        start = time.perf_counter()
        faulty = waits(llm, batch)
        wall = time.perf_counter() - start
    finally:
        if broken:
            broken.resume()
        llm.close()
        if broken:
            broken.stop()
    return (f"{fault:<20} retry_after={retry_after:<3} healthy {healthy[0] * 1e3:6.1f} / {healthy[1] * 1e3:6.1f} ms"
            f"   fault {faulty[0] * 1e3:6.1f} / {faulty[1] * 1e3:6.1f} ms   ({n} admissions in {wall:.2f} s)")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    model = tiny("llama", seed=4)
    print(f"store wait per admission, mean / max; load average {os.getloadavg()[0]:.1f}", flush=True)
    faults = ["valkey-paused", "valkey-killed", "embedded-paused", "embedded-killed", "cluster-node-paused",
              "cluster-node-killed", "disk-fifo"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for fault in faults:
            for retry_after in (0.0, 1.0):
                print(measure(model, fault, n, retry_after, tmp), flush=True)


if __name__ == "__main__":
    main()
