"""Token source: tiny shakespeare through tiktoken's gpt2 encoding, random tokens, or a local text file.

DATA=auto uses shakespeare and, when it cannot be had (offline with no copy on disk, no tokenizer),
says so on stderr and falls back to synthetic tokens; the run records which data it used.
"""
import hashlib
import http.client
import os
import sys
import urllib.request
from typing import TYPE_CHECKING

import numpy as np
import torch

from Utils.results.files import write_atomic

if TYPE_CHECKING:
    import tiktoken

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_FILE = "tinyshakespeare.txt"
TOKENS_FILE = "tinyshakespeare.gpt2.npy"
SYNTHETIC_TOKENS = 1 << 20


class DataError(Exception):
    """The requested data cannot be had; the message is one line and names the fix."""


def check_enough_tokens(n_tokens: int, batch_size: int, seq_len: int, world: int = 1, data_name: str = "") -> None:
    """Raise DataError unless n_tokens fill one global batch of `world` processes' B x T windows, each with the
    target after its last token."""
    if n_tokens >= world * batch_size * seq_len + 1:
        return
    processes = f"NPROC={world} x " if world > 1 else ""
    raise DataError(f"{f'DATA={data_name}' if data_name else 'the data'} has {n_tokens:,} tokens, fewer than one "
                    f"batch needs ({processes}BATCH_SIZE={batch_size} x SEQ_LEN={seq_len} + 1): use a smaller "
                    f"BATCH_SIZE or SEQ_LEN{', fewer processes' if world > 1 else ''}, or more text")


def default_data_dir() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.environ.get("DATA_DIR") or os.path.join(repo, "data")


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_shakespeare(data_dir: str, url: str | None = None) -> str:
    """Path to tiny shakespeare in data_dir, downloaded and checked against its sha256 if missing."""
    url = url or os.environ.get("SHAKESPEARE_URL") or SHAKESPEARE_URL
    path = os.path.join(data_dir, SHAKESPEARE_FILE)
    if os.path.exists(path):
        if _sha256(path) != SHAKESPEARE_SHA256:
            raise DataError(f"{path} is not tiny shakespeare (sha256 differs): delete it to download it again")
        return path
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            body = r.read()
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise DataError(f"cannot download tiny shakespeare from {url} ({e}): go online, or put "
                        f"{SHAKESPEARE_FILE} in {data_dir}, or use DATA=synthetic")
    if hashlib.sha256(body).hexdigest() != SHAKESPEARE_SHA256:
        raise DataError(f"the file at {url} is not tiny shakespeare (sha256 differs)")
    try:
        os.makedirs(data_dir, exist_ok=True)
        write_atomic(path, lambda f: f.write(body))
    except OSError as e:
        raise DataError(f"cannot write {path} ({e.strerror}): set DATA_DIR to a folder you can write to")
    return path


def gpt2_encoding() -> "tiktoken.Encoding":
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2")
    except Exception as e:   # offline with no cache raises requests/OS errors of several kinds
        raise DataError(f"tiktoken's gpt2 encoding is not available ({type(e).__name__}): go online once, "
                        f"or set TIKTOKEN_CACHE_DIR to a folder holding its files")


def tokenize(text: str) -> np.ndarray:
    return np.array(gpt2_encoding().encode_ordinary(text), dtype=np.uint16)   # 50257 tokens fit in 16 bits


def shakespeare_tokens(data_dir: str) -> np.ndarray:
    cache = os.path.join(data_dir, TOKENS_FILE)
    if os.path.exists(cache):
        try:
            return np.load(cache)
        except (OSError, ValueError):
            pass   # a damaged cache is rebuilt from the text below
    path = fetch_shakespeare(data_dir)
    with open(path, encoding="utf-8") as f:
        tokens = tokenize(f.read())
    try:
        write_atomic(cache, lambda f: np.save(f, tokens))
    except OSError:
        pass   # a read-only data folder only costs a tokenization next time
    return tokens


def synthetic_tokens(vocab_size: int, seed: int, n: int = SYNTHETIC_TOKENS) -> np.ndarray:
    g = np.random.default_rng(seed)
    return g.integers(0, vocab_size, size=n, dtype=np.int64).astype(np.uint16 if vocab_size <= 65536 else np.int64)


def load_tokens(data: str, vocab_size: int, seed: int, data_dir: str | None = None) -> tuple[np.ndarray, str]:
    """(tokens, name): name is what the run records: shakespeare, synthetic, or the file's path."""
    data_dir = data_dir or default_data_dir()
    if data in ("shakespeare", "auto") and os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise DataError(f"DATA_DIR={data_dir} is a file, not a folder: point DATA_DIR at the folder that holds, "
                        f"or will hold, {SHAKESPEARE_FILE}")
    if data == "synthetic":
        return synthetic_tokens(vocab_size, seed), "synthetic"
    if data == "shakespeare":
        return shakespeare_tokens(data_dir), "shakespeare"
    if data == "auto":
        try:
            return shakespeare_tokens(data_dir), "shakespeare"
        except DataError as e:
            print(f"WARNING: DATA=auto falls back to synthetic tokens: {e}", file=sys.stderr)
            return synthetic_tokens(vocab_size, seed), "synthetic"
    if not os.path.isfile(data):
        raise DataError(f"DATA={data} is not a file: give a text file, or DATA=shakespeare, synthetic or auto")
    try:
        with open(data, encoding="utf-8") as f:
            text = f.read()
    except (UnicodeDecodeError, OSError) as e:
        raise DataError(f"DATA={data} is not a UTF-8 text file ({type(e).__name__}): give a text file") from None
    if "\x00" in text:
        raise DataError(f"DATA={data} holds NUL bytes, so it is not a text file: give a text file")
    if not text.strip():   # said before the tokenizer loads, which offline would be blamed instead
        raise DataError(f"DATA={data} is empty: give a text file with some text in it")
    return tokenize(text), os.path.abspath(data)


class TokenLoader:
    """Sequential (B, T+1) windows over the token stream: row b of a batch holds tokens
    [p + bT, p + bT + T], so inputs are the first T and targets the last T. When fewer than B*T + 1
    tokens remain, the stream starts again from its beginning.

    Among `world` processes, the global batch is `world` x B rows read as one process would read them at
    batch `world` x B, and rank r takes rows rB to (r+1)B - 1: two processes at B see, together and in
    order, the tokens one process sees at 2B."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, pin_memory: bool = False, rank: int = 0,
                 world: int = 1):
        check_enough_tokens(len(tokens), batch_size, seq_len, world)
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        if pin_memory:
            # Pinned once, so every window is a pinned view and its copy to the GPU can be asynchronous.
            self.tokens = self.tokens.pin_memory()
        self.B, self.T = batch_size, seq_len
        self.rank, self.world = rank, world
        self.pos = 0

    def next_batch(self) -> torch.Tensor:
        """This rank's (B*T + 1,) view of the stream; split it with `inputs_targets` once it is on the device."""
        stride = self.world * self.B * self.T
        if self.pos + stride + 1 > len(self.tokens):
            self.pos = 0
        start = self.pos + self.rank * self.B * self.T
        window = self.tokens[start:start + self.B * self.T + 1]
        self.pos += stride
        return window


def inputs_targets(window: torch.Tensor, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = window[:-1].view(batch_size, seq_len)
    y = window[1:].view(batch_size, seq_len)
    return x, y

