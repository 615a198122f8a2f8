"""Utils/train/data.py: the loader's windows, the tokenizer on real tiny shakespeare, the download and its
checks, the token cache, the DATA=auto fallback, synthetic tokens and local text files. Nothing here
reaches the network: downloads come from file:// URLs and data folders live under tmp_path."""
import os
import pathlib
import shutil
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import Utils.train.data as data  # noqa: E402
from Utils.train.data import (  # noqa: E402
    SHAKESPEARE_FILE, SHAKESPEARE_SHA256, SYNTHETIC_TOKENS, TOKENS_FILE, DataError, TokenLoader,
    default_data_dir, fetch_shakespeare, gpt2_encoding, inputs_targets, load_tokens, shakespeare_tokens,
    synthetic_tokens, tokenize)

SHAKESPEARE_GPT2_TOKENS = 338_025   # encode_ordinary of the whole file
VOCAB = 50257


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No test reaches the network or the repository's data/ by accident: the default URL is
    unreachable and the default data folder is a fresh one. Tests that need others set them."""
    monkeypatch.setenv("SHAKESPEARE_URL", (tmp_path / "no-such-dir" / "input.txt").as_uri())
    monkeypatch.setenv("DATA_DIR", str(tmp_path / "default-data"))


@pytest.fixture
def shakespeare_url(monkeypatch, shakespeare_path):
    """SHAKESPEARE_URL pointing at the local copy through a file:// URL; the URL."""
    url = pathlib.Path(shakespeare_path).resolve().as_uri()
    monkeypatch.setenv("SHAKESPEARE_URL", url)
    return url


@pytest.fixture
def data_dir_with_copy(tmp_path, shakespeare_path):
    """A data folder holding a copy of tiny shakespeare, as after a download."""
    d = tmp_path / "data"
    d.mkdir()
    shutil.copyfile(shakespeare_path, d / SHAKESPEARE_FILE)
    return d


def read_text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


# --------------------------------------------------------------------------------------------- TokenLoader


def test_loader_windows_are_contiguous_and_advance_by_a_batch():
    B, T = 3, 5
    tokens = np.arange(10 * B * T + 1, dtype=np.uint16)
    loader = TokenLoader(tokens, B, T)
    assert loader.tokens.dtype == torch.int64
    for b in range(4):
        start = b * B * T
        assert loader.pos == start
        window = loader.next_batch()
        assert window.shape == (B * T + 1,)
        assert window.dtype == torch.int64
        assert window.tolist() == list(range(start, start + B * T + 1))
        x, y = inputs_targets(window, B, T)
        for row in range(B):
            # Row r of the batch holds the run of text [start + rT, start + rT + T], split in x and y.
            first = start + row * T
            assert x[row].tolist() == list(range(first, first + T))
            assert y[row].tolist() == list(range(first + 1, first + T + 1))
        assert loader.pos == start + B * T
    # The next batch starts with the token the last one's final target was.
    assert loader.next_batch()[0].item() == 4 * B * T


def test_loader_window_is_a_view_of_the_stream():
    loader = TokenLoader(np.arange(100, dtype=np.uint16), 2, 4)
    loader.next_batch()
    window = loader.next_batch()
    assert window.untyped_storage().data_ptr() == loader.tokens.untyped_storage().data_ptr()
    assert window.data_ptr() == loader.tokens[8:].data_ptr()


# With B*T = 12: 3*12 + 1 tokens hold three batches exactly, 3*12 only two (the third lacks its last
# target), and 4*12 still three.
@pytest.mark.parametrize("n, batches_before_wrap", [(37, 3), (36, 2), (41, 3), (48, 3), (49, 4)])
def test_loader_wraps_when_fewer_than_a_batch_plus_one_remain(n, batches_before_wrap):
    B, T = 3, 4
    loader = TokenLoader(np.arange(n, dtype=np.uint16), B, T)
    starts = [loader.next_batch()[0].item() for _ in range(batches_before_wrap + 2)]
    expected = [b * B * T for b in range(batches_before_wrap)] + [0, B * T]
    assert starts == expected
    # Every window, before and after the wrap, is a full contiguous run inside the data.
    loader = TokenLoader(np.arange(n, dtype=np.uint16), B, T)
    for _ in range(3 * (batches_before_wrap + 1)):
        w = loader.next_batch().tolist()
        assert len(w) == B * T + 1 and w == list(range(w[0], w[0] + B * T + 1)) and w[-1] < n


