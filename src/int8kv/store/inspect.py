"""What a KV file holds, read with every check of a load but in bounded memory (``int8kv cache inspect``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..formats import KvStorageFormat
from .files import check_path, open_for_reading
from .format import FORMAT_NAME, Header, read_data, read_header

__all__ = ["describe", "format_inspect", "inspect_kv"]


def inspect_kv(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a KV file holds (format, model, tokens, bytes), after the same checks as :func:`load_kv`
    (digests and values included): a file that inspects cleanly loads for its model.

    Memory stays bounded whatever the file's size: the data is hashed and checked in 1 MiB chunks and only
    the token ids (which the report lists) are kept.
    """
    name = check_path(path)
    with open_for_reading(name) as (f, size):
        header = read_header(f, size)
        tensors = read_data(f, header, keep={"token_ids"})
    return describe(header, Path(name), size, tensors.get("token_ids"))


def describe(header: Header, path: Path, file_bytes: int, token_ids: torch.Tensor | None) -> dict[str, Any]:
    """The report of a checked header (token_ids: ``[batch, seq_len]`` int64 or None), as plain JSON types.
    ``num_kv_heads`` / ``head_dim`` are None for a file of several K/V shapes (``groups`` lists them)."""
    tokens = header.batch * header.seq_len
    groups = [
        {"num_layers": la.num_layers, "num_kv_heads": la.num_kv_heads, "head_dim": la.head_dim,
         "layers": None if header.layers is None else list(header.layers[g])}
        for g, la in enumerate(header.layouts)
    ]  # fmt: skip
    return {
        "path": str(path),
        "file_bytes": file_bytes,
        "format": FORMAT_NAME,
        "format_version": header.version,
        "storage_format": header.fmt.value,
        "source": header.source,
        "created_by": header.created_by,
        "num_layers": header.num_layers,
        "batch": header.batch,
        "seq_len": header.seq_len,
        "num_kv_heads": None if header.grouped else header.num_kv_heads,
        "head_dim": None if header.grouped else header.head_dim,
        "groups": groups,
        # A stateful format's bytes depend on the length (its sinks and window): the tensors' own.
        "kv_bytes": sum(t.nbytes for t in header.tensors if t.name != "token_ids") if header.fmt.is_stateful
        else tokens * sum(la.bytes_per_token for la in header.layouts),
        "f16_kv_bytes": tokens * sum(la.with_format(KvStorageFormat.F16).bytes_per_token for la in header.layouts),
        "model": None if header.model is None else header.model.to_dict(),
        "model_digest": None if header.model is None else header.model.digest,
        "token_ids": None if token_ids is None else token_ids.tolist(),
        "metadata": header.metadata,
        "data_sha256": header.data_sha256,
    }


def format_inspect(info: Mapping[str, Any], max_tokens: int = 16) -> str:
    """Human-readable report of an :func:`inspect_kv` dict (what ``int8kv cache inspect PATH`` prints)."""
    lines = [
        f"file      {info['path']} ({_human(info['file_bytes'])})",
        f"format    {info['format']} v{info['format_version']}, storage {info['storage_format']}, "
        f"from {info['source']} ({info['created_by']})",
        *(
            f"shape     {g['num_layers']} layers x batch {info['batch']} x {info['seq_len']} tokens x "
            f"{g['num_kv_heads']} kv heads x {g['head_dim']}"
            + _group_label(i, g, len(info["groups"]))
            for i, g in enumerate(info["groups"])
        ),
        f"kv bytes  {_human(info['kv_bytes'])} (F16 would take {_human(info['f16_kv_bytes'])}, "
        f"{info['kv_bytes'] / max(info['f16_kv_bytes'], 1):.2f}x)",
    ]
    model = info.get("model")
    if model is None:
        lines.append("model     not recorded")
    else:
        name = model.get("architecture") or model.get("model_type") or "?"
        lines.append(
            f"model     {name} [{info['model_digest']}]: {model['num_layers']} layers, {model['num_attention_heads']} "
            f"heads / {model['num_kv_heads']} kv, head_dim {model['head_dim']}, dtype {model['dtype']}, "
            f"weights {model['weights'] or 'not recorded'}"
        )
    ids = info.get("token_ids")
    if ids is None:
        lines.append("tokens    not recorded")
    else:
        for b, row in enumerate(ids):
            shown = " ".join(str(t) for t in row[:max_tokens]) + (" ..." if len(row) > max_tokens else "")
            lines.append(f"tokens    [{b}] {len(row)}: {shown}")
    if info.get("metadata"):
        lines.append(f"metadata  {json.dumps(info['metadata'], sort_keys=True)}")
    lines.append(f"sha256    {info['data_sha256']} (verified)")
    return "\n".join(lines)


def _group_label(i: int, group: Mapping[str, Any], count: int) -> str:
    if count == 1:
        return ""
    return f" (group {i}, layers {group['layers']})" if group["layers"] else f" (group {i})"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
