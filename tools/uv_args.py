"""Print the package-index options of pip's configuration as `uv pip install` flags.

uv does not read pip's configuration files or PIP_* variables; the Makefile installs with uv (8 s against pip's
58-63 s for the same packages on the 2-core dev VM) and passes it the indexes, find-links and constraints pip
would use, so both resolve against the same registries. `--index-strategy unsafe-best-match` is pip's rule
(the best version across every index), not uv's default (the first index that has the package), under which
the two installs differed in 40 packages.
"""

import shlex
import subprocess
import sys

# pip config list names each value by its source; later sources override earlier ones, as in pip.
RANK = {"global": 0, "user": 1, "site": 2, "": 3}  # "" : the PIP_* environment (":env:")
FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def main() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    best: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        name, _, value = line.partition("=")
        source, _, key = name.rpartition(".")
        rank = RANK[""] if name.startswith(":env:") else RANK.get(source)
        if key in FLAGS and rank is not None and rank >= best.get(key, (-1, ""))[0]:
            best[key] = (rank, value.strip().strip("'\""))
    args = ["--index-strategy", "unsafe-best-match"]
    for key, (_, value) in best.items():
        for item in value.split():
            args += [FLAGS[key], item]
    print(shlex.join(args))


if __name__ == "__main__":
    main()