def test_loader_with_exactly_one_batch_repeats_it():
    B, T = 2, 8
    tokens = np.arange(B * T + 1, dtype=np.uint16)
    loader = TokenLoader(tokens, B, T)
    for _ in range(3):
        assert loader.next_batch().tolist() == tokens.tolist()


@pytest.mark.parametrize("n", [0, 1, 2 * 8])
def test_loader_rejects_data_shorter_than_one_batch(n):
    with pytest.raises(DataError, match="BATCH_SIZE") as err:
        TokenLoader(np.arange(n, dtype=np.uint16), 2, 8)
    assert f"has {n:,} tokens" in str(err.value) and "BATCH_SIZE=2 x SEQ_LEN=8 + 1" in str(err.value)


def test_inputs_targets_shapes_and_values():
    B, T = 4, 6
    window = torch.arange(100, 100 + B * T + 1)
    x, y = inputs_targets(window, B, T)
    assert x.shape == y.shape == (B, T)
    assert x.dtype == y.dtype == window.dtype
    assert torch.equal(x.flatten(), window[:-1])
    assert torch.equal(y.flatten(), window[1:])
    assert torch.equal(y[:, :-1], x[:, 1:])          # y is x shifted by one...
    assert torch.equal(y[:-1, -1], x[1:, 0])         # ...and each row's last target opens the next row
    assert x[0, 0].item() == 100 and y[-1, -1].item() == 100 + B * T


# ------------------------------------------------------------------------------------ tokenizer and file


def test_tokenizer_round_trips_real_shakespeare(tiktoken_cache, shakespeare_path):
    text = read_text(shakespeare_path)
    enc = gpt2_encoding()
    assert enc.n_vocab == VOCAB <= np.iinfo(np.uint16).max + 1
    tokens = tokenize(text)
    assert tokens.dtype == np.uint16
    assert len(tokens) == SHAKESPEARE_GPT2_TOKENS
    # The narrowing to 16 bits lost nothing: the same ids as the encoder's own.
    assert np.array_equal(tokens.astype(np.int64), np.array(enc.encode_ordinary(text), dtype=np.int64))
    assert int(tokens.max()) < VOCAB
    assert enc.decode(tokens.tolist()) == text


def test_gpt2_encoding_failure_is_a_data_error(monkeypatch):
    import tiktoken

    def unavailable(name):
        raise ConnectionError("offline")

    monkeypatch.setattr(tiktoken, "get_encoding", unavailable)
    with pytest.raises(DataError, match="TIKTOKEN_CACHE_DIR") as err:
        gpt2_encoding()
    assert "ConnectionError" in str(err.value)


# ---------------------------------------------------------------------------------------------- download


def test_fetch_downloads_checks_and_writes_the_file(tmp_path, shakespeare_url, shakespeare_path):
    d = tmp_path / "data"    # does not exist yet
    path = fetch_shakespeare(str(d))
    assert path == os.path.join(str(d), SHAKESPEARE_FILE)
    with open(path, "rb") as got, open(shakespeare_path, "rb") as want:
        assert got.read() == want.read()
    assert data._sha256(path) == SHAKESPEARE_SHA256
    assert os.listdir(d) == [SHAKESPEARE_FILE]
    # A second call checks the file there and does not download again.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHAKESPEARE_URL", (tmp_path / "gone.txt").as_uri())
        assert fetch_shakespeare(str(d)) == path


def test_fetch_url_argument_wins_over_the_environment(tmp_path, shakespeare_path):
    d = tmp_path / "data"
    url = pathlib.Path(shakespeare_path).resolve().as_uri()
    assert fetch_shakespeare(str(d), url=url) == os.path.join(str(d), SHAKESPEARE_FILE)


def test_fetch_rejects_content_with_the_wrong_sha256(tmp_path, monkeypatch):
    fake = tmp_path / "fake.txt"
    fake.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    monkeypatch.setenv("SHAKESPEARE_URL", fake.as_uri())
    d = tmp_path / "data"
    with pytest.raises(DataError, match="sha256") as err:
        fetch_shakespeare(str(d))
    assert fake.as_uri() in str(err.value)
    assert not os.path.exists(d) or os.listdir(d) == []    # neither the file nor a temporary one is left


def test_fetch_unreachable_url_is_a_data_error_naming_the_fixes(tmp_path, monkeypatch):
    monkeypatch.setenv("SHAKESPEARE_URL", "file:///nonexistent/tinyshakespeare.txt")
    d = tmp_path / "data"
    with pytest.raises(DataError) as err:
        fetch_shakespeare(str(d))
    message = str(err.value)
    assert "file:///nonexistent/tinyshakespeare.txt" in message
    assert SHAKESPEARE_FILE in message and str(d) in message and "DATA=synthetic" in message
    assert not d.exists()   # a failed download leaves nothing behind, not even the folder


