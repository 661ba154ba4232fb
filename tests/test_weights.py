"""Weight precision (int8kv.models.weights): the converted Linear layers against a float64 reference, a tiny
model's logits under each precision, the engine's `weights=` option on both model paths, and its refusals."""

import pytest
import torch
from test_engine import SMALL, hf_logits, tiny

from int8kv import KvStorageFormat, model_fingerprint
from int8kv.engine import LLM
from int8kv.errors import InvalidEngineConfig, UnsupportedWeights
from int8kv.models import WEIGHTS, convert_weights
from int8kv.models.weights import BFloat16Linear, Int8Linear, fused_linear

F16 = KvStorageFormat.F16


def _linear(out_f: int, in_f: int, bias: bool, gen: torch.Generator) -> torch.nn.Linear:
    lin = torch.nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=gen) * 0.1)
        # A few large weights per layer, as trained models have: the per-row int8 scale must follow them.
        lin.weight[::7, ::5] *= 20
        if bias:
            lin.bias.copy_(torch.randn(out_f, generator=gen))
    return lin


@pytest.mark.parametrize("shape", [(1, 64, 48), (5, 33, 17), (3, 2, 96, 130)])  # ragged: odd rows and sizes
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_within_its_rounding_bound_of_float64(shape, bias):
    gen = torch.Generator().manual_seed(sum(shape) + bias)
    *lead, in_f, out_f = shape
    lin = _linear(out_f, in_f, bias, gen)
    x = torch.randn(*lead, in_f, generator=gen) * 3
    layer = Int8Linear(lin.weight, lin.bias)
    got = layer(x).double().reshape(-1, out_f)
    assert layer(x).dtype == torch.float32 and layer(x).shape == (*lead, out_f)
    w = lin.weight.double()
    # The weights: each row's codes times its scale, within half a step (max |w_row| / 254) of the weight.
    step = w.abs().amax(dim=1) / 127
    assert torch.allclose(layer.scale.double(), step, rtol=1e-6) and layer.weight.dtype == torch.int8
    dequant = layer.float_weights()[0].double()
    assert ((dequant - w).abs() <= step[:, None] / 2 * (1 + 1e-6)).all()
    # The product: inputs rounded to bfloat16 (unit roundoff u = 2^-8), products of codes summed in float32,
    # the sum rounded to bfloat16 once more, then scaled: within u of sum |x_bf16 . codes| x scale.
    u = 2.0**-8
    rows = x.double().reshape(-1, in_f)
    xb = x.bfloat16().double().reshape(-1, in_f)
    b = 0 if lin.bias is None else lin.bias.double()
    ref = xb @ dequant.T + b
    mag = xb.abs() @ dequant.abs().T
    assert ((got - ref).abs() <= u * mag + 1e-6).all(), f"worst {((got - ref).abs() - u * mag).max():.3e}"
    # Against float64 with the original inputs and weights: plus the inputs' and the weights' rounding.
    exact = rows @ w.T + b
    bound = u * mag + u * rows.abs() @ dequant.abs().T + rows.abs() @ (dequant - w).abs().T + 1e-6
    assert ((got - exact).abs() <= bound).all()
    # Rows are independent: one row alone gives exactly its result within a batch.
    assert torch.equal(layer(x.reshape(-1, in_f)[-1:]).double(), got[-1:])


