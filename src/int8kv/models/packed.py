"""A GGUF model's own block-quantized weights, run as blocks: Linear layers whose float weights are exactly
Q4_1 or Q8_0 blocks keep them packed and multiply them with int8kv.ops.cpu_packed.

    model = pack_weights(model)     # a copy; every Linear whose weights are exact blocks becomes a PackedLinear

transformers decodes a GGUF file's Q4_1 / Q8_0 tensors to float32 when it loads one (SmolLM2-135M-Instruct's
Linear layers are Q4_1, its tied embedding and lm_head Q8_0), and every decoded token then reads 4 bytes per
weight. The blocks are recovered from the float32 values and checked: a layer is packed only if decoding the
recovered blocks gives back every one of its float32 weights bit for bit, so a packed layer multiplies by exactly
the weights the model holds (the kernels differ from torch's float32 matmul in summation order only). Layers
that are not exact blocks (a float16 or bfloat16 model, a model quantized another way, random weights) stay as
they are. Nothing is approximated.

Recovering a block of 32 decoded weights (ggml's reference quantizers):
- Q4_1 (w = d q + m, q in 0..15, d >= 0 and m float16 values): the smallest weight has q = 0, so m is the
  block's minimum; the largest has q = 15, so d is the float16 value with d * 15 + m equal to the block's
  maximum (the float16 nearest (max - min) / 15 or a neighbour).
- Q8_0 (w = d q, q in -127..127, d a float16 value): the weight of largest magnitude has |q| = 127, so d is
  that magnitude / 127 (exact).
A block quantized otherwise (an importance matrix can move d and m off the extremes) fails the check and its
layer stays float32.

Rows of x above `DENSE_ROWS` (a prefill chunk) decode the layer's weights to float32 for one torch matmul (the
dense product, bit for bit torch's over the model's float32 weights). The block kernel decodes each block once per
four rows of x, so its cost grows with the rows, while decoding the weights costs the same at any row count;
over SmolLM2's layers the block kernel stays the faster one up to 64 rows (`docs/results/packed_kernel_rows.py`,
docs/archive/benchmarks-2026.md, "Packed GGUF weights").
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from ..errors import ShapeMismatch, UnsupportedWeights
from ..ops import cpu_packed

__all__ = ["DENSE_ROWS", "BlockLinear", "BufferViews", "PackedLinear", "float_rows", "pack_blocks", "pack_weights"]

BLOCK = cpu_packed.BLOCK
DENSE_ROWS = 64  # rows of x above which a layer decodes its weights for one float32 matmul instead
_F16 = np.float16


def _f16_exact(values: np.ndarray) -> bool:
    return bool(np.array_equal(values.astype(_F16).astype(np.float32), values))


def _q4_1(w: np.ndarray, low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """(codes, d, m) whose decoding is exactly ``w`` (n, k) float32, or None; low / high: its blocks' ranges."""
    if not _f16_exact(low):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        d = ((high - low) / np.float32(15)).astype(_F16)
        best = d.astype(np.float32)
        for step in (np.float16(np.inf), np.float16(0)):  # float16 neighbours up and down, where d * 15 + m misses
            miss = best * np.float32(15) + low != high
            if not miss.any():
                break
            other = np.nextafter(d, step).astype(np.float32)
            best = np.where(miss & (other * np.float32(15) + low == high), other, best)
    if not np.isfinite(best).all():
        return None
    codes = cpu_packed.encode_q4_1(w, best, low)
    return None if codes is None else (codes, best, low)


