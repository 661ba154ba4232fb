"""Quality of each KV storage against a float32 cache: perplexity, greedy agreement, bytes per token.

Perplexity follows llama.cpp's tool: the text is cut into windows of `ctx` tokens, each window is fed
through a fresh cache in chunks (each chunk's K/V written first, then attended, so every attention reads
the stored format), and only the second half of each window is scored, so every scored token sees at
least ctx/2 tokens of context.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .cli_common import legend
from .errors import KvCacheError
from .formats import KvStorageFormat
from .models.config import kv_dims
from .progress import Stages

DEFAULT_TEXT_GLOB = "/usr/share/common-licenses/*"
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue.",
    "List three uses of a paperclip:",
)


class TextError(KvCacheError, ValueError):
    """The evaluation text is missing, empty or not text."""


@dataclass
class CacheKind:
    name: str
    make: Callable[[object], object]  # model config -> a fresh transformers Cache
    bytes_per_token: Callable[[object], float]  # model config -> KV bytes per token, all layers


@dataclass
class EvalRow:
    cache: str
    perplexity: float
    ppl_change_vs_baseline: float  # relative, e.g. 0.001 = +0.1 %
    kv_bytes_per_token: float
    bytes_vs_f16: float
    greedy_agreement: float  # fraction of generated positions equal to the baseline's
    greedy_common_prefix: float  # mean number of leading tokens equal to the baseline's


def cache_kinds(include_fp8: bool = False, formats: list | tuple | None = None) -> list[CacheKind]:
    """The float32 baseline, an :class:`~int8kv.hf.Int8KvCache` per format of ``formats`` (names or objects,
    :func:`int8kv.hf.cache.resolve_format`: the 4-bit ``int4_kchan64_vtok_asym_sink4_win64_v1`` too; default:
    the :class:`KvStorageFormat` members that are not stateful, F16 and INT8) and, with ``include_fp8``,
    transformers' fp8 QuantizedCache."""
    from transformers import DynamicCache, QuantizedCache

    from .hf import Int8KvCache
    from .hf.cache import resolve_format

    def per_elem(nbytes: float) -> Callable[[object], float]:
        return lambda cfg: 2 * math.prod(kv_dims(cfg)) * nbytes

    def ours(fmt) -> CacheKind:
        return CacheKind(
            f"int8kv {fmt.value.split('_')[0]}",
            lambda cfg: Int8KvCache(cfg, format=fmt),
            lambda cfg: fmt.bytes_per_token(*kv_dims(cfg)),
        )

    kinds = [
        CacheKind("DynamicCache fp32 (baseline)", lambda cfg: DynamicCache(), per_elem(4)),
        *(ours(resolve_format(fmt)) for fmt in (
            [f for f in KvStorageFormat if not f.is_stateful] if formats is None else formats)),
    ]
    if include_fp8:
        # transformers' fp8 backend: one float8_e4m3 scale per layer tensor, frozen after the first update.
        kinds.append(CacheKind("QuantizedCache fp8", lambda cfg: QuantizedCache("fp8", cfg), per_elem(1)))
    return kinds


def read_text(path: str | None) -> str:
    if path is None:
        files = sorted(p for p in glob.glob(DEFAULT_TEXT_GLOB) if os.path.isfile(p))
        if not files:
            raise TextError(f"no default text: nothing matches {DEFAULT_TEXT_GLOB}; pass --text FILE")
        return "\n\n".join(open(p, encoding="utf-8", errors="replace").read() for p in files)
    try:
        raw = open(path, "rb").read()
    except OSError as exc:
        raise TextError(f"cannot read text file {path!r}: {exc.strerror}") from None
    if b"\x00" in raw:
        raise TextError(f"{path!r} is not a text file (it holds NUL bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TextError(f"{path!r} is not UTF-8 text") from None
    if not text.strip():
        raise TextError(f"{path!r} is empty")
    return text


MIN_CTX = 4  # shortest window: half of it is context, half is scored


def windows(ids: list[int], ctx: int, max_windows: int) -> list[list[int]]:
    if ctx < MIN_CTX:
        raise ValueError(f"--ctx must be at least {MIN_CTX}, got {ctx}")
    out = [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)][:max_windows]
    if not out:
        raise TextError(f"the text has {len(ids)} tokens, fewer than one window of {ctx}")
    return out


@torch.inference_mode()
def window_nll(model, kind: CacheKind, window: list[int], chunk: int, bar: Stages | None = None) -> tuple[float, int]:
    cache = kind.make(model.config)
    logits = []
    for start in range(0, len(window), chunk):
        ids = torch.tensor([window[start : start + chunk]])
        logits.append(model(input_ids=ids, cache=cache, use_cache=True).logits[0].double())
        if bar is not None:
            bar.update(ids.shape[1])
    half = len(window) // 2
    lp = torch.log_softmax(torch.cat(logits)[half - 1 : -1], dim=-1)
    target = torch.tensor(window[half:])
    return float(-lp.gather(1, target[:, None]).sum()), len(target)


@torch.inference_mode()
def greedy(model, tokenizer, kind: CacheKind, prompt: str, new_tokens: int, bar: Stages | None = None) -> list[int]:
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(
        **inputs, cache=kind.make(model.config), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=tokenizer.eos_token_id, streamer=None if bar is None else _Counter(bar),
    )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


