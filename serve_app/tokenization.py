"""Server-side tokenization through the `tokenizers` library.

Any tokenizer.json drops in (a real BERT's or GPT-2's); the demo one is a
byte-level BPE trained on generated text, so no input is out of vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from serve_app.errors import InvalidInput

DEFAULT_SPECIAL = {"pad": "<pad>", "eos": "<eos>"}
# Up to this many texts, a batch is tokenized on the calling thread, one text after another.
# The library's `encode_batch` hands a batch to a thread pool of its own: on a few shared cores
# that costs more CPU than it saves time, and its threads run at normal priority even when
# the caller is a replica's background (bulk) lane, taking cores from the router and from
# urgent batches. A large batch (a GPU node's) still spreads over the pool.
SEQUENTIAL_UP_TO = 32


class TextTokenizer:
    """Wraps a tokenizer.json; knows the pad and end-of-sequence ids."""

    def __init__(self, tokenizer: Tokenizer, pad_token: str = "<pad>", eos_token: str = "<eos>") -> None:
        self._tok = tokenizer
        pad_id = tokenizer.token_to_id(pad_token)
        eos_id = tokenizer.token_to_id(eos_token)
        if pad_id is None or eos_id is None:
            raise ValueError(f"tokenizer lacks {pad_token!r} or {eos_token!r} special tokens")
        self.pad_id: int = pad_id
        self.eos_id: int = eos_id

    @classmethod
    def from_file(cls, path: str | Path, pad_token: str = "<pad>", eos_token: str = "<eos>") -> TextTokenizer:
        return cls(Tokenizer.from_file(str(path)), pad_token, eos_token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        try:
            if len(texts) <= SEQUENTIAL_UP_TO:
                encode = self._tok.encode
                return [encode(text, add_special_tokens=False).ids for text in texts]
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        except TypeError:
            raise not_unicode(texts) or TypeError("texts must be strings") from None

    def encode_truncated(self, texts: list[str], max_len: int) -> list[list[int]]:
        """Ids as a classifier takes them: cut to `max_len` like BERT tokenizers do, and an
        empty text still one (pad) token, so every row has a position to pool."""
        return [ids[:max_len] or [self.pad_id] for ids in self.encode_batch(texts)]

    def encode(self, text: str) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:
            raise not_unicode([text]) or TypeError("text must be a string") from None

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def not_unicode(texts: list[str]) -> InvalidInput | None:
    """The 400 for the first text that is not valid Unicode, if any: a lone surrogate, which
    Python's JSON parser (and so Starlette's) accepts from an escape such as "\\ud800", and which
    the tokenizer refuses with a TypeError."""
    for i, text in enumerate(texts):
        if not isinstance(text, str):  # not text at all: the caller's type check is missing
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return InvalidInput(f"text {i} is not valid Unicode ({e.reason} at character {e.start})")
    return None


def train_byte_level_bpe(texts: list[str], vocab_size: int, path: str | Path) -> TextTokenizer:
    """Train the demo byte-level BPE tokenizer and save it as tokenizer.json."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(DEFAULT_SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return TextTokenizer(tok)
