"""What the server tests share: a tiny random Llama with a word-level tokenizer saved to a directory (built
offline in a second), and a live `int8kv serve` process on a free loopback port, stopped by its own pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parents[1] / "src"
WORDS = (
    "the a of to and in is it that was for on are with as his they be at one have this from or had by hot "
    "word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two "
    "has look more day could go come did number sound no most people my over know water than call first who "
    "may down side been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form sentence great think"
).split()
SPECIAL = ["<unk>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
EOS_ID = 1
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_model(path: Path, max_positions: int = 4096, seed: int = 0) -> Path:
    """A 2-layer random Llama (hidden 64, 4 query / 2 KV heads) and a whitespace word-level tokenizer with a
    chat template, saved as a transformers directory that `int8kv.models.load_model` reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2,
        vocab_size=len(vocab), max_position_embeddings=max_positions, eos_token_id=EOS_ID, bos_token_id=None,
        pad_token_id=None, rope_theta=10000.0, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).eval().save_pretrained(path)
    fast.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(base: str, name: str) -> float:
    """One unlabelled sample from /metrics."""
    _, text = get(base + "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


class ServerProcess:
    """`python -m int8kv.cli serve ...` on 127.0.0.1:<free port>; `url` is its base, `stop()` sends SIGTERM."""

    def __init__(self, *args: str, startup_timeout: float = 180.0, log_path: Path | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.log_path = log_path
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "int8kv.cli", "serve", "--port", str(self.port), "--quiet", *args],
            env=env, stdout=self.log, stderr=self.log,
        )
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode} during start-up:\n{self.output()}")
            try:
                if get(self.base + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"server not ready within {startup_timeout} s:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; SIGKILL only if it does not exit in time. Returns the exit status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_log()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self.log is not subprocess.DEVNULL and not self.log.closed:
            self.log.close()