@pytest.mark.parametrize("shape", [(1, 64, 48), (7, 33, 17)])
def test_bfloat16_linear_is_the_rounded_product(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    rows, in_f, out_f = shape
    lin = _linear(out_f, in_f, True, gen)
    x = torch.randn(rows, in_f, generator=gen)
    got = BFloat16Linear(lin.weight, lin.bias)(x)
    assert got.dtype == torch.float32
    # Weights, inputs and bias rounded to bfloat16 (8 significant bits), the product accumulated in float32.
    xb, wb, bb = (t.detach().bfloat16().double() for t in (x, lin.weight, lin.bias))
    ref = xb @ wb.T + bb
    scale = xb.abs() @ wb.abs().T + bb.abs()
    assert ((got.double() - ref).abs() <= 2**-7 * scale + 1e-6).all()  # the output's own bfloat16 rounding
    exact = x.double() @ lin.weight.double().T + lin.bias.double()
    assert ((got.double() - exact).abs() <= 3 * 2**-8 * scale + 1e-6).all()


def test_fused_linear_concatenates_rows_exactly():
    gen = torch.Generator().manual_seed(4)
    parts = [_linear(n, 40, False, gen) for n in (24, 8, 8)]
    x = torch.randn(3, 40, generator=gen)
    for cls in (BFloat16Linear, Int8Linear):
        convs = [cls(p.weight, p.bias) for p in parts]
        fused = fused_linear(convs)
        assert isinstance(fused, cls) and fused.out_features == 40
        want = torch.cat([c(x) for c in convs], dim=-1)
        assert torch.allclose(fused(x), want, rtol=0, atol=1e-5 * want.abs().max().item())
    plain = fused_linear(parts)
    assert torch.equal(plain.weight, torch.cat([p.weight for p in parts]))
    with pytest.raises(UnsupportedWeights, match="different precisions"):
        fused_linear([Int8Linear(parts[0].weight, None), parts[1]])


# Relative logit error of the tiny model's forward (scaled by the largest |logit|) per precision, float32 = 0.
# Measured (seed 2): bfloat16 4.0e-3, int8 9.9e-3; the bounds leave ~3x room.
LOGIT_BOUND = {"bfloat16": 1.5e-2, "int8": 3e-2}


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_tiny_model_logits_within_bound_of_float32(weights):
    model = tiny("llama", seed=2)
    ids = torch.randint(1, SMALL["vocab_size"], (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(model, ids)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_weights(model, weights)
    # The caller's model is untouched (a copy was converted).
    assert all(type(m) is not BFloat16Linear and type(m) is not Int8Linear for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    kinds = {type(m) for m in converted.modules() if isinstance(m, BFloat16Linear | Int8Linear)}
    assert kinds == {BFloat16Linear if weights == "bfloat16" else Int8Linear}
    err = ((hf_logits(converted, ids) - ref).abs().max() / ref.abs().max()).item()
    assert 0 < err < LOGIT_BOUND[weights], err


@pytest.mark.parametrize("implementation", ["transformers", "fused"])
@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_engine_runs_the_converted_weights(implementation, weights):
    model = tiny("llama", seed=3)
    ids = torch.randint(1, SMALL["vocab_size"], (48,), generator=torch.Generator().manual_seed(2)).tolist()
    want = hf_logits(convert_weights(model, weights), ids)  # transformers' forward on the converted model
    llm = LLM(model, kv_format=F16, memory="2MiB", implementation=implementation, weights=weights)
    got = llm.score(ids, chunk_size=16).double()
    # F16 K/V storage adds ~2^-11 per element; the matmuls are the same in both.
    assert ((got - want).abs().max() / want.abs().max()).item() < 5e-3
    float_llm = LLM(model, kv_format=F16, memory="2MiB", implementation=implementation)
    assert ((float_llm.score(ids, chunk_size=16).double() - want).abs().max() / want.abs().max()).item() > 1e-4
    # The prefix-cache key root hashes the weights that run.
    assert llm.fingerprint != float_llm.fingerprint
    assert all(isinstance(m, torch.nn.Linear) for m in (model.lm_head, model.model.layers[0].mlp.down_proj))


def test_fingerprint_hashes_the_converted_weights():
    model = tiny("llama", seed=4)
    a, b = (model_fingerprint(convert_weights(model, "int8")) for _ in range(2))
    assert a == b  # deterministic
    other = tiny("llama", seed=5)
    assert model_fingerprint(convert_weights(other, "int8")).weights != a.weights
    assert model_fingerprint(convert_weights(model, "bfloat16")).weights not in (
        a.weights,
        model_fingerprint(model).weights,
    )


@pytest.mark.parametrize("bad", ["float16", "INT8", "", None, 8, ["int8"]])
def test_unknown_weights_refused_by_name(bad):
    model = tiny("llama")
    with pytest.raises(InvalidEngineConfig, match="weights must be one of"):
        LLM(model, kv_format=F16, memory="2MiB", weights=bad)
    with pytest.raises(UnsupportedWeights, match="weights must be one of") as info:
        convert_weights(model, bad)
    assert isinstance(info.value, ValueError)
    assert set(WEIGHTS) == {"model", "dense", "bfloat16", "int8"}


def test_conversion_refusals_change_nothing():
    model = tiny("llama")
    bf16 = convert_weights(model, "bfloat16")
    with pytest.raises(UnsupportedWeights, match="already hold bfloat16"):
        convert_weights(bf16, "int8", inplace=True)
    assert all(type(m) is not Int8Linear for m in bf16.modules())
    assert convert_weights(bf16, "bfloat16") is not bf16  # the same precision again: a copy, unchanged kinds
    assert convert_weights(model, "model") is model
    if torch.cuda.is_available():
        with pytest.raises(UnsupportedWeights, match="CPU only"):
            convert_weights(tiny("llama").cuda(), "int8")
    with pytest.raises(UnsupportedWeights, match="CPU only"):
        Int8Linear(torch.zeros(2, 2, device="meta"), None)
    with pytest.raises(UnsupportedWeights, match="NaN or inf"):
        Int8Linear(torch.tensor([[1.0, float("nan")]]), None)


def test_cli_refuses_unknown_weights_before_loading(capsys, monkeypatch):
    import int8kv.models
    from int8kv.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(int8kv.models, "load_model", no_load)
    for command in ("demo", "eval", "serve"):
        with pytest.raises(SystemExit) as exc:
            main([command, "--weights", "fp8", "--quiet"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--weights: invalid choice: 'fp8'" in err and "'bfloat16', 'int8'" in err


def test_cli_eval_runs_the_chosen_weights(capsys, tmp_path):
    import json

    from test_loader import _write_tiny_model

    from int8kv.cli import main

    torch.manual_seed(0)
    _write_tiny_model(tmp_path / "tiny")
    (tmp_path / "t.txt").write_text("hello world " * 40)
    ppl = {}
    for weights in ("model", "int8"):
        out = tmp_path / f"{weights}.json"
        argv = [
            "eval",
            "--model",
            str(tmp_path / "tiny"),
            "--text",
            str(tmp_path / "t.txt"),
            "--ctx",
            "16",
            "--windows",
            "2",
            "--prompts",
            "0",
            "--no-fp8",
            "--weights",
            weights,
            "--json",
            str(out),
            "--quiet",
        ]
        assert main(argv) == 0
        assert f"weights: {weights}" in capsys.readouterr().out
        result = json.loads(out.read_text())
        assert result["weights"] == weights
        ppl[weights] = result["rows"][0]["perplexity"]
    assert ppl["int8"] != ppl["model"] and ppl["int8"] == pytest.approx(ppl["model"], rel=0.05)


@pytest.mark.parametrize("flag, value", [("--weights", "int4"), ("--weights", "int8,int8"), ("--implementations", "x")])
def test_bench_slope_refuses_unknown_engine_options(flag, value):
    from int8kv.bench.slope import parse_args
    from int8kv.cli_common import CliError

    with pytest.raises(CliError, match=f"{flag} takes distinct names of"):
        parse_args([flag, value])
    args = parse_args(["--weights", "model, bfloat16", "--implementations", "fused,transformers"])
    assert args.weights == ["model", "bfloat16"] and args.implementations == ["fused", "transformers"]


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_engine_accepts_smollm2_with_converted_weights(smollm2, weights):
    # The engine's start-up probe compares its logits with the model's own forward, before the conversion: in
    # bfloat16 matmuls SmolLM2's moved by 0.025 (int8) / 0.10 (bfloat16) of their range there, and were refused.
    model, _ = smollm2
    llm = LLM(model, memory="16MiB", weights=weights)
    ids = list(range(10, 42))
    want = hf_logits(convert_weights(model, weights), ids)
    got = llm.score(ids, chunk_size=16).double()
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.1