def test_fetch_refuses_a_wrong_file_already_in_the_data_dir(tmp_path, shakespeare_url):
    d = tmp_path / "data"
    d.mkdir()
    wrong = d / SHAKESPEARE_FILE
    wrong.write_text("not tiny shakespeare\n")
    with pytest.raises(DataError, match="delete") as err:
        fetch_shakespeare(str(d))
    assert str(wrong) in str(err.value)
    assert wrong.read_text() == "not tiny shakespeare\n"    # reported, not replaced


# ------------------------------------------------------------------------------------------- token cache


def test_shakespeare_tokens_are_cached_in_the_data_dir(tiktoken_cache, data_dir_with_copy, monkeypatch):
    d = str(data_dir_with_copy)
    first = shakespeare_tokens(d)
    assert first.dtype == np.uint16 and len(first) == SHAKESPEARE_GPT2_TOKENS
    assert np.array_equal(first, tokenize(read_text(os.path.join(d, SHAKESPEARE_FILE))))
    assert sorted(os.listdir(d)) == sorted([SHAKESPEARE_FILE, TOKENS_FILE])

    # The second call reads neither the text nor the tokenizer.
    os.remove(os.path.join(d, SHAKESPEARE_FILE))

    def no_tokenizer():
        raise DataError("the tokenizer was used")

    monkeypatch.setattr(data, "gpt2_encoding", no_tokenizer)
    second = shakespeare_tokens(d)
    assert second.dtype == np.uint16
    assert np.array_equal(second, first)
    assert load_tokens("shakespeare", VOCAB, 0, data_dir=d)[1] == "shakespeare"


def test_shakespeare_tokens_download_into_an_empty_data_dir(tiktoken_cache, tmp_path, shakespeare_url):
    d = tmp_path / "data"
    tokens, name = load_tokens("shakespeare", VOCAB, 0, data_dir=str(d))
    assert name == "shakespeare"
    assert len(tokens) == SHAKESPEARE_GPT2_TOKENS
    assert sorted(os.listdir(d)) == sorted([SHAKESPEARE_FILE, TOKENS_FILE])


# ------------------------------------------------------------------------------------------ DATA=auto


def test_auto_falls_back_to_synthetic_when_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHAKESPEARE_URL", "file:///nonexistent")
    d = tmp_path / "data"
    d.mkdir()
    tokens, name = load_tokens("auto", 1000, 7, data_dir=str(d))
    assert name == "synthetic"
    assert np.array_equal(tokens, synthetic_tokens(1000, 7))
    err = capsys.readouterr().err
    assert err.startswith("WARNING: DATA=auto falls back to synthetic tokens")
    assert "file:///nonexistent" in err
    assert not os.path.exists(d / SHAKESPEARE_FILE)


def test_shakespeare_raises_when_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHAKESPEARE_URL", "file:///nonexistent")
    d = tmp_path / "data"
    d.mkdir()
    with pytest.raises(DataError, match="cannot download tiny shakespeare"):
        load_tokens("shakespeare", 1000, 7, data_dir=str(d))
    assert capsys.readouterr().err == ""


def test_auto_falls_back_when_the_tokenizer_fails(data_dir_with_copy, monkeypatch, capsys):
    def unavailable():
        raise DataError("tiktoken's gpt2 encoding is not available (ConnectionError)")

    monkeypatch.setattr(data, "gpt2_encoding", unavailable)
    d = str(data_dir_with_copy)
    tokens, name = load_tokens("auto", VOCAB, 3, data_dir=d)
    assert name == "synthetic"
    assert np.array_equal(tokens, synthetic_tokens(VOCAB, 3))
    assert "WARNING" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(d, TOKENS_FILE))
    with pytest.raises(DataError, match="gpt2 encoding"):
        load_tokens("shakespeare", VOCAB, 3, data_dir=d)


def test_auto_uses_shakespeare_when_it_can(tiktoken_cache, data_dir_with_copy, capsys):
    tokens, name = load_tokens("auto", VOCAB, 0, data_dir=str(data_dir_with_copy))
    assert name == "shakespeare" and len(tokens) == SHAKESPEARE_GPT2_TOKENS
    assert capsys.readouterr().err == ""


