"""What the server tests share: a tiny random Llama with a word-level tokenizer saved to a directory (built
offline in a second), a live `int8kv serve` process on a free loopback port, stopped by its own pid, and an app
served in this process by uvicorn on a thread (for tests that hand the server a component of their own)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from int8kv.server.launch import LocalServer, read_metric
from int8kv.server.launch import http_get as get
from int8kv.server.run import bind

__all__ = ["ServerProcess", "get", "in_process", "make_tiny_model", "metric", "read_reply"]

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


metric = read_metric  # one unlabelled sample from /metrics
ServerProcess = LocalServer  # the server under test: `int8kv serve` as a child on a free loopback port


@contextlib.contextmanager
def in_process(app, timeout: float = 60.0) -> Iterator[str]:
    """Serve `app` on a free loopback port from a thread of this process; yields its base URL. Stopped (the
    lifespan's shutdown included) when the block ends."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def read_reply(sock: socket.socket) -> tuple[str, dict]:
    """(status line, JSON body) of one HTTP response read from a raw socket (the body by its Content-Length)."""
    reply = b""
    while True:
        head, sep, body = reply.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        if sep and len(body) >= length:
            return head.split(b"\r\n")[0].decode(), json.loads(body[:length])
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {reply!r}"
        reply += chunk
