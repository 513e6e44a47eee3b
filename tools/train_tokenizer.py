"""Train a SentencePiece BPE tokenizer on raw text, for ``--tokenizer-type SentencePieceTokenizer``.

Example::

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix tok --vocab-size 32000

writes ``tok.model`` and ``tok.vocab``. Inputs are read like ``tools/preprocess_data.py`` reads
them (JSON lines with ``--json-keys``, plain text files, directories).

Every character survives ``decode(encode(text))`` by default (Llama's settings): no Unicode
normalisation (``--normalization identity``), newlines, tabs and runs of spaces kept, digits split,
whitespace-only pieces allowed, and byte fallback for characters outside the vocabulary.
SentencePiece's own default, which folds whitespace and applies NFKC (lossy: code loses its line
breaks), is ``--normalization nmt_nfkc --remove-extra-whitespaces``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.data.preprocess import (  # noqa: E402
    TEXT_MODES,
    PreprocessError,
    iter_records,
    list_input_files,
    record_texts,
)
from megazero.data.tokenizers import (  # noqa: E402
    NORMALIZATION_RULES,
    train_sentencepiece,
)


def iter_texts(inputs: Sequence[str], json_keys: Sequence[str], text_mode: str,
               max_documents: int | None) -> Iterator[str]:
    """Document texts from the inputs; invalid records raise with their file and line."""
    n = 0
    for rec in iter_records(list_input_files(inputs), text_mode):
        yield from record_texts(rec, json_keys).values()
        n += 1
        if max_documents is not None and n >= max_documents:
            return


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog=doc[-1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", required=True, nargs="+",
                   help="JSON lines files (.json/.jsonl), plain text files, or directories")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000, help="pieces in the vocabulary")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys of the JSON objects whose text is trained on")
    p.add_argument("--text-mode", choices=TEXT_MODES, default="file",
                   help="for plain text files: one document per file, line or paragraph")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                   help="SentencePiece model type")
    p.add_argument("--character-coverage", type=float, default=1.0,
                   help="share of characters covered by the vocabulary (rest: byte fallback)")
    p.add_argument("--normalization", choices=NORMALIZATION_RULES, default="identity",
                   help="SentencePiece normalization rule: identity keeps every character as "
                   "written; nmt_nfkc/nfkc apply NFKC ('½' -> '1⁄2', 'ﬁ' -> 'fi'), the nmt_ "
                   "rules also turn tabs and newlines into spaces")
    p.add_argument("--remove-extra-whitespaces", action="store_true",
                   help="fold newlines, tabs and runs of spaces into one space and strip "
                   "leading/trailing spaces (SentencePiece's default, lossy; off: kept)")
    p.add_argument("--max-documents", type=int, default=None,
                   help="train on the first N documents only")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="SentencePiece trainer threads")
    args = p.parse_args(argv)
    try:
        model = train_sentencepiece(
            iter_texts(args.input, args.json_keys, args.text_mode, args.max_documents),
            args.output_prefix, args.vocab_size, model_type=args.model_type,
            character_coverage=args.character_coverage, num_threads=args.threads,
            normalization=args.normalization,
            remove_extra_whitespaces=args.remove_extra_whitespaces)
    except (PreprocessError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {model}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
