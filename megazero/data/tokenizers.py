"""Tokenizers behind one small interface, plus SentencePiece training.

Every tokenizer has ``vocab_size``, ``eod`` (the end-of-document id appended between documents),
``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``. Type names follow Megatron's
``--tokenizer-type`` values.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Protocol

from megazero.data.gpt2_bpe import GPT2BPETokenizer
from megazero.data.tiktoken_bpe import TikTokenizer

__all__ = [
    "Tokenizer",
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
    "GPT2BPETokenizer",
    "TikTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "build_tokenizer",
    "train_sentencepiece",
    "sentencepiece_text_options",
    "NORMALIZATION_RULES",
    "TOKENIZER_TYPES",
]


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


class SentencePieceTokenizer:
    """A SentencePiece model; the end-of-document token is the model's ``</s>`` (eos) piece."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece as spm

        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"SentencePiece model file {model_file!r} not found "
                                    "(pass --tokenizer-model PATH.model)")
        self.model_file = model_file
        self._sp = spm.SentencePieceProcessor(model_file=model_file)
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(f"SentencePiece model {model_file!r} has no eos piece to use as the "
                             "end-of-document token; train it with eos_id >= 0")
        self._eod = int(eos)

    @property
    def vocab_size(self) -> int:
        return int(self._sp.vocab_size())

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's ``Llama2Tokenizer``: Llama 2's SentencePiece model, every text starting with
    the model's ``<s>`` (bos) id, documents ending with ``</s>`` (eos, the end-of-document
    token); the vocabulary is the model's, with no extra ids."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        bos = self._sp.bos_id()
        if bos < 0:
            raise ValueError(f"SentencePiece model {model_file!r} has no bos piece, which "
                             "Llama2Tokenizer puts before every text; use "
                             "SentencePieceTokenizer")
        self._bos = int(bos)

    @property
    def bos(self) -> int:
        return self._bos

    def tokenize(self, text: str) -> list[int]:
        return [self._bos, *super().tokenize(text)]


