"""A tiered KV block store: one interface, one backend per file, a factory by URL.

    store = open_block_store("embedded" | "disk:/path" | "redis://host:6379/0" | "redis+cluster://h:p,h:p")
    n = store.lookup(keys)                      # longest cached prefix of a 32-byte key chain
    state = store.get_prefix(keys[:n], spec)    # one verified KvState of the blocks; stops at the first miss
    BackgroundWriter(store).submit(key, store.encode(spec, key, state.slice(a, b)))  # bound to key (+ HMAC)

Store faults are misses (counted in ``store.stats()``, logged once per interval), never exceptions.
The value format is specified in docs/block_store.md.
"""

from .base import BlockStore, StoreStats
from .codec import (
    VALUE_VERSION,
    BlockHeader,
    BlockSpec,
    assemble_blocks,
    check_secret,
    decode_block,
    encode_block,
    read_header,
    verify_block,
)
from .errors import (
    BlockEncodeError,
    BlockStoreError,
    BlockValueError,
    CorruptBlock,
    IncompatibleBlock,
    InvalidBlockKey,
    InvalidBlockValues,
    InvalidStoreSecret,
    InvalidStoreUrl,
    MisplacedBlock,
    NewerBlock,
    StoreUnavailable,
    UnauthenticatedBlock,
    UnsupportedBlock,
)
from .factory import open_block_store
from .writer import BackgroundWriter

__all__ = [
    "VALUE_VERSION",
    "BackgroundWriter",
    "BlockEncodeError",
    "BlockHeader",
    "BlockSpec",
    "BlockStore",
    "BlockStoreError",
    "BlockValueError",
    "CorruptBlock",
    "IncompatibleBlock",
    "InvalidBlockKey",
    "InvalidBlockValues",
    "InvalidStoreSecret",
    "InvalidStoreUrl",
    "MisplacedBlock",
    "NewerBlock",
    "StoreStats",
    "StoreUnavailable",
    "UnauthenticatedBlock",
    "UnsupportedBlock",
    "assemble_blocks",
    "check_secret",
    "decode_block",
    "encode_block",
    "open_block_store",
    "read_header",
    "verify_block",
]