def _q8_0(w: np.ndarray, low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """(codes, d) whose decoding is exactly ``w`` (n, k) float32, or None; low / high: its blocks' ranges."""
    d = np.maximum(-low, high) / np.float32(127)
    if not (np.isfinite(d).all() and _f16_exact(d)):
        return None
    codes = cpu_packed.encode_q8_0(w, d)
    return None if codes is None else (codes, d)


def pack_blocks(weight: torch.Tensor) -> tuple[str, tuple[np.ndarray, ...]] | None:
    """("q4_1", (codes, d, m)) or ("q8_0", (codes, d)) if ``weight`` (n, k) is exactly such blocks along k
    (module docs), else None. A float32 CPU tensor only: any other dtype holds no decoded GGUF blocks."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.ndim != 2 or weight.shape[1] % BLOCK:
        return None
    w = np.ascontiguousarray(weight.detach().numpy())
    if w.size == 0:
        return None
    low, high = cpu_packed.block_ranges(w)
    # Q8_0 first: its scale check rejects a Q4_1 layer before any per-weight pass.
    for kind, find in (("q8_0", _q8_0), ("q4_1", _q4_1)):
        parts = find(w, low, high)
        if parts is not None:
            return kind, parts
    return None


def float_rows(rows: torch.Tensor) -> np.ndarray:
    """``rows`` as the block kernels take them: a C-contiguous float32 numpy array (detached, no copy if it is one)."""
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.float().contiguous()
    if rows.requires_grad:
        rows = rows.detach()
    return rows.numpy()


class BufferViews(torch.nn.Module):
    """A module that keeps numpy views of its buffers in ``_view`` (what its kernels read, made once): dropped
    when anything replaces the buffers (``_apply``: .to(), .float(), ...) and left out of a copy (deepcopy, pickle),
    whose buffers are its own."""

    _view = None

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (torch's signature)
        self._view = None
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_view": None}


class BlockLinear(BufferViews):
    """What the Linear layers over weight blocks share (PackedLinear, gguf_weights.GgufLinear): ``y = x W^T + b``
    on the CPU, y in x's dtype, the product of x's rows by the subclass's ``_product`` (float32 rows -> float32
    ``[m, out_features]``). Subclasses set ``kind``, ``in_features``, ``out_features``, ``bias``, ``_has_bias``
    and ``_LABEL`` (the messages' name of the weights) and define ``decoded()``."""

    _LABEL = "block"

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this ~200 times: attribute reads of plain fields, no reshape of a 2-d input.
        shape = x.shape
        if shape[-1] != self.in_features:
            raise ShapeMismatch(f"expected inputs of {self.in_features} features, got shape {tuple(shape)}")
        if x.device.type != "cpu":
            raise UnsupportedWeights(f"{self._LABEL} {self.kind} weights run on the CPU only, got an input on "
                                     f"{x.device}")  # fmt: skip
        rows = x if len(shape) == 2 else x.reshape(-1, self.in_features)
        y = self._product(rows)
        if self._has_bias:
            y = y + self.bias
        if len(shape) != 2:
            y = y.view(*shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def float_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.decoded(), self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


class PackedLinear(BlockLinear):
    """``y = x W^T + b`` with W kept as Q4_1 or Q8_0 blocks (int8kv.ops.cpu_packed's layouts); y in x's dtype.
    Up to DENSE_ROWS rows of x run the block kernel, more decode W to float32 for one torch matmul. CPU only."""

    KINDS = cpu_packed.KINDS
    _LABEL = "packed"

    def __init__(self, kind: str, parts: tuple[np.ndarray, ...], bias: torch.Tensor | None, in_features: int) -> None:
        super().__init__()
        if kind not in self.KINDS:
            raise UnsupportedWeights(f"no packed kernel for {kind!r} blocks")
        self.kind = kind
        self.in_features = in_features
        self.out_features = parts[0].shape[0]
        # Buffers: in the state_dict (what a model fingerprint hashes: the blocks that run), moved with the module.
        self.register_buffer("codes", torch.from_numpy(np.ascontiguousarray(parts[0])))
        self.register_buffer("scale", torch.from_numpy(np.ascontiguousarray(parts[1])))
        low = parts[2] if kind == "q4_1" else None
        self.register_buffer("low", None if low is None else torch.from_numpy(np.ascontiguousarray(low)))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._view: tuple[np.ndarray, ...] | None = None
        self._has_bias = bias is not None
        self._parts()  # checks the arrays (cpu_packed.check_parts)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> PackedLinear | None:
        """A PackedLinear computing exactly ``linear``'s weights, or None where they are not exact blocks."""
        found = pack_blocks(linear.weight)
        if found is None:
            return None
        return cls(found[0], found[1], linear.bias, linear.in_features)

    def _parts(self) -> tuple[np.ndarray, ...]:
        """The kernels' arrays: numpy views of the buffers, made once (a decode step calls 211 layers) and again
        after anything replaces the buffers (``_apply``: .to(), .float(), ...)."""
        if self._view is None:
            buffers = [t for t in (self.codes, self.scale, self.low) if t is not None]
            if any(t.device.type != "cpu" for t in buffers):
                raise UnsupportedWeights(f"packed {self.kind} weights run on the CPU only, got them on "
                                         f"{self.codes.device}")  # fmt: skip
            if any(t.dtype == torch.bfloat16 for t in buffers):
                raise UnsupportedWeights(f"packed {self.kind} scales must stay float32, got bfloat16")
            views = tuple(t.numpy() for t in buffers)
            cpu_packed.check_parts(self.kind, views, self.in_features)  # e.g. after .half(): refused, not run
            self._view = views
        return self._view

    def decoded(self) -> torch.Tensor:
        """The float32 weight (out_features, in_features): exactly the model's."""
        parts = self._parts()
        w = cpu_packed.decode_q4_1(*parts) if self.kind == "q4_1" else cpu_packed.decode_q8_0(*parts)
        return torch.from_numpy(w)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        return self.dense_product(rows) if rows.shape[0] > DENSE_ROWS else self.block_product(rows)

    def block_product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [m, in_features] W^T`` (no bias) by the block kernel, whatever m: float32 ``[m, out_features]``."""
        return torch.from_numpy(cpu_packed.matmul_rows(float_rows(rows), self._view or self._parts()))

    def dense_product(self, rows: torch.Tensor) -> torch.Tensor:
        """The same by decoding W to float32 for one torch matmul: torch's float32 product of the model's weights."""
        return torch.nn.functional.linear(rows.float(), self.decoded())

    @staticmethod
    def concatenated(modules: list[PackedLinear]) -> PackedLinear:
        """One PackedLinear computing ``modules`` side by side (outputs concatenated): same kind and input size."""
        kinds = {m.kind for m in modules}
        if len(kinds) != 1 or len({m.in_features for m in modules}) != 1:
            raise UnsupportedWeights("cannot fuse packed Linear layers of different kinds or input sizes")
        if len({m.bias is None for m in modules}) != 1:
            raise UnsupportedWeights("cannot fuse Linear layers of which only some have a bias")
        parts = tuple(np.concatenate(p) for p in zip(*(m._parts() for m in modules), strict=True))
        bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
        return PackedLinear(modules[0].kind, parts, bias, modules[0].in_features)


def pack_weights(model: torch.nn.Module, inplace: bool = False) -> torch.nn.Module:
    """``model`` with every ``torch.nn.Linear`` whose float32 weights are exact Q4_1 / Q8_0 blocks replaced by a
    PackedLinear (module docs); a copy (sharing nothing it changes), or ``model`` itself with ``inplace``. A model
    with no such layer comes back as it is (itself: nothing would change)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    packed = {}
    for name, m in linears:
        found = PackedLinear.from_linear(m)
        if found is not None:
            packed[name] = found
    if not packed:
        return model
    if not inplace:
        # The replaced layers' weights are not copied (the copy drops them); everything else is.
        memo = {id(m.weight): m.weight for name, m in linears if name in packed}
        model = copy.deepcopy(model, memo)
    for name, module in packed.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module)
    return model
