"""Write a Llama-shaped GGUF model with random weights, then llama.cpp's own quantizations of it (benchmarks only).

    python tools/make_gguf_model.py --shape 1b --out DIR [--types Q4_K_M,Q8_0]

The tokenizer, vocabulary and chat template come from the packaged SmolLM2 GGUF (49,152 tokens), the shape from
`SHAPES` (Llama 3.2 1B / 3B, Llama 3.1 8B: hidden size, layers, heads, FFN). Weights are float16 normals (std 0.02,
the embedding 1.0), norms ones, so the quantized blocks are what llama.cpp's quantizer writes for such tensors.
The F16 file is written to DIR, then each type by ``llama_cpp.llama_model_quantize`` (llama-cpp-python, the
`peers` extra), then the F16 file is removed unless ``--keep-f16``. Tensors are generated one at a time: memory
stays at one tensor, whatever the shape.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

SHAPES = {  # hidden, layers, heads, kv heads, ffn
    "1b": (2048, 16, 32, 8, 8192),
    "3b": (3072, 28, 24, 8, 8192),
    "8b": (4096, 32, 32, 8, 14336),
}
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
_SKIP = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type"}


def _copy_metadata(reader, writer, dims: dict[str, int]) -> None:
    from gguf import GGUFValueType

    for key, field in reader.fields.items():
        if key in _SKIP or key.startswith("llama."):
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == GGUFValueType.STRING:
            writer.add_string(key, value)
        else:
            writer.add_key_value(key, value, kind)
    for key, value in dims.items():
        writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 500000.0)


def write_f16(path: Path, shape: str, seed: int = 0) -> None:
    import gguf

    from int8kv.models import default_gguf_path

    hidden, layers, heads, kv_heads, ffn = SHAPES[shape]
    head_dim = hidden // heads
    reader = gguf.GGUFReader(default_gguf_path())
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(path), "llama")
    _copy_metadata(reader, writer, {
        "llama.block_count": layers, "llama.embedding_length": hidden, "llama.feed_forward_length": ffn,
        "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
        "llama.rope.dimension_count": head_dim, "llama.context_length": 8192, "llama.vocab_size": vocab,
    })  # fmt: skip
    writer.add_file_type(1)
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes.update({
            b + "attn_norm.weight": (hidden,), b + "ffn_norm.weight": (hidden,),
            b + "attn_q.weight": (hidden, hidden), b + "attn_k.weight": (kv_heads * head_dim, hidden),
            b + "attn_v.weight": (kv_heads * head_dim, hidden), b + "attn_output.weight": (hidden, hidden),
            b + "ffn_gate.weight": (ffn, hidden), b + "ffn_up.weight": (ffn, hidden),
            b + "ffn_down.weight": (hidden, ffn),
        })  # fmt: skip

    def tensor(name: str, dims: tuple[int, ...]) -> np.ndarray:
        if len(dims) == 1:
            return np.ones(dims, np.float32)
        std = 1.0 if name == "token_embd.weight" else 0.02
        return (rng.standard_normal(dims, dtype=np.float32) * std).astype(np.float16)

    # Shapes first (the header), then each tensor's data written as it is made: one tensor in memory at a time.
    for name, dims in shapes.items():
        writer.add_tensor_info(name, dims, np.dtype(np.float32 if len(dims) == 1 else np.float16),
                               int(np.prod(dims)) * (4 if len(dims) == 1 else 2))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in shapes.items():
        writer.write_tensor_data(tensor(name, dims))
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), required=True)
    parser.add_argument("--out", required=True, help="directory for the files")
    parser.add_argument("--types", default="Q4_K_M,Q8_0", help=f"comma-separated, of {', '.join(FTYPES)}")
    parser.add_argument("--keep-f16", action="store_true")
    args = parser.parse_args(argv)
    types = [t.strip() for t in args.types.split(",")]
    unknown = [t for t in types if t not in FTYPES]
    if unknown:
        parser.error(f"unknown types {unknown}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"llama-{args.shape}-F16.gguf"
    if not f16.exists():
        print(f"writing {f16}", flush=True)
        write_f16(f16, args.shape)
    import llama_cpp

    for name in types:
        target = out / f"llama-{args.shape}-{name}.gguf"
        if target.exists():
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[name]
        params.nthread = os.cpu_count() or 1
        tmp = target.with_suffix(".partial")
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params)
        if rc != 0:
            print(f"{name}: llama_model_quantize returned {rc}", file=sys.stderr)
            return 1
        tmp.rename(target)
        print(f"wrote {target} ({target.stat().st_size / 2**30:.2f} GiB)", flush=True)
    if not args.keep_f16:
        f16.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
