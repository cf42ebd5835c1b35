import pytest

from serve_app.errors import InvalidInput
from serve_app.tokenization import TextTokenizer, train_byte_level_bpe
from serve_app.zoo import data


def test_byte_level_tokenizer_roundtrips_any_text(tmp_path):
    tok = train_byte_level_bpe(data.sentiment_dataset(500, 0)[0], 300, tmp_path / "tokenizer.json")
    for text in ["the food was great", "Ünïcode ☃ and emoji 😀", ""]:
        assert tok.decode(tok.encode(text)) == text


def test_tokenizer_file_drops_in(tmp_path):
    train_byte_level_bpe(["a b c"], 280, tmp_path / "tokenizer.json")
    tok = TextTokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.pad_id != tok.eos_id
    assert tok.vocab_size <= 280


def test_encode_rows_cuts_long_texts_and_keeps_a_token_for_empty_ones(tmp_path):
    train_byte_level_bpe(data.sentiment_dataset(200, 0)[0], 300, tmp_path / "tokenizer.json")
    whole = TextTokenizer.from_file(tmp_path / "tokenizer.json")
    tok = TextTokenizer.from_file(tmp_path / "tokenizer.json", max_length=16)
    long_text = " ".join(["xyzzy"] * 200)
    long_ids, empty_ids, short_ids = tok.encode_rows([long_text, "", "ok"])
    assert long_ids == whole.encode(long_text)[:16]
    assert empty_ids == [tok.pad_id]
    assert short_ids == tok.encode("ok")


def test_a_text_that_is_not_unicode_is_the_callers_400_naming_it(tmp_path):
    # A lone surrogate: Python's JSON parser makes one from the escape "\ud800"; the tokenizer refuses it.
    tok = train_byte_level_bpe(["a b c"], 280, tmp_path / "tokenizer.json")
    with pytest.raises(InvalidInput, match="text 1 is not valid Unicode"):
        tok.encode_batch(["fine", "a\ud800b"])
    with pytest.raises(InvalidInput, match="text 0 is not valid Unicode"):
        tok.encode("\udfff")
    with pytest.raises(TypeError):  # not text at all: the caller's check is missing, not the client's fault
        tok.encode_batch([b"bytes"])  # type: ignore[list-item]


def test_a_small_batch_on_the_callers_thread_and_a_large_one_on_the_pool_give_the_same_ids(tmp_path):
    from serve_app.tokenization import SEQUENTIAL_UP_TO

    texts = data.sentiment_dataset(2 * SEQUENTIAL_UP_TO, 0)[0]
    tok = train_byte_level_bpe(texts, 300, tmp_path / "tokenizer.json")
    small, large = tok.encode_batch(texts[:SEQUENTIAL_UP_TO]), tok.encode_batch(texts)
    assert small == large[:SEQUENTIAL_UP_TO] == [tok.encode(t) for t in texts[:SEQUENTIAL_UP_TO]]
    with pytest.raises(InvalidInput, match=f"text {SEQUENTIAL_UP_TO} is not valid Unicode"):
        tok.encode_batch([*texts[:SEQUENTIAL_UP_TO], "a\ud800b"])  # past the threshold: the pool's path
