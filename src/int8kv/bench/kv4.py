"""4-bit KV candidates on real weights: perplexity against a float32 cache, per-step top-1 agreement with F16
storage, bytes per token.

    python -m int8kv.bench kv4 [--text FILE ...] [--ctx 1024] [--windows 12] [--batch 4] [--chunk 256]
                               [--gen-tokens 128] [--prompts 4] [--only NAME ...] [--model PATH] [--json PATH]
    python -m int8kv.bench kv4 --combine PART.json ... [--json PATH]     (merge runs made side by side)

``--ctx 0`` runs the agreement alone, ``--prompts 0`` the perplexity alone (a process per text and group of
candidates, merged with ``--combine``: docs/benchmarks.md, "4-bit KV").

Every candidate is a fake-quantizing transformers cache: ``update`` stores ``decode(encode(K/V))`` and attention
reads those rows, so each figure is the storage's error alone (a kernel that reads the codes computes the same
attention up to float rounding). For the rotated candidates rotating K/V, quantizing and rotating back is the
same computation as rotating q and the output with the rows left rotated (the rotation is orthogonal).

Perplexity follows `int8kv eval`: windows of ``--ctx`` tokens, each fed in chunks through a fresh cache (batches
of ``--batch`` windows), the second half of each scored. Agreement: F16 storage generates ``--gen-tokens``
greedily from each prompt; every candidate is then fed the same tokens and its top-1 is compared at each step
(teacher forcing, so an early difference does not count twice). Per-token candidates see the prompt and the
generated tokens in one forward (their rows do not depend on the chunking); candidates whose open block is
kept in F16 (KIVI) are stepped one token at a time.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..cli_common import bench_parser
from ..progress import Bar, note
from .timing import emit

EVAL_CORPUS = "common-licenses"  # the eval's default text (int8kv.eval.DEFAULT_TEXT_GLOB)
DEFAULT_TEXTS = (EVAL_CORPUS, "/usr/lib/python3.11/pydoc_data/topics.py")


def hadamard(d: int) -> torch.Tensor:
    """The normalized Sylvester-Hadamard matrix of order ``d`` (a power of two), float32: orthogonal, symmetric."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(torch.float32)


def random_signs(d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (d,), generator=g) * 2 - 1).to(torch.float32)


@dataclass(frozen=True)
class Scheme:
    """One candidate. ``mode``: "sym" (codes -7..7, scale = absmax / 7), "sym16" (all 16 codes, levels
    (q + 0.5) * scale, q in -8..7, scale = absmax / 7.5), "asym" (codes 0..15, min + q * scale). ``clip``:
    the scale is the best of a grid of clipping ratios for each group's squared error. ``scale_bytes``: per
    group (4: float32 scale; 2: float16 scale; asym stores a float16 scale and a float16 minimum, 4)."""

    name: str
    group: int | None = None  # None: head_dim
    mode: str = "sym"
    rotate: bool = False
    signs: bool = False
    clip: bool = False
    scale_bytes: int = 4
    kivi: bool = False  # keys per channel over each sealed block (values per token); implies open_f16
    open_f16: bool = False  # the block being filled kept in F16, quantized once sealed
    block: int = 16  # tokens per sealed block (open_f16)


SCHEMES = (
    Scheme("per-token sym g=d (no rotation)"),
    Scheme("per-token asym g=d (no rotation)", mode="asym"),
    Scheme("H + sym g=d", rotate=True),
    Scheme("H + sym16 g=d", mode="sym16", rotate=True),
    Scheme("H + asym g=d", mode="asym", rotate=True),
    Scheme("H + sym g=d + MSE clip", rotate=True, clip=True),
    Scheme("H + sym16 g=d + MSE clip", mode="sym16", rotate=True, clip=True),
    Scheme("H + signs + sym16 g=d + MSE clip", mode="sym16", rotate=True, signs=True, clip=True),
    Scheme("H + sym g=32 (f16 scale)", group=32, rotate=True, scale_bytes=2),
    Scheme("H + asym g=32", group=32, mode="asym", rotate=True),
    Scheme("H + asym g=d, open block F16", mode="asym", rotate=True, open_f16=True),
    Scheme("KIVI (K per channel / 16-block, V per token)", mode="asym", kivi=True, open_f16=True),
    Scheme("KIVI, 64-token blocks", mode="asym", kivi=True, open_f16=True, block=64),
)
BASELINE = "fp32 (baseline)"
# The frozen format, int8kv.quant4 (tests/test_bench_kv4.py: the same rows, bit for bit).
CHOSEN = "KIVI (K per channel / 16-block, V per token)"
CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(17))  # 1.0 down to 0.6


