"""Server-side tokenization through the `tokenizers` library.

Any tokenizer.json drops in (a real BERT's or GPT-2's); the demo one is a
byte-level BPE trained on generated text, so no input is out of vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from serve_app.errors import InvalidInput
from serve_app.manifest import Manifest

DEFAULT_SPECIAL = {"pad": "<pad>", "eos": "<eos>"}
# Up to this many texts, a batch is tokenized on the calling thread, one text after another.
# The library's `encode_batch` hands a batch to a thread pool of its own: on a few shared cores
# that costs more CPU than it saves time, and its threads run at normal priority even when
# the caller is a replica's background (bulk) lane, taking cores from the router and from
# urgent batches. A large batch (a GPU node's) still spreads over the pool.
SEQUENTIAL_UP_TO = 32


class TextTokenizer:
    """Wraps a tokenizer.json: encodes the way the model's own tokenizer does (its post-processor
    adds the special tokens it was trained with, BERT's [CLS] and [SEP] say), and knows the pad
    and end-of-sequence ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        pad_token: str | None = "<pad>",
        eos_token: str | None = "<eos>",
        max_length: int | None = None,
    ) -> None:
        self._tok = tokenizer
        if max_length is not None:
            # The library's own truncation keeps the post-processor's special tokens within the limit.
            tokenizer.enable_truncation(max_length)
        pad_id = tokenizer.token_to_id(pad_token) if pad_token else None
        eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        if (pad_token and pad_id is None) or (eos_token and eos_id is None):
            raise ValueError(f"the tokenizer's vocabulary lacks its special tokens {pad_token!r} or {eos_token!r}")
        if pad_id is None:
            pad_id = eos_id if eos_id is not None else 0  # pad positions are masked: any id will do
        self.pad_id: int = pad_id
        # -1 when the tokenizer has no end token (a classifier's): no sampled id ever equals it.
        self.eos_id: int = eos_id if eos_id is not None else -1

    @classmethod
    def from_file(
        cls, path: str | Path, pad_token: str | None = "<pad>", eos_token: str | None = "<eos>", max_length: int | None = None
    ) -> TextTokenizer:
        return cls(Tokenizer.from_file(str(path)), pad_token, eos_token, max_length)

    @classmethod
    def for_model(cls, model_dir: str | Path, manifest: Manifest, truncate: bool) -> TextTokenizer:
        """The tokenizer a model directory's manifest names, with its special tokens; `truncate`:
        to the model's maximum length (a classifier's), else a longer text stays whole."""
        if not manifest.tokenizer_file:
            raise ValueError(f"{manifest.name}: the manifest names no tokenizer")
        limit = manifest.max_sequence_length if truncate else None
        return cls.from_file(Path(model_dir) / manifest.tokenizer_file, manifest.pad_token, manifest.eos_token, limit)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        try:
            if len(texts) <= SEQUENTIAL_UP_TO:
                encode = self._tok.encode
                return [encode(text).ids for text in texts]
            return [e.ids for e in self._tok.encode_batch(texts)]
        except TypeError:
            raise not_unicode(texts) or TypeError("texts must be strings") from None

    def encode_rows(self, texts: list[str]) -> list[list[int]]:
        """Ids as a classifier takes them (truncated when the tokenizer was given a maximum
        length); an empty encoding is still one (pad) token, so every row has a position to pool."""
        return [ids or [self.pad_id] for ids in self.encode_batch(texts)]

    def encode(self, text: str) -> list[int]:
        try:
            return self._tok.encode(text).ids
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
