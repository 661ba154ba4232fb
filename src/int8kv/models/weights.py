"""The precision a model's matmuls run in: its own, bfloat16, or int8 (an explicit choice, never a default).

    model = convert_weights(model, "int8")        # a copy whose nn.Linear layers hold int8 weights
    table = embedding_table(model.model.embed_tokens)  # float32 rows, or a GGUF embedding decoding its rows

- ``"model"``: the model's own weights, exactly. A GGUF model loaded packed (int8kv.models.gguf_weights:
  GgufLinear layers over the file's blocks) runs as it is. Linear layers whose float32 weights are GGUF Q4_1 /
  Q8_0 blocks decoded (a GGUF file converted to float32 by transformers) run as those blocks
  (int8kv.models.packed: every weight checked to decode back bit for bit), the others as loaded.
- ``"dense"``: the weights as loaded, in torch's matmuls (float32 for SmolLM2), nothing packed; GGUF blocks read
  in place (GgufLinear) are decoded to float32 ``torch.nn.Linear`` layers, one layer at a time.
- ``"bfloat16"``: each Linear's weight rounded to bfloat16 (half the bytes read per token); its input is
  rounded to bfloat16 for the matmul and the output comes back in the input's dtype, so norms, residuals and
  attention keep the model's precision.
- ``"int8"``: each Linear's weight quantized per output row (symmetric, scale = max |w| / 127, one float32
  scale per row) and multiplied by torch's weight-only int8 kernel with the input rounded to bfloat16 (a
  quarter of the bytes of float32 read per token; CPU only). Inputs are not quantized: torch's dynamic int8
  Linear (fbgemm: 7-bit inputs, one range per call) cost +255 % perplexity on SmolLM2 over 512-token windows
  and +13 % even with a range per row (+2.3 % at 8 bits per row), against +0.8 % weight-only
  (`int8kv eval` figures in docs/performance.md, "Weight precision"); and a range per call would make a row's
  result depend on its batch mates.

Why the weights: with an INT8 KV cache a small model's decode step spends more time in its matmuls than in
attention, writing K/V and the rest of the forward together. On a CPU with AVX-512 VNNI, int8 weight-only
decodes faster than float32; bfloat16 does not, its one-row matmul being no faster than float32 in torch
(docs/archive/benchmarks-2026.md, "Weight precision on SmolLM2-135M").

Embeddings stay as they are (a lookup reads one row). A GgufLinear converts from its decoded float32 weights,
one layer at a time (no float32 copy of the whole model). Converted layers keep their weights in the module's
``state_dict`` (int8 codes and scales for "int8"), so a model fingerprint hashes what actually runs.
Perplexity on `int8kv eval`'s 2,048-token run: bfloat16 -0.008 %, int8 +0.747 %; it and the decode speed are
in docs/performance.md ("Weight precision").
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import UnsupportedWeights
from .gguf_weights import GgufLinear, SideBySideLinear
from .packed import PackedLinear, pack_weights

WEIGHTS = ("model", "dense", "bfloat16", "int8")
CONCAT_BYTES = 16 << 20  # GGUF layers of one kind fused by copying their blocks up to this size (fused_linear)


def check_weights(weights: object) -> str:
    """``weights`` if it names a precision in WEIGHTS; UnsupportedWeights (a ValueError) otherwise."""
    if not isinstance(weights, str) or weights not in WEIGHTS:
        raise UnsupportedWeights(f"weights must be one of {WEIGHTS}, got {weights!r}")
    return weights


class BFloat16Linear(torch.nn.Module):
    """``y = x W^T + b`` with W (and b) stored in bfloat16; y in x's dtype."""

    kind = "bfloat16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)

    def float_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight.float(), None if self.bias is None else self.bias.float()


