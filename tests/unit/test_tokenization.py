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
