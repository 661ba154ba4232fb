from .allocator import BlockAllocator
from .contiguous import QuantizedKvCache, QuantizedKvLayer
from .paged import PagedKvCache, tokens_per_format

__all__ = ["BlockAllocator", "PagedKvCache", "QuantizedKvCache", "QuantizedKvLayer", "tokens_per_format"]