class Int8Linear(torch.nn.Module):
    """``y = x W^T + b`` with W stored as int8 codes and one float32 scale per output row; x rounded to
    bfloat16 for the matmul (torch's weight-only int8 kernel, ``_weight_int8pack_mm``), y in x's dtype.
    Each row of x is multiplied on its own (no activation quantization), so a row's output does not depend
    on the other rows of its batch. CPU only."""

    kind = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach()
        if w.device.type != "cpu":
            raise UnsupportedWeights(
                f'weights="int8" runs on the CPU only (torch\'s weight-only int8 kernel), got a weight on {w.device}'
            )
        w = w.float()
        if not bool(torch.isfinite(w).all()):
            raise UnsupportedWeights("cannot quantize a Linear weight that holds NaN or inf")
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self._init(codes, scale, None if bias is None else bias.detach().float())

    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, in_features: int
    ) -> Int8Linear:
        """From another Int8Linear's codes (padded as its `weight`) and scales, without requantizing."""
        self = cls.__new__(cls)
        self._init(codes, scale, bias, in_features)
        return self

    def _init(
        self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, in_features: int | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], in_features or codes.shape[1]
        # The kernel reads rows in runs of 32 and returns garbage or crashes otherwise (torch 2.13: inner sizes
        # 33, 40 and 130 did; 32, 96, 160, 576, 1536 ran exact): codes and inputs get zero columns up to it.
        self._pad = -self.in_features % 32
        if codes.shape[1] == self.in_features and self._pad:
            codes = F.pad(codes, (0, self._pad))
        # Buffers: in the state_dict (what a fingerprint hashes), moved with the module.
        self.register_buffer("weight", codes.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", bias)
        # The kernel multiplies by a bfloat16 scale per row; it gets ones and the float32 scale is applied
        # afterwards (a bfloat16 scale would add up to 2^-9 of relative error per row).
        self._ones = torch.ones(self.out_features, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self._pad:
            rows = F.pad(rows, (0, self._pad))
        y = torch._weight_int8pack_mm(rows, self.weight, self._ones).float() * self.scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def float_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight[:, : self.in_features].float() * self.scale[:, None], self.bias


KINDS = {"bfloat16": BFloat16Linear, "int8": Int8Linear}


def _kind(module: torch.nn.Module) -> str | None:
    kinds = BFloat16Linear | Int8Linear | PackedLinear | GgufLinear
    return getattr(module, "kind", None) if isinstance(module, kinds) else None


def convert_weights(model: torch.nn.Module, weights: str, inplace: bool = False) -> torch.nn.Module:
    """``model`` with every ``torch.nn.Linear`` holding ``weights`` (module docs): a deep copy, or ``model``
    itself with ``inplace``; "dense" returns ``model`` as it is unless it holds GgufLinear layers, and so does
    "model" where no layer is exact GGUF blocks. UnsupportedWeights (nothing changed) for an unknown name, a model
    already converted to another precision, or int8 weights off the CPU."""
    check_weights(weights)
    if weights == "dense":
        blocks = [name for name, m in model.named_modules() if isinstance(m, GgufLinear)]
        if not blocks:
            return model
        if not inplace:
            model = copy.deepcopy(model)  # GgufLinear copies share their blocks (read-only views of the file)
        for name in blocks:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, _float_linear(*getattr(parent, child).float_weights()))
        return model
    if weights == "model":
        return pack_weights(model, inplace=inplace)
    # GGUF blocks read in place are the file's own weights: they convert (from one decoded layer at a time).
    others = sorted({k for m in model.modules()
                     if (k := _kind(m)) not in (None, weights) and not isinstance(m, GgufLinear)})  # fmt: skip
    if others:
        raise UnsupportedWeights(
            f"the model's Linear layers already hold {others[0]} weights; cannot make them {weights}"
        )
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear | GgufLinear)]
    for name, m in linears:
        if isinstance(m, GgufLinear):
            continue
        if not m.weight.is_floating_point():
            raise UnsupportedWeights(f"{name or 'model'}: a Linear with {m.weight.dtype} weights cannot be converted")
        if weights == "int8" and m.weight.device.type != "cpu":
            raise UnsupportedWeights(f'weights="int8" runs on the CPU only; {name or "model"} is on {m.weight.device}')
    if not inplace:
        model = copy.deepcopy(model)
    cls = KINDS[weights]
    for name, _ in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        setattr(parent, child, cls(*old.float_weights()) if isinstance(old, GgufLinear) else cls(old.weight, old.bias))
    return model


