from .allocator import BlockAllocator
from .contiguous import QuantizedKvCache, QuantizedKvLayer
from .paged import PagedKvCache, tokens_per_format
from .pool import KvPool
from .state import GroupedKvState, KvLayout, KvState, as_format

__all__ = [
    "BlockAllocator",
    "GroupedKvState",
    "KvLayout",
    "KvPool",
    "KvState",
    "PagedKvCache",
    "QuantizedKvCache",
    "QuantizedKvLayer",
    "as_format",
    "tokens_per_format",
]
