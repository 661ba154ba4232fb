"""A GGUF model run from its file's own blocks: the Linear weights and the embedding stay the quantized bytes of
the memory-mapped file (no float32 copy of a quantized matrix is ever made) and int8kv.ops.cpu_gguf multiplies them
in place.

    table = read_table(path)                  # gguf.GGUFReader: architecture, each tensor's type / shape / offset
    model = build_model(path, table, config)  # the transformers model of config, its matmuls GgufLinear

`int8kv.models.load_model` does this for a .gguf whose architecture is llama (Llama, SmolLM2, Mistral-shaped),
qwen2 or qwen3 and whose every tensor is one of TENSOR_TYPES (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K: the
tensors of Q4_K_M / Q5_K_M / Q6_K / Q8_0 files; F32 / F16 / BF16 for norms and biases). Anything else goes to the
float32 conversion by transformers, with the reason logged at WARNING (`int8kv.models`) by the loader.

- The model is instantiated with its parameters on the meta device (accelerate's `init_empty_weights`), then
  filled: each Linear with a quantized weight becomes a :class:`GgufLinear` whose `blocks` buffer is a uint8 view
  of the memory-mapped file (mode "c": copy-on-write, so the file is never written), the embedding a
  :class:`GgufEmbedding` that decodes the rows it is asked for, a tied output head a GgufLinear over the
  embedding's blocks; F32 / F16 / BF16 tensors become float32 tensors (a float Linear weight, rare in these files,
  a plain ``torch.nn.Linear``).
- Tensor names: transformers' GGUF name map (`get_gguf_hf_weights_map`), computed once when the table is cached.
  llama.cpp's converter permutes the rows of a llama model's attn_q / attn_k (interleaved RoPE halves);
  transformers' loader undoes it on the decoded weights (`LlamaTensorProcessor`), this module on the block rows:
  whole rows move and blocks stay along k, which copies those two tensors per layer out of the mapping.
- A GgufLinear has PackedLinear's surface (int8kv.models.packed): `kind`, `in_features`, `out_features`, `decoded()`
  / `float_weights()` (one layer's float32 weights, for tools that need them); `fused_linear` runs the layers of
  a fused QKV or gate/up side by side (:class:`SideBySideLinear`), each on its own blocks in the mapping.
  `convert_weights(model, "bfloat16" | "int8")` converts it from its decoded weights, one layer at a time.
- A deep copy shares `blocks` (read-only views of the file: copying them would copy the whole model); a pickle
  carries the bytes.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InvalidModelError, ShapeMismatch, UnsupportedWeights
from ..ops import cpu_gguf
from .packed import BlockLinear, BufferViews, float_rows

__all__ = [
    "ARCHITECTURES",
    "TENSOR_TYPES",
    "GgufEmbedding",
    "GgufLinear",
    "NotPacked",
    "SideBySideLinear",
    "build_model",
    "read_table",
    "unsupported_reason",
]

log = logging.getLogger("int8kv.models")

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # GGUF general.architecture values loaded packed
QUANTIZED = {name.upper(): name for name in cpu_gguf.KINDS}  # GGUF type name -> kernel kind
FLOATS = ("F32", "F16", "BF16")  # loaded as float32 tensors
TENSOR_TYPES = (*QUANTIZED, *FLOATS)
TABLE_VERSION = 1


class NotPacked(Exception):
    """The file cannot be run from its blocks here (the reason is the message): the loader falls back to the
    float32 conversion."""


# ---------------------------------------------------------------------------------------------------------
# the file's table
# ---------------------------------------------------------------------------------------------------------
def read_table(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The architecture and every tensor (name, GGUF type, shape (rows, row length), absolute byte offset and
    size) of a GGUF file, read with gguf.GGUFReader; NotPacked when the file cannot be read (truncated, not GGUF)."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path, "r")
        field = reader.fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None  # gguf-py >= 0.10
        tensors = [
            {"name": t.name, "type": t.tensor_type.name, "shape": [int(v) for v in reversed(t.shape.tolist())],
             "offset": int(t.data_offset), "nbytes": int(t.n_bytes)}
            for t in reader.tensors
        ]  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise NotPacked(f"gguf-py cannot read {path.name} ({type(exc).__name__}: {exc})") from exc
    size = path.stat().st_size
    for t in tensors:
        if t["offset"] + t["nbytes"] > size:
            raise NotPacked(f"{path.name} is truncated: tensor {t['name']} ends at byte {t['offset'] + t['nbytes']}"
                            f" of a {size}-byte file")  # fmt: skip
    return {"version": TABLE_VERSION, "architecture": arch, "file_size": size, "tensors": tensors}


def unsupported_reason(table: dict[str, Any]) -> str | None:
    """Why the file of ``table`` does not load packed (its architecture, a tensor type, a row that is not whole
    blocks), or None when it does."""
    arch = table.get("architecture")
    if arch not in ARCHITECTURES:
        return f"architecture {arch!r} (packed GGUF loading supports {', '.join(ARCHITECTURES)})"
    for t in table["tensors"]:
        if t["type"] not in TENSOR_TYPES:
            return (f"tensor {t['name']} has type {t['type']} (packed GGUF loading supports "
                    f"{', '.join(TENSOR_TYPES)})")  # fmt: skip
        if t["type"] in QUANTIZED:
            weights = cpu_gguf.LAYOUTS[QUANTIZED[t["type"]]][0]
            if len(t["shape"]) != 2 or t["shape"][1] % weights:
                return f"tensor {t['name']} of type {t['type']} has shape {t['shape']}: not whole rows of blocks"
    return None


def name_map(table: dict[str, Any], config: Any) -> dict[str, str]:
    """GGUF tensor name -> transformers parameter name for the model of ``config`` (transformers' own map, built on
    a parameter-free model). The loader calls it once per file, when it caches the file's table."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    from .loader import _one_gguf_parse  # gguf's per-architecture name map built once, not once per module

    with init_empty_weights(include_buffers=True):
        meta = AutoModelForCausalLM.from_config(config)
    with _one_gguf_parse():
        return get_gguf_hf_weights_map(meta, TensorProcessor(), model_type=table["architecture"])