def _float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    """A float32 ``torch.nn.Linear`` holding ``weight`` and ``bias`` themselves (no copy), without gradients."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.detach().float(), requires_grad=False)
    return linear.requires_grad_(False)


def fused_linear(modules: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """One Linear computing ``modules`` side by side (their outputs concatenated), in their precision:
    float32 for plain ``nn.Linear`` (the fused forward's own precision), else their common converted kind."""
    kinds = {_kind(m) for m in modules}
    if len(kinds) == 1 and isinstance(modules[0], PackedLinear):  # blocks along the input: rows concatenate
        return modules[0] if len(modules) == 1 else PackedLinear.concatenated(list(modules))
    if any(isinstance(m, GgufLinear) for m in modules):
        # GGUF layers of one kind concatenate their block rows into one layer (one kernel call) while the copy is
        # small (SmolLM2's q / k / v: 0.6 MiB a layer); larger ones run side by side, each on its own blocks in the
        # mapping: the 8B Llama shape's q / k / v and gate / up concatenated held 2.6 GB more (the copy beside the
        # mapped originals it read). Mixed kinds (a Q6_K v beside Q4_K q / k) always run side by side.
        if len(modules) == 1:
            return modules[0]
        if (len(kinds) == 1 and all(isinstance(m, GgufLinear) for m in modules)
                and len({m.bias is None for m in modules}) == 1
                and sum(m.blocks.numel() for m in modules) <= CONCAT_BYTES):
            bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
            blocks = torch.cat([m.blocks for m in modules])
            return GgufLinear(modules[0].kind, blocks, bias, modules[0].in_features)
        if any(_kind(m) in KINDS for m in modules):
            raise UnsupportedWeights(f"cannot fuse Linear layers of different precisions ({sorted(map(str, kinds))})")
        if len({m.bias is None for m in modules}) != 1:
            raise UnsupportedWeights("cannot fuse Linear layers of which only some have a bias")
        return SideBySideLinear(list(modules))
    if kinds <= {None, *PackedLinear.KINDS}:  # packed and float32 layers side by side: exact float32 weights
        kinds = {None}
    if len(kinds) != 1:
        raise UnsupportedWeights(f"cannot fuse Linear layers of different precisions ({sorted(map(str, kinds))})")
    (kind,) = kinds
    if kind == "int8":  # per-row scales: the codes and scales concatenate as they are
        if len({m.bias is None for m in modules}) != 1:
            raise UnsupportedWeights("cannot fuse Linear layers of which only some have a bias")
        bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
        if len({m.in_features for m in modules}) != 1:
            raise UnsupportedWeights("cannot fuse Linear layers of different input sizes")
        return Int8Linear.from_codes(
            torch.cat([m.weight for m in modules]), torch.cat([m.scale for m in modules]), bias, modules[0].in_features
        )
    parts = [m.float_weights() if _kind(m) is not None else (m.weight.detach().float(), m.bias) for m in modules]
    if any((b is None) != (parts[0][1] is None) for _, b in parts):
        raise UnsupportedWeights("cannot fuse Linear layers of which only some have a bias")
    # One module: its own tensors (float32 weights are shared, not copied).
    weight = parts[0][0] if len(parts) == 1 else torch.cat([w for w, _ in parts])
    bias = None if parts[0][1] is None else torch.cat([b.detach().float() for _, b in parts])
    if kind is None:
        fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with torch.no_grad():
            fused.weight = torch.nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                fused.bias = torch.nn.Parameter(bias, requires_grad=False)
        return fused.requires_grad_(False)
    return KINDS[kind](weight, bias)


def embedding_table(embedding: torch.nn.Module):
    """What ``table[ids]`` looks rows up in: a float32 embedding's weight (float32), or a GgufEmbedding itself
    (it decodes only the rows asked for: no float32 copy of its table)."""
    from .gguf_weights import GgufEmbedding

    if isinstance(embedding, GgufEmbedding):
        return embedding
    return embedding.weight.detach().float()
