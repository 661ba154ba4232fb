"""A second process for the concurrent-writer test: ``python blockstore_child.py URL NAMESPACE SEED DIR``.

Opens the store, encodes 8 blocks of a state drawn from SEED (so each process's bytes differ under the same
keys), waits for DIR/go, puts them all, prints the indices it won, waits for DIR/read, and prints the SHA-256
of every value it reads back. Bounded: each wait gives up after 30 s.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from blockstore_helpers import blocks, key_chain, small_spec

from int8kv.blockstore import open_block_store

N_BLOCKS = 8


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"gave up waiting for {path}")
        time.sleep(0.005)


def main() -> None:
    url, namespace, seed, directory = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    store = open_block_store(url, namespace=namespace)
    keys = key_chain(N_BLOCKS, seed=0)  # the same prefix in both processes
    _, values = blocks(small_spec(), N_BLOCKS, seed=seed, keys=keys)
    print("ready", flush=True)
    wait_for(directory / "go")
    won = [i for i, (k, v) in enumerate(zip(keys, values, strict=True)) if store.put(k, v)]
    print(json.dumps({"won": won, "mine": [hashlib.sha256(v).hexdigest() for v in values]}), flush=True)
    wait_for(directory / "read")
    read = [None if v is None else hashlib.sha256(v).hexdigest() for v in store.get(keys)]
    print(json.dumps({"read": read, "stats": store.stats().as_dict()}), flush=True)
    store.close()


if __name__ == "__main__":
    main()