# ---------------------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------------------
class _FileBlocks(BufferViews):
    """A module over GGUF blocks of one kind (the `blocks` buffer: a CPU uint8 tensor (rows, row bytes), the file's
    bytes) and the numpy view the kernels read. A deep copy shares `blocks` (module docs); a pickle carries them."""

    def _set_blocks(self, kind: str, blocks: torch.Tensor, k: int) -> None:
        """Check and keep ``blocks``: UnsupportedWeights for an unknown kind or blocks that are no CPU tensor,
        ShapeMismatch unless its rows hold ``k`` weights."""
        self.kind = str(kind).lower()
        self._kid = cpu_gguf.kind_id(self.kind)  # UnsupportedWeights for an unknown kind
        if not isinstance(blocks, torch.Tensor) or blocks.device.type != "cpu":
            raise UnsupportedWeights(f"GGUF {self.kind} blocks must be a CPU uint8 tensor")
        held = cpu_gguf.check_blocks(self.kind, blocks.numpy())  # ShapeMismatch
        if held != k:
            raise ShapeMismatch(f"{self.kind} blocks hold rows of {held} weights, expected {k}")
        # A buffer: in the state_dict (what a model fingerprint hashes: the blocks that run).
        self.register_buffer("blocks", blocks)
        self._view: np.ndarray | None = None

    def _blocks(self) -> np.ndarray:
        """The kernels' array: a numpy view of the buffer, made once and again after `_apply` (.to() ...)."""
        if self._view is None:
            if self.blocks.device.type != "cpu":
                raise UnsupportedWeights(f"GGUF {self.kind} weights run on the CPU only, got them on "
                                         f"{self.blocks.device}")  # fmt: skip
            view = self.blocks.numpy()
            cpu_gguf.check_blocks(self.kind, view)
            self._view = view
        return self._view

    def __deepcopy__(self, memo: dict) -> _FileBlocks:
        memo[id(self.blocks)] = self.blocks
        twin = self.__class__.__new__(self.__class__)
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy({**self.__dict__, "_view": None}, memo))
        return twin

    def decoded(self) -> torch.Tensor:
        """All the float32 weights (rows, k): gguf-py's dequantized values bit for bit."""
        return torch.from_numpy(cpu_gguf.dequantize(self.kind, self._blocks()))


