from .contiguous import QuantizedKvCache, QuantizedKvLayer

__all__ = ["QuantizedKvCache", "QuantizedKvLayer"]
