"""The model fingerprint a KV file records: what identifies the model a KV state was computed by."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from ._util import HEX64, MAX_DIM, canonical, is_int, raw_bytes
from .errors import FingerprintError, StoreError

__all__ = ["ModelFingerprint", "as_fingerprint", "model_fingerprint"]


@dataclass(frozen=True)
class ModelFingerprint:
    """What identifies the model a KV state was computed by. Compared field by field on load.

    ``weights`` is ``"sha256:<hex>"`` of the weights (name, dtype, shape and bytes of every state-dict entry),
    ``"id:<text>"`` for a caller-given id, or None when only a config was given. ``config_sha256`` hashes
    the config's fields that can change the K/V values (rope, norms, sizes...), not bookkeeping fields.
    """

    architecture: str | None
    model_type: str | None
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int | None
    vocab_size: int | None
    dtype: str | None
    config_sha256: str
    weights: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def digest(self) -> str:
        """Short id of the whole fingerprint (16 hex digits), for display."""
        return hashlib.sha256(canonical(self.to_dict())).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: object, error: type[StoreError] = FingerprintError) -> ModelFingerprint:
        """Strict parse: exactly the known fields, each of its declared type (``error`` is raised otherwise)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, Mapping) or set(data) != set(names):
            got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise error(f"a model fingerprint needs exactly the fields {names}, got {got}")
        ints = {"num_layers", "num_attention_heads", "num_kv_heads", "head_dim"}
        optional_ints = {"hidden_size", "vocab_size"}
        for name in names:
            value = data[name]
            if name in ints:
                ok = is_int(value) and 0 < value < MAX_DIM
            elif name in optional_ints:
                ok = value is None or (is_int(value) and 0 < value < MAX_DIM)
            elif name == "config_sha256":
                ok = isinstance(value, str) and bool(HEX64.fullmatch(value))
            else:
                ok = value is None or isinstance(value, str)
            if not ok:
                raise error(f"model fingerprint field {name!r} has an invalid value {value!r}")
        return cls(**{name: data[name] for name in names})

    def differences(self, other: ModelFingerprint) -> list[str]:
        return [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


# Config fields that cannot change K/V values: bookkeeping, generation defaults, special token ids. Left out of
# config_sha256 so the same model loaded twice (or with another attention implementation) matches itself.
_CONFIG_IGNORED = frozenset(
    {
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "use_cache",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "initializer_range",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "unk_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        "finetuning_task",
        "torchscript",
        "tf_legacy_loss",
        "use_bfloat16",
        "pruned_heads",
        "attention_dropout",
        "hidden_dropout",
        "dropout",
        "quantization_config",
    }
)


def model_fingerprint(model_or_config: Any, weights_id: str | None = None) -> ModelFingerprint:
    """Fingerprint of a transformers model (its config, and a sha256 of its weights) or of a config alone.

    ``weights_id`` replaces the weight hash with a caller-given id (hashing reads every weight: ~1 s per
    500 MB). Compute the fingerprint once and pass it to :func:`save_kv` / :func:`load_kv` as ``model=``.
    """
    if isinstance(model_or_config, ModelFingerprint):
        return model_or_config
    module = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
    config = getattr(model_or_config, "config", model_or_config) if module is not None else model_or_config
    if config is None or not hasattr(config, "to_dict"):
        raise FingerprintError(f"expected a transformers model or config, got {type(model_or_config).__name__}")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_layers = _config_int(text, "num_hidden_layers")
    heads = _config_int(text, "num_attention_heads")
    kv_heads = _config_int(text, "num_key_value_heads", heads)
    hidden = _config_int(text, "hidden_size", None)
    if _config_value(text, "head_dim") is not None:
        head_dim = _config_int(text, "head_dim")
    elif hidden is not None:
        head_dim = hidden // heads
    else:
        raise FingerprintError("the config gives neither head_dim nor hidden_size")
    architectures = getattr(config, "architectures", None) or [None]
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if weights_id is not None:
        weights: str | None = f"id:{weights_id}"
    elif module is not None:
        weights = "sha256:" + _weights_sha256(module)
    else:
        weights = None
    return ModelFingerprint(
        architecture=None if architectures[0] is None else str(architectures[0]),
        model_type=getattr(config, "model_type", None) or None,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=_config_int(text, "vocab_size", None),
        dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        config_sha256=_config_sha256(config),
        weights=weights,
    )


def _config_value(config: Any, name: str) -> Any:
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: the field varies per layer (Gemma 4)
        return vars(config).get(name)  # the config's global value; config_sha256 covers the per-layer ones


def _config_int(config: Any, name: str, default: Any = ...) -> Any:
    value = _config_value(config, name)
    if value is None:
        if default is ...:
            raise FingerprintError(f"the config has no {name}")
        return default
    if not is_int(value) or value <= 0:
        raise FingerprintError(f"config.{name} must be a positive int, got {value!r}")
    return int(value)


def _config_sha256(config: Any) -> str:
    def strip(d: Any) -> Any:
        if isinstance(d, dict):
            return {str(k): strip(v) for k, v in d.items() if not str(k).startswith("_") and k not in _CONFIG_IGNORED}
        if isinstance(d, (list, tuple)):
            return [strip(v) for v in d]
        return d

    try:
        kept = strip(config.to_dict())
        # default=str: configs carry enums and dtypes; their str() is stable across runs.
        text = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    except (TypeError, ValueError) as exc:
        raise FingerprintError(f"cannot serialise the model config: {exc}") from exc
    return hashlib.sha256(text.encode()).hexdigest()


def _weights_sha256(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    first_name: dict[tuple[Any, ...], str] = {}
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach()
        if t.device.type == "meta":
            raise FingerprintError(f"weight {name!r} is on the meta device: load the weights or pass weights_id")
        # The name, dtype and shape frame the bytes, so two different state dicts can never hash alike.
        digest.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        # Tied weights (embedding = lm_head) are one tensor under two names: hash it once, then by reference.
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in first_name:
            digest.update(b"=" + first_name[key].encode())
            continue
        first_name[key] = name
        digest.update(raw_bytes(t))
    return digest.hexdigest()


def as_fingerprint(model: Any, weights_id: str | None) -> ModelFingerprint | None:
    """The fingerprint behind save_kv/load_kv's ``model=``: None, a fingerprint, its dict, a model or a config."""
    if model is None:
        if weights_id is not None:
            raise FingerprintError("weights_id needs model= (the model or config it identifies)")
        return None
    if isinstance(model, ModelFingerprint):
        return model
    if isinstance(model, Mapping):
        return ModelFingerprint.from_dict(model)
    return model_fingerprint(model, weights_id)