class GgufLinear(BlockLinear, _FileBlocks):
    """``y = x W^T + b`` with W the GGUF blocks of ``kind`` (int8kv.ops.cpu_gguf's layout: a uint8 tensor (out_features,
    row bytes), the file's bytes); y in x's dtype. Up to cpu_gguf.DENSE_ROWS rows of x run the block kernel,
    more decode tiles of W for torch's matmul. CPU only."""

    KINDS = cpu_gguf.KINDS
    _LABEL = "GGUF"

    def __init__(self, kind: str, blocks: torch.Tensor, bias: torch.Tensor | None, in_features: int) -> None:
        super().__init__()
        self._set_blocks(kind, blocks, in_features)
        self.in_features = in_features
        self.out_features = int(blocks.shape[0])
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ShapeMismatch(f"bias of shape {tuple(bias.shape)} for {self.out_features} outputs")
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._has_bias = bias is not None

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        blocks = self._blocks() if self._view is None else self._view
        return torch.from_numpy(cpu_gguf.matmul_checked(float_rows(rows), self._kid, blocks))

    def block_product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [m, in_features] W^T`` (no bias) by the block kernel, whatever m: float32 ``[m, out_features]``."""
        return torch.from_numpy(cpu_gguf.block_matmul(float_rows(rows), self.kind, self._blocks()))

    def dense_product(self, rows: torch.Tensor) -> torch.Tensor:
        """The same by decoded tiles of W and torch's matmul."""
        return torch.from_numpy(cpu_gguf.dense_matmul(float_rows(rows), self.kind, self._blocks()))