def _levels(x: torch.Tensor, scale: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "sym":
        return torch.round(x / scale).clamp(-7, 7) * scale
    return (torch.floor(x / scale).clamp(-8, 7) + 0.5) * scale  # sym16


def quant_groups(x: torch.Tensor, group: int, mode: str, clip: bool, scale_bytes: int) -> torch.Tensor:
    """decode(encode(x)) of 4-bit groups of ``group`` values along the last dimension, float32."""
    shape = x.shape
    g = x.reshape(*shape[:-1], shape[-1] // group, group)
    if mode == "asym":
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).half().float()
        lo = lo.half().float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (lo + torch.round((g - lo) / scale).clamp(0, 15) * scale).reshape(shape)
    top = 7.0 if mode == "sym" else 7.5
    amax = g.abs().amax(-1, keepdim=True)
    best, best_err = None, None
    for ratio in CLIP_RATIOS if clip else (1.0,):
        scale = amax * ratio / top
        if scale_bytes == 2:
            scale = scale.half().float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = _levels(g, scale, mode)
        err = (y - g).square().sum(-1, keepdim=True)
        if best is None:
            best, best_err = y, err
        else:
            take = err < best_err
            best, best_err = torch.where(take, y, best), torch.where(take, err, best_err)
    return best.reshape(shape)


class FakeQuant4:
    """Rows ``[..., head_dim]`` -> decode(encode(rows)) of one per-token scheme (or F16 rounding)."""

    def __init__(self, scheme: Scheme | None, head_dim: int) -> None:
        self.scheme = scheme
        if scheme is not None and scheme.rotate:
            self.h = hadamard(head_dim)
            self.s = random_signs(head_dim) if scheme.signs else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x16 = x.to(torch.float16).to(torch.float32)
        sc = self.scheme
        if sc is None:
            return x16.to(x.dtype)
        y = x16
        if sc.rotate:
            y = (y * self.s if self.s is not None else y) @ self.h
        y = quant_groups(y, sc.group or y.shape[-1], sc.mode, sc.clip, sc.scale_bytes)
        if sc.rotate:
            y = y @ self.h
            y = y * self.s if self.s is not None else y
        return y.to(x.dtype)


def make_cache(scheme: Scheme | None, head_dim: int) -> Any:
    """A DynamicCache whose stored rows went through ``scheme`` (None: F16 rounding; "fp32": no change)."""
    from transformers import DynamicCache

    if scheme == "fp32":
        return DynamicCache()
    fq = FakeQuant4(scheme, head_dim)
    if scheme is not None and scheme.open_f16:
        return OpenBlockCache(_kivi_keys if scheme.kivi else fq, fq, scheme.block)

    class Fake(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[override]
            return super().update(fq(key_states), fq(value_states), layer_idx, *args, **kwargs)

    return Fake()


def _kivi_keys(block: torch.Tensor) -> torch.Tensor:
    """Keys ``[B, H, T, D]`` of one sealed block, asym 4-bit per channel (over the block's T tokens)."""
    return quant_groups(block.transpose(-1, -2), block.shape[-2], "asym", False, 4).transpose(-1, -2)


def OpenBlockCache(keys: Any, values: Any, block: int) -> Any:  # noqa: N802 - built on demand (lazy transformers)
    """A DynamicCache whose sealed ``block``-token blocks are stored as ``keys(rows)`` / ``values(rows)``
    (decode of encode, ``[B, H, block, D]``) and whose open block stays in F16."""
    from transformers import DynamicCache

    class OpenBlock(DynamicCache):

        def __init__(self) -> None:
            super().__init__()
            self.sealed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[override]
            k, v = super().update(key_states.half().float(), value_states.half().float(), layer_idx, *args, **kwargs)
            qk, qv = self.sealed.get(layer_idx, (k[..., :0, :], v[..., :0, :]))
            n = k.shape[-2] // block * block
            for s in range(qk.shape[-2], n, block):
                qk = torch.cat([qk, keys(k[..., s : s + block, :])], -2)
                qv = torch.cat([qv, values(v[..., s : s + block, :])], -2)
            self.sealed[layer_idx] = (qk, qv)
            return torch.cat([qk, k[..., n:, :]], -2), torch.cat([qv, v[..., n:, :]], -2)

    return OpenBlock()


def bytes_per_row(scheme: Scheme | None, d: int) -> float:
    """Stored bytes of one K row plus one V row of one head (scales included; KIVI's open block not counted)."""
    if scheme is None:
        return 4.0 * d
    if scheme.kivi:  # keys: a float16 scale and minimum per channel per block; values: one pair per token
        return d / 2 + d * 4 / scheme.block + d / 2 + 4
    groups = d // (scheme.group or d)
    return 2 * (d / 2 + groups * (4 if scheme.mode == "asym" else scheme.scale_bytes))


def _windows(ids: list[int], ctx: int, count: int) -> list[list[int]]:
    out = [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)][:count]
    if len(out) < count:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {count} windows of {ctx}")
    return out


@torch.inference_mode()
def nll(model: Any, make: Any, wins: list[list[int]], batch: int, chunk: int, bar: Bar) -> tuple[float, int]:
    """Summed NLL of the second half of each window, windows fed ``batch`` at a time in chunks of ``chunk``."""
    total, count = 0.0, 0
    for b in range(0, len(wins), batch):
        ids = torch.tensor(wins[b : b + batch])
        cache = make()
        logits = []
        half = ids.shape[1] // 2
        for s in range(0, ids.shape[1], chunk):
            part = ids[:, s : s + chunk]
            # Logits only where a scored token is predicted (the LM head is ~20 % of the forward's work).
            keep = max(1, s + part.shape[1] - (half - 1))
            out = model(input_ids=part, cache=cache, use_cache=True, logits_to_keep=min(keep, part.shape[1]))
            logits.append(out.logits.double())
            bar.update(part.numel())
        lp = torch.log_softmax(torch.cat(logits, 1)[:, -(ids.shape[1] - half) - 1 : -1], -1)
        total -= float(lp.gather(2, ids[:, half:, None]).sum())
        count += ids[:, half:].numel()
    return total, count


@torch.inference_mode()
def reference_tokens(model: Any, prompt: list[int], n: int, head_dim: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` with F16 storage."""
    cache, out = make_cache(None, head_dim), []
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = int(model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.tensor([[nxt]])
    return out


@torch.inference_mode()
def agreement(model: Any, scheme: Any, prompt: list[int], ref: list[int], head_dim: int) -> int:
    """Steps (of ``len(ref)``) at which ``scheme``'s top-1 equals the F16 greedy token, teacher-forced."""
    cache = make_cache(scheme, head_dim)
    if isinstance(scheme, Scheme) and scheme.open_f16:
        # Stepping one token at a time sees at each step what a forward over the tokens up to one before the
        # next seal sees (the open block in F16), then the sealing token alone: two forwards a block, not 16.
        seq, b = prompt + ref[:-1], scheme.block
        picks = [int(model(input_ids=torch.tensor([prompt]), cache=cache).logits[0, -1].argmax())]
        cuts = [n for n in range(len(prompt) + 1, len(seq) + 1) if n % b in (0, b - 1) or n == len(seq)]
        for lo, hi in zip([len(prompt)] + cuts[:-1], cuts, strict=True):
            picks += model(input_ids=torch.tensor([seq[lo:hi]]), cache=cache).logits[0].argmax(-1).tolist()
    else:
        logits = model(input_ids=torch.tensor([prompt + ref[:-1]]), cache=cache).logits[0]
        picks = logits[len(prompt) - 1 :].argmax(-1).tolist()
    return sum(p == r for p, r in zip(picks, ref, strict=True))


def run(
    texts: tuple[str, ...] = DEFAULT_TEXTS,
    ctx: int = 1024,
    windows: int = 12,
    batch: int = 4,
    chunk: int = 256,
    gen_tokens: int = 128,
    prompts: int = 4,
    only: tuple[str, ...] = (),
    model_path: str | None = None,
) -> dict:
    from ..eval import DEFAULT_PROMPTS, read_text
    from ..models import kv_dims, load_model

    model, tokenizer = load_model(model_path, quiet=True)
    _, heads, d = kv_dims(model.config)
    # F16 storage is the agreement's reference (its perplexity is in `int8kv eval`'s table).
    kinds: list[tuple[str, Any]] = [(BASELINE, "fp32")] + [(s.name, s) for s in SCHEMES]
    kinds = [k for k in kinds if not only or k[0] in only]
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct", "head_dim": d, "kv_heads": heads, "ctx": ctx, "windows": windows,
        "chunk": chunk, "threads": torch.get_num_threads(), "gen_tokens": gen_tokens, "texts": {}, "rows": {},
    }
    for path in texts if ctx else ():  # ctx 0: the agreement only
        name = path
        wins = _windows(tokenizer(read_text(None if path == EVAL_CORPUS else path))["input_ids"], ctx, windows)
        result["texts"][name] = {"tokens_fed": sum(map(len, wins)), "scored": 0}
        for kind, scheme in kinds:
            with Bar(f"{name}: {kind}", total=sum(map(len, wins)), unit="tok") as bar:
                start = time.perf_counter()
                total, count = nll(model, lambda s=scheme: make_cache(s, d), wins, batch, chunk, bar)
            row = result["rows"].setdefault(kind, {"ppl": {}, "seconds": {}})
            row["ppl"][name] = math.exp(total / count)
            row["seconds"][name] = time.perf_counter() - start
            result["texts"][name]["scored"] = count
    chosen = DEFAULT_PROMPTS[:prompts]
    refs = [reference_tokens(model, tokenizer(p)["input_ids"], gen_tokens, d) for p in chosen]
    note(f"F16 reference tokens generated for {len(chosen)} prompts")
    for kind, scheme in kinds:
        row = result["rows"].setdefault(kind, {"ppl": {}, "seconds": {}})
        if chosen:
            pairs = zip(chosen, refs, strict=True)
            same = sum(agreement(model, scheme, tokenizer(p)["input_ids"], r, d) for p, r in pairs)
            row["agreement"] = same / (len(chosen) * gen_tokens)
        s = scheme if isinstance(scheme, Scheme) else None
        scale = 2 if scheme == "fp32" else 1
        for dim in (64, 128):
            row[f"bytes_vs_f16_d{dim}"] = scale * bytes_per_row(s, dim) / bytes_per_row(None, dim)
        row["bytes_per_token"] = scale * heads * model.config.num_hidden_layers * bytes_per_row(s, d)
    return with_changes(result)


def with_changes(result: dict) -> dict:
    """``result`` with each row's perplexity change against the float32 baseline, per text."""
    if BASELINE not in result["rows"]:  # a part run without it (see combine)
        return result
    base = result["rows"][BASELINE]["ppl"]
    for row in result["rows"].values():
        row["ppl_change"] = {t: row["ppl"][t] / base[t] - 1 for t in row["ppl"]}
    return result


def combine(parts: list[dict]) -> dict:
    """One result from runs over different texts (the same model and settings), e.g. run in parallel: texts
    and perplexities merged, the agreement taken from the run that measured it."""
    out = parts[0]
    for part in parts[1:]:
        out["texts"].update(part["texts"])
        for kind, row in part["rows"].items():
            mine = out["rows"].setdefault(kind, {"ppl": {}, "seconds": {}})
            mine.update({k: v for k, v in row.items() if k.startswith("bytes")})
            mine["ppl"].update(row["ppl"])
            mine["seconds"].update(row["seconds"])
            if "agreement" in row:
                mine["agreement"] = row["agreement"]
    return with_changes(out)


def report(result: dict) -> str:
    texts = list(result["texts"])
    head = (
        f"{result['model']} (head_dim {result['head_dim']}): windows of {result['ctx']} fed in chunks of "
        f"{result['chunk']}, second half scored; "
        + "; ".join(f"{t}: {v['tokens_fed']} tokens fed, {v['scored']} scored" for t, v in result["texts"].items())
        + f"; agreement with F16 per step over {result['gen_tokens']} tokens; torch threads {result['threads']}"
    )
    cols = "".join(f"{'ppl ' + t[:12]:>20}{'Δ':>9}" for t in texts)
    lines = [head, f"{'cache':<46}{cols}{'agree':>8}{'d64 vs F16':>11}{'d128':>7}"]
    for kind, row in result["rows"].items():
        vals = "".join(
            f"{row['ppl'][t]:>20.4f}{100 * row['ppl_change'][t]:>+8.3f}%" if t in row.get("ppl_change", {})
            else f"{'-':>29}" for t in texts
        )
        agree = f"{100 * row['agreement']:>7.1f}%" if "agreement" in row else f"{'-':>8}"
        lines.append(
            f"{kind:<46}{vals}{agree}{row['bytes_vs_f16_d64']:>11.3f}"
            f"{row['bytes_vs_f16_d128']:>7.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser("kv4", __doc__.split("\n")[0])
    parser.add_argument("--text", action="append", help=f"a text to score (repeatable; {EVAL_CORPUS}: the eval's "
                        f"corpus; default: both of {DEFAULT_TEXTS})")
    parser.add_argument("--ctx", type=int, default=1024, help="tokens per window (0: the agreement only)")
    parser.add_argument("--windows", type=int, default=12, help="windows per text")
    parser.add_argument("--batch", type=int, default=4, help="windows per forward")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward")
    parser.add_argument("--gen-tokens", type=int, default=128, help="greedy steps per prompt")
    parser.add_argument("--prompts", type=int, default=4, help="prompts for the agreement (0: none)")
    parser.add_argument("--only", action="append", default=[], help="run only this candidate (repeatable)")
    parser.add_argument("--model", metavar="PATH", default=None)
    # One thread: on the shared 2-core machine (load 7) two threads ran a 1,024-token prefill 4.6x slower.
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--combine", nargs="+", metavar="JSON", help="only merge the results of earlier runs "
                        "(e.g. one per text, run side by side) into one table")
    args = parser.parse_args(argv)
    if args.combine:
        parts = [json.load(open(p)) for p in args.combine]
        result = combine(parts)
        return emit(result, report(result), args.json)
    if min(args.windows, args.batch, args.chunk, args.gen_tokens) < 1 or min(args.prompts, args.ctx) < 0:
        parser.error("--windows, --batch, --chunk and --gen-tokens must be >= 1, --ctx and --prompts >= 0")
    torch.set_num_threads(max(1, args.threads))
    names = {s.name for s in SCHEMES} | {BASELINE}
    if unknown := [n for n in args.only if n not in names]:
        parser.error(f"unknown candidate(s) {unknown}; known: {sorted(names)}")
    result = run(tuple(args.text) if args.text else DEFAULT_TEXTS, args.ctx, args.windows, args.batch, args.chunk,
                 args.gen_tokens, args.prompts, tuple(args.only), args.model)
    return emit(result, report(result), args.json)


if __name__ == "__main__":
    main()