class HuggingFaceTokenizer:
    """A Hugging Face fast tokenizer read from a local ``tokenizer.json`` (or the directory
    holding it) with the ``tokenizers`` library: no download, no ``transformers`` needed.

    The end-of-document token is the first of the usual end markers the vocabulary has
    (``<|endoftext|>`` GPT-2/NeoX, ``</s>`` Llama 2/T5, ``<|end_of_text|>`` Llama 3, ``<eos>``).
    """

    EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"Hugging Face tokenizer {file!r} not found (pass "
                                    "--tokenizer-model PATH/tokenizer.json or its directory)")
        self.model_file = file
        self._tok = _HFTokenizer.from_file(file)
        ids = [self._tok.token_to_id(t) for t in self.EOD_TOKENS]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"Hugging Face tokenizer {file!r} has none of the end-of-document "
                             f"tokens {', '.join(self.EOD_TOKENS)}; add one to its vocabulary")
        self._eod = int(found[0])

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class NullTokenizer:
    """Megatron's tokenizer for mock data: text is whitespace-separated integer ids.

    The last id, ``vocab_size - 1``, is the end-of-document token.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"NullTokenizer needs vocab_size >= 2, got {vocab_size}")
        self._vocab_size = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        ids = [int(t) for t in text.split()]
        for i in ids:
            if not 0 <= i < self._vocab_size:
                raise ValueError(f"token id {i} outside vocabulary of {self._vocab_size}")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "GPT2BPETokenizer", "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer")


def build_tokenizer(tokenizer_type: str, *, tokenizer_model: str | None = None,
                    vocab_file: str | None = None, merge_file: str | None = None,
                    vocab_size: int | None = None, tiktoken_pattern: str | None = None,
                    tiktoken_num_special_tokens: int = 1000) -> Tokenizer:
    """Build a tokenizer from Megatron-style arguments; errors name the missing flag."""
    # Megatron's GPTSentencePieceTokenizer also uses the model's eos as end of document.
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                          "Llama2Tokenizer"):
        if not tokenizer_model:
            raise ValueError(f"{tokenizer_type} needs --tokenizer-model")
        if tokenizer_type == "Llama2Tokenizer":
            return Llama2Tokenizer(tokenizer_model)
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        if not tokenizer_model:
            raise ValueError("TikTokenizer needs --tokenizer-model (its vocabulary, a .json "
                             "list of ranks)")
        return TikTokenizer(tokenizer_model, tiktoken_pattern or "v2",
                            tiktoken_num_special_tokens, vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise ValueError("GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file "
                             "(merges.txt)")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json file "
                             "or the directory holding it)")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; choose one of {TOKENIZER_TYPES}")


#: SentencePiece normalisation rules (``normalization_rule_name``); ``identity`` keeps text as is.
NORMALIZATION_RULES = ("identity", "nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf")


def sentencepiece_text_options(normalization: str = "identity",
                               remove_extra_whitespaces: bool = False) -> dict[str, object]:
    """The trainer options that decide what text survives ``decode(encode(text))``.

    The default is Llama's: ``identity`` normalisation (no NFKC: ``'½'`` stays ``'½'``), runs of
    spaces and leading/trailing spaces kept (``remove_extra_whitespaces=False``), whitespace-only
    pieces allowed (indentation becomes a few tokens), digits split one per piece, a dummy
    ``▁`` prefix, and byte fallback: a character outside the vocabulary (a newline, an emoji)
    becomes its UTF-8 bytes ``<0x..>`` instead of ``<unk>``. Then every string round-trips.
    SentencePiece's own default (``nmt_nfkc`` plus ``remove_extra_whitespaces``) folds newlines,
    tabs and runs of spaces into one space and applies NFKC; it is available only on request.
    """
    if normalization not in NORMALIZATION_RULES:
        raise ValueError(f"unknown SentencePiece normalization {normalization!r}; choose one of "
                         f"{', '.join(NORMALIZATION_RULES)}")
    return dict(normalization_rule_name=normalization,
                remove_extra_whitespaces=bool(remove_extra_whitespaces), add_dummy_prefix=True,
                split_digits=True, allow_whitespace_only_pieces=True, byte_fallback=True)


def _training_lines(text: str, keep_whitespace: bool) -> Iterable[str]:
    """SentencePiece trains on lines: a document is cut at its newlines (the newline itself is
    encoded by byte fallback), keeping each line's spaces and tabs. With ``keep_whitespace``
    off (the old, lossy setting) the document becomes one line with whitespace folded."""
    if not keep_whitespace:
        line = " ".join(text.split())
        return [line] if line else []
    return [line for line in text.split("\n") if line.strip()]


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int,
                        model_type: str = "bpe", character_coverage: float = 1.0,
                        max_sentence_length: int = 16384, num_threads: int = 1,
                        seed_sentencepiece_size: int = 100_000, normalization: str = "identity",
                        remove_extra_whitespaces: bool = False) -> str:
    """Train a SentencePiece model on an iterable of documents; returns the ``.model`` path.

    Text options: :func:`sentencepiece_text_options` (by default every character survives
    ``decode(encode(text))``: newlines, tabs, runs of spaces, accents, emoji). Documents are
    written to a temporary file one line per line (SentencePiece trains on lines; lines longer
    than ``max_sentence_length`` bytes are skipped by it). Ids: 0 ``<unk>``, 1 ``<s>``, 2
    ``</s>`` (the end-of-document token), no padding id.
    """
    import sentencepiece as spm

    options = sentencepiece_text_options(normalization, remove_extra_whitespaces)
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(prefix="spm-train-", suffix=".txt")
    n_lines = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for text in texts:
                for line in _training_lines(text, not remove_extra_whitespaces):
                    f.write(line + "\n")
                    n_lines += 1
        if n_lines == 0:
            raise ValueError("cannot train a tokenizer on an empty corpus (no non-blank text)")
        spm.SentencePieceTrainer.train(
            input=tmp_path, model_prefix=model_prefix, vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            max_sentence_length=max_sentence_length, num_threads=num_threads,
            seed_sentencepiece_size=seed_sentencepiece_size, hard_vocab_limit=True,
            minloglevel=2, **options,
        )
    finally:
        os.remove(tmp_path)
    return model_prefix + ".model"
