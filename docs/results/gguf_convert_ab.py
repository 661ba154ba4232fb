"""The packaged SmolLM2 GGUF converted to a transformers directory with each GGUF file parsed once (the
loader's `_one_gguf_parse`) and without it (transformers parsing the file at each of its four reads), taking
turns in one process; checks that both give the same bytes.

    PYTHONPATH=src python docs/results/gguf_convert_ab.py [--rounds 2] [OUT.json]
"""

import contextlib
import filecmp
import json
import sys
import tempfile
import time
from pathlib import Path

from int8kv.models import loader


def main() -> None:
    argv = sys.argv[1:]
    rounds = 2
    if argv[:1] == ["--rounds"]:
        rounds, argv = int(argv[1]), argv[2:]
    gguf = loader.default_gguf_path()
    once = loader._one_gguf_parse
    seconds: dict[str, list[float]] = {"parsed once": [], "transformers alone": []}
    with tempfile.TemporaryDirectory() as tmp:
        outs = {}
        for r in range(rounds):
            for name in seconds:
                loader._one_gguf_parse = once if name == "parsed once" else contextlib.nullcontext
                out = Path(tmp) / f"{name.replace(' ', '_')}_{r}"
                out.mkdir()
                start = time.perf_counter()
                loader._convert_gguf(gguf, out)
                seconds[name].append(time.perf_counter() - start)
                print(f"round {r + 1}: {name}: {seconds[name][-1]:.1f} s", flush=True)
                outs.setdefault(name, out)
        loader._one_gguf_parse = once
        a, b = outs.values()
        names = sorted(p.name for p in a.iterdir())
        same = names == sorted(p.name for p in b.iterdir()) and all(
            filecmp.cmp(a / n, b / n, shallow=False) for n in names
        )
    print(f"same files ({', '.join(names)}): {same}")
    if argv:
        Path(argv[0]).write_text(json.dumps({"seconds": seconds, "same_files": same, "files": names}, indent=1) + "\n")
    if not same:
        raise SystemExit("the two conversions differ")


if __name__ == "__main__":
    main()