class SideBySideLinear(torch.nn.Module):
    """Linear layers run one after the other on the same input, their outputs concatenated: what `fused_linear`
    makes of GGUF layers of different kinds (e.g. Q4_K q / k with a Q6_K v), keeping each one's blocks."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        super().__init__()
        if len({m.in_features for m in modules}) != 1:
            raise UnsupportedWeights("cannot fuse Linear layers of different input sizes")
        self.parts = torch.nn.ModuleList(modules)
        self.in_features = modules[0].in_features
        self.out_features = sum(m.out_features for m in modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.parts], dim=-1)

    def float_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        parts = [m.float_weights() if hasattr(m, "float_weights") else (m.weight.detach().float(), m.bias)
                 for m in self.parts]  # fmt: skip
        if any((b is None) != (parts[0][1] is None) for _, b in parts):
            raise UnsupportedWeights("cannot fuse Linear layers of which only some have a bias")
        bias = None if parts[0][1] is None else torch.cat([b.detach().float() for _, b in parts])
        return torch.cat([w for w, _ in parts]), bias


class GgufEmbedding(_FileBlocks):
    """An embedding table kept as GGUF blocks: a lookup decodes only the rows it is asked for (exactly gguf-py's
    float32 values). Its output dtype follows the model's (the zero-size `_dtype` buffer, converted by .to())."""

    def __init__(self, kind: str, blocks: torch.Tensor, embedding_dim: int, padding_idx: int | None = None) -> None:
        super().__init__()
        self._set_blocks(kind, blocks, embedding_dim)
        self.num_embeddings = int(blocks.shape[0])
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.register_buffer("_dtype", torch.empty(0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids_np = np.ascontiguousarray(ids.detach().cpu().reshape(-1).numpy().astype(np.int64, copy=False))
        rows = cpu_gguf.decode_rows_checked(
            self._kid, self._blocks() if self._view is None else self._view, ids_np, self.embedding_dim
        )
        out = torch.from_numpy(rows).view(*ids.shape, self.embedding_dim)
        return out if self._dtype.dtype == torch.float32 else out.to(self._dtype.dtype)

    __getitem__ = forward  # the fused engine forward indexes its table: embed[input_ids]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.kind}"


# ---------------------------------------------------------------------------------------------------------
# building the model
# ---------------------------------------------------------------------------------------------------------
def _float_tensor(data: np.ndarray, gguf_type: str, shape: list[int]) -> torch.Tensor:
    if gguf_type == "F32":
        values = data.view(np.float32).copy()
    elif gguf_type == "F16":
        values = data.view(np.float16).astype(np.float32)
    elif gguf_type == "BF16":
        values = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:  # a quantized 1-d tensor (none of the supported files has one): gguf-py's decode, small
        import gguf

        qtype = getattr(gguf.GGMLQuantizationType, gguf_type)
        values = gguf.quants.dequantize(data.reshape(-1, data.size // max(1, int(np.prod(shape[:-1])))), qtype)
    return torch.from_numpy(np.ascontiguousarray(values.reshape(shape), dtype=np.float32))


def _reverse_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order back to transformers' (LlamaTensorProcessor._reverse_permute_weights), moving
    whole rows (of blocks or of values): a copy."""
    dim = rows.shape[0] // n_head // 2
    return np.ascontiguousarray(rows.reshape(n_head, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape))


def build_model(path: str | os.PathLike[str], table: dict[str, Any], config: Any,
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:  # fmt: skip
    """The transformers causal LM of ``config`` with its weights from the GGUF file at ``path`` (``table``: its
    :func:`read_table`, each tensor's transformers name under "hf"): quantized matmuls and embedding as
    blocks read in place (module docs). InvalidModelError when the file does not fit the config (a missing tensor,
    a shape that differs). A table without the names gets them here (:func:`name_map`)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not any("hf" in t for t in table["tensors"]):
        names = name_map(table, config)
        table = {**table, "tensors": [{**t, "hf": names.get(t["name"])} for t in table["tensors"]]}
    size = path.stat().st_size
    if size != table["file_size"]:
        raise InvalidModelError(f"{path} is {size} bytes, its cached table describes {table['file_size']}")
    file = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: a write never reaches the file
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    arch = table["architecture"]
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    entries = {t["hf"]: t for t in table["tensors"] if t.get("hf")}
    modules = dict(model.named_modules())

    def raw(entry: dict) -> np.ndarray:
        data = np.asarray(file[entry["offset"] : entry["offset"] + entry["nbytes"]])
        if entry["type"] in QUANTIZED:
            n = entry["shape"][0]
            data = data.reshape(n, entry["nbytes"] // n)
        if arch == "llama" and (".attn_q." in entry["name"] or ".attn_k." in entry["name"]):
            rows = data if entry["type"] in QUANTIZED else data.reshape(entry["shape"][0], -1)
            data = _reverse_permute(rows, heads if ".attn_q." in entry["name"] else kv_heads)
        return data

    def float_param(entry: dict, want: tuple[int, ...]) -> torch.nn.Parameter:
        shape = entry["shape"]
        if tuple(shape) != tuple(want):
            raise InvalidModelError(f"{path.name}: tensor {entry['name']} has shape {shape}, the model expects "
                                    f"{list(want)}")  # fmt: skip
        return torch.nn.Parameter(_float_tensor(raw(entry), entry["type"], shape).to(dtype), requires_grad=False)

    def blocks_of(entry: dict, rows: int, k: int) -> tuple[str, torch.Tensor]:
        if entry["shape"] != [rows, k]:
            raise InvalidModelError(f"{path.name}: tensor {entry['name']} has shape {entry['shape']}, the model "
                                    f"expects [{rows}, {k}]")  # fmt: skip
        return QUANTIZED[entry["type"]], torch.from_numpy(raw(entry))

    def put(name: str, module: torch.nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)

    done: set[str] = set()
    embeddings: dict[str, torch.nn.Module] = {}
    for name, module in modules.items():
        if isinstance(module, torch.nn.Embedding) and f"{name}.weight" in entries:
            entry = entries[f"{name}.weight"]
            done.add(f"{name}.weight")
            if entry["type"] in QUANTIZED:
                kind, blocks = blocks_of(entry, module.num_embeddings, module.embedding_dim)
                new = GgufEmbedding(kind, blocks, module.embedding_dim, module.padding_idx)
                new._dtype = torch.empty(0, dtype=dtype)
            else:
                new = torch.nn.Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx,
                                         device="meta")  # fmt: skip
                new.weight = float_param(entry, (module.num_embeddings, module.embedding_dim))
            put(name, new)
            embeddings[name] = new
        elif isinstance(module, torch.nn.Linear):
            entry = entries.get(f"{name}.weight")
            bias = entries.get(f"{name}.bias")
            if entry is None:
                continue  # a tied head: below
            done.update({f"{name}.weight", f"{name}.bias"})
            if (bias is None) != (module.bias is None):
                raise InvalidModelError(f"{path.name}: {name} {'lacks' if bias is None else 'has'} a bias the model "
                                        f"{'expects' if bias is None else 'does not have'}")  # fmt: skip
            bias_t = None if bias is None else float_param(bias, (module.out_features,)).data.float()
            if entry["type"] in QUANTIZED:
                kind, blocks = blocks_of(entry, module.out_features, module.in_features)
                put(name, GgufLinear(kind, blocks, bias_t, module.in_features))
            else:
                new = torch.nn.Linear(module.in_features, module.out_features, bias=bias is not None, device="meta")
                new.weight = float_param(entry, (module.out_features, module.in_features))
                if bias is not None:
                    new.bias = torch.nn.Parameter(bias_t.to(dtype), requires_grad=False)
                put(name, new)
    # Tied output head: the embedding's blocks (or weight), shared, not copied.
    head_name = _head_name(model)
    head = model.get_submodule(head_name) if head_name else None
    if head is not None and f"{head_name}.weight" not in entries and getattr(config, "tie_word_embeddings", False):
        emb_name = next((n for n, m in model.named_modules() if m is model.get_input_embeddings()), None)
        emb = embeddings.get(emb_name)
        if isinstance(emb, GgufEmbedding):
            put(head_name, GgufLinear(emb.kind, emb.blocks, None, emb.embedding_dim))
        elif emb is not None:
            new = torch.nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False, device="meta")
            new.weight = emb.weight
            put(head_name, new)
    # Every other parameter (norms, biases of other modules) from its F32 / F16 tensor.
    for full, entry in entries.items():
        if full in done:
            continue
        owner, _, attr = full.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            continue
        current = module._parameters.get(attr)
        if current is None:
            continue
        module._parameters[attr] = float_param(entry, tuple(current.shape))
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if missing:
        raise InvalidModelError(f"{path.name} holds no tensor for {', '.join(missing[:5])}"
                                f"{' ...' if len(missing) > 5 else ''}")  # fmt: skip
    unused = sorted(t["name"] for t in table["tensors"] if not t.get("hf"))
    if unused:
        log.info("%s: tensors not used by the transformers model: %s", path.name, ", ".join(unused))
    model.config.architectures = [type(model).__name__]
    model.requires_grad_(False)
    return model.eval()


def _head_name(model: torch.nn.Module) -> str | None:
    head = model.get_output_embeddings()
    if head is None:
        return None
    return next((n for n, m in model.named_modules() if m is head), None)