def test_data_dir_defaults_to_DATA_DIR(tmp_path, monkeypatch, repo_root, shakespeare_url):
    d = tmp_path / "from-env"
    monkeypatch.setenv("DATA_DIR", str(d))
    assert default_data_dir() == str(d)
    fetch_shakespeare(default_data_dir())
    assert os.listdir(d) == [SHAKESPEARE_FILE]
    monkeypatch.delenv("DATA_DIR")
    assert default_data_dir() == os.path.join(repo_root, "data")


# --------------------------------------------------------------------------------------------- synthetic


def test_synthetic_tokens_are_deterministic_and_in_range():
    a, b = synthetic_tokens(VOCAB, 0), synthetic_tokens(VOCAB, 0)
    assert np.array_equal(a, b)
    assert len(a) == SYNTHETIC_TOKENS and a.dtype == np.uint16
    assert int(a.min()) >= 0 and int(a.max()) < VOCAB
    assert len(np.unique(a)) > VOCAB * 0.99      # spread over the vocabulary, not a constant
    c = synthetic_tokens(VOCAB, 1)
    assert not np.array_equal(a, c) and np.mean(a == c) < 0.01


@pytest.mark.parametrize("vocab_size, dtype", [(5, np.uint16), (65536, np.uint16), (70000, np.int64)])
def test_synthetic_tokens_dtype_fits_the_vocabulary(vocab_size, dtype):
    t = synthetic_tokens(vocab_size, 3, n=50_000)
    assert t.dtype == dtype and len(t) == 50_000
    assert int(t.min()) >= 0 and int(t.max()) < vocab_size
    assert int(t.max()) > 0.9 * (vocab_size - 1)
    if vocab_size > 65536:
        assert int(t.max()) >= 65536    # no id wrapped around 16 bits


def test_load_tokens_synthetic():
    tokens, name = load_tokens("synthetic", 97, 5)
    assert name == "synthetic"
    assert np.array_equal(tokens, synthetic_tokens(97, 5))
    assert not os.path.exists(os.environ["DATA_DIR"])    # nothing is written for synthetic data


# ---------------------------------------------------------------------------------------- local text file


def test_load_tokens_from_a_local_text_file(tiktoken_cache, tmp_path, monkeypatch):
    # Special tokens' text is ordinary text in a data file.
    text = "To be, or not to be: that is the question.\nCafé — naïve façade.\n<|endoftext|>\n"
    (tmp_path / "sample.txt").write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    tokens, name = load_tokens("sample.txt", VOCAB, 0, data_dir=str(tmp_path / "data"))
    assert name == str(tmp_path / "sample.txt") and os.path.isabs(name)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == gpt2_encoding().encode_ordinary(text)
    assert gpt2_encoding().eot_token not in tokens.tolist()
    assert gpt2_encoding().decode(tokens.tolist()) == text


def test_load_tokens_missing_file_is_a_data_error(tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(DataError, match="is not a file") as err:
        load_tokens(str(missing), VOCAB, 0, data_dir=str(tmp_path))
    assert str(missing) in str(err.value)
    with pytest.raises(DataError):
        load_tokens(str(tmp_path), VOCAB, 0, data_dir=str(tmp_path))    # a folder is not a file either


def test_an_unwritable_data_dir_is_a_data_error(tmp_path, monkeypatch, shakespeare_path):
    import pathlib
    monkeypatch.setenv("SHAKESPEARE_URL", pathlib.Path(shakespeare_path).as_uri())
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(DataError, match="set DATA_DIR to a folder you can write to"):
        fetch_shakespeare(str(blocker / "data"))


@pytest.mark.parametrize("text", ["", " \n\n"])
def test_an_empty_text_file_is_named_before_the_tokenizer_loads(tmp_path, monkeypatch, text):
    def offline():
        raise DataError("tiktoken's gpt2 encoding is not available (ConnectionError)")
    monkeypatch.setattr(data, "gpt2_encoding", offline)   # offline: the empty file must still be what is named
    empty = tmp_path / "empty.txt"
    empty.write_text(text)
    with pytest.raises(DataError) as err:
        load_tokens(str(empty), VOCAB, 0, data_dir=str(tmp_path))
    assert str(err.value) == f"DATA={empty} is empty: give a text file with some text in it"


@pytest.mark.parametrize("kind", ["shakespeare", "auto"])
def test_a_data_dir_that_is_a_file_is_named_as_such(tmp_path, kind, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(DataError) as err:
        load_tokens(kind, VOCAB, 0, data_dir=str(blocker))
    assert str(err.value).startswith(f"DATA_DIR={blocker} is a file, not a folder")
    assert blocker.read_text() == "x" and "falls back" not in capsys.readouterr().err
