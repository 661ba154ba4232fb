import json

import pytest
import torch

from int8kv import KvStorageFormat

INT8 = KvStorageFormat.INT8_PER_TOKEN_HEAD_F32_SCALE_V1
F16 = KvStorageFormat.F16


def test_exactly_three_members_with_stable_names():
    assert [f.as_str() for f in KvStorageFormat] == ["f16", "int8_per_token_head_f32_scale_v1",
                                                     "int4_kchan64_vtok_asym_sink4_win64_v1"]
    for fmt in KvStorageFormat:
        assert str(fmt) == fmt.as_str()
        assert KvStorageFormat.parse(fmt.as_str()) is fmt


def test_json_round_trip():
    text = json.dumps({"format": INT8})
    assert json.loads(text)["format"] == "int8_per_token_head_f32_scale_v1"
    assert KvStorageFormat.parse(json.loads(text)["format"]) is INT8


def test_unknown_name_lists_accepted():
    with pytest.raises(ValueError, match="f16.*int8_per_token_head_f32_scale_v1"):
        KvStorageFormat.parse("int4")


def test_default_is_f16():
    assert KvStorageFormat.default() is F16


@pytest.mark.parametrize("name", ["auto", "fp16", "float16", "half", "f16", "FP16", " auto "])
def test_from_dtype_f16(name):
    assert KvStorageFormat.from_dtype(name) is F16


def test_from_dtype_int8():
    assert KvStorageFormat.from_dtype("int8") is INT8
    assert KvStorageFormat.from_dtype(" INT4 ") is KvStorageFormat.INT4_SINK_WINDOW_V1


@pytest.mark.parametrize("name", ["fp8", "bf16", "bfloat16", "fp8_e4m3", "int4_v1", ""])
def test_from_dtype_refuses_the_rest(name):
    with pytest.raises(ValueError, match="accepted: .*int8"):
        KvStorageFormat.from_dtype(name)


def test_byte_accounting():
    assert [(p.name, p.dtype, p.shape(128), p.row_bytes(128)) for p in F16.parts] == [
        ("codes", torch.float16, (128,), 256)
    ]
    assert [(p.name, p.dtype, p.shape(128), p.row_bytes(128)) for p in INT8.parts] == [
        ("codes", torch.int8, (128,), 128), ("scales", torch.float32, (), 4)
    ]
    assert INT8.bytes_per_row(128) == 132 and F16.bytes_per_row(128) == 256
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
    assert F16.bytes_per_token(30, 3, 64) == 2 * 30 * 3 * 128
    assert INT8.bytes_per_token(30, 3, 64) / F16.bytes_per_token(30, 3, 64) == pytest.approx(68 / 128)