class _Counter:
    """A transformers streamer that counts the generated tokens on the progress line (its first `put` is the
    prompt)."""

    def __init__(self, bar: Stages) -> None:
        self.bar, self.prompt_seen = bar, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.bar.update(value.numel())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    same = sum(x == y for x, y in zip(a, b, strict=False)) / max(1, len(b))
    prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return same, prefix


def evaluate(
    model,
    tokenizer,
    text: str,
    ctx: int = 512,
    chunk: int = 128,
    max_windows: int = 8,
    gen_tokens: int = 32,
    prompts: tuple[str, ...] = DEFAULT_PROMPTS,
    kinds: list[CacheKind] | None = None,
) -> dict:
    kinds = kinds or cache_kinds()
    ids = tokenizer(text)["input_ids"]
    wins = windows(ids, ctx, max_windows)
    nll: dict[str, float] = {}
    generated: dict[str, list[list[int]]] = {}
    scored = 0
    # Each cache generates first: the short greedy stage times one kind of token, the first chunks of
    # perplexity the other, so the estimate of the time left comes a few seconds into the run.
    stages = []
    for kind in kinds:
        if prompts:
            stages.append((f"{kind.name}: greedy", "greedy", len(prompts) * gen_tokens))
        stages.append((f"{kind.name}: perplexity", "perplexity", sum(map(len, wins))))
    per_kind = len(stages) // len(kinds)
    with Stages("eval", stages) as bar:
        for i, kind in enumerate(kinds):
            if prompts:
                bar.begin(i * per_kind)
            generated[kind.name] = [greedy(model, tokenizer, kind, p, gen_tokens, bar) for p in prompts]
            bar.begin(i * per_kind + per_kind - 1)
            total, scored = 0.0, 0
            for w in wins:
                s, n = window_nll(model, kind, w, chunk, bar)
                total, scored = total + s, scored + n
            nll[kind.name] = total / scored
    base = kinds[0].name
    f16_bytes = KvStorageFormat.F16.bytes_per_token(*kv_dims(model.config))
    rows = []
    for kind in kinds:
        ppl = math.exp(nll[kind.name])
        pairs = [agreement(g, b) for g, b in zip(generated[kind.name], generated[base], strict=True)]
        per_token = kind.bytes_per_token(model.config)
        rows.append(
            EvalRow(
                cache=kind.name,
                perplexity=ppl,
                ppl_change_vs_baseline=ppl / math.exp(nll[base]) - 1,
                kv_bytes_per_token=per_token,
                bytes_vs_f16=per_token / f16_bytes,
                greedy_agreement=sum(p[0] for p in pairs) / len(pairs) if pairs else math.nan,
                greedy_common_prefix=sum(p[1] for p in pairs) / len(pairs) if pairs else math.nan,
            )
        )
    return {
        "ctx": ctx, "chunk": chunk, "windows": len(wins), "scored_tokens": scored,
        "gen_tokens": gen_tokens, "prompts": list(prompts), "rows": [asdict(r) for r in rows],
    }


def format_eval(result: dict) -> str:
    """The table of an `evaluate` result, with a legend under it that says what each column measures."""
    prompts = len(result["prompts"])
    greedy = f"greedy agreement over {result['gen_tokens']} tokens x {prompts} prompts" if prompts else "no greedy run"
    head = (
        f"perplexity over {result['scored_tokens']} scored tokens ({result['windows']} windows of {result['ctx']}, "
        f"chunks of {result['chunk']}); {greedy}"
    )
    header = f"{'cache':<30}{'ppl':>9}{'Δppl':>9}{'KV B/tok':>10}{'vs F16':>8}"
    columns = {
        "cache": f"the KV cache the model ran with; the first row ({result['rows'][0]['cache']}) is the reference "
                 "every other row is compared with",
        "ppl": "perplexity of the scored tokens (the exponential of their mean negative log-likelihood); lower "
               "is better",
        "Δppl": "perplexity change against the reference, in percent: the prediction quality this way of storing "
                "K/V loses (0: none; +0.2 % means 0.2 % higher perplexity)",
        "KV B/tok": "bytes of K and V stored per token, all layers together",
        "vs F16": "those bytes over F16 storage's (0.531: 53.1 % of F16's memory)",
    }  # fmt: skip
    if prompts:
        header += f"{'agree':>7}{'prefix':>8}"
        columns["agree"] = ("share of the greedily generated tokens equal to the reference's token at the same "
                            "position, over every prompt (100 %: the same text; once a token differs, the texts "
                            "usually part ways)")
        columns["prefix"] = (f"tokens generated, on average over the prompts, before the first one that differs "
                             f"from the reference's (out of {result['gen_tokens']}; higher is better)")
    lines = [head, header]
    for r in result["rows"]:
        lines.append(
            f"{r['cache']:<30}{r['perplexity']:>9.4f}{100 * r['ppl_change_vs_baseline']:>+8.3f}%"
            f"{r['kv_bytes_per_token']:>10.0f}{r['bytes_vs_f16']:>8.3f}"
            + (f"{100 * r['greedy_agreement']:>6.1f}%{r['greedy_common_prefix']:>8.1f}" if prompts else "")
        )
    return "\n".join(lines) + "\n\n" + legend(columns)
