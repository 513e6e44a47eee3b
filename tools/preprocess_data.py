"""Tokenise raw text into Megatron-compatible ``.bin``/``.idx`` datasets.

Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod \\
        --workers 8

writes ``data/corpus_text_document.bin`` and ``.idx``; train with
``--data-path data/corpus_text_document``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.config.sections import TOKENIZER_TYPES  # noqa: E402
from megazero.data.preprocess import TEXT_MODES, PreprocessError, preprocess  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, nargs="+",
                   help="JSON lines files (.json/.jsonl), plain text files, or directories")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys of the JSON objects to tokenise, one dataset per key")
    g.add_argument("--text-mode", choices=TEXT_MODES, default="file",
                   help="for plain text files: one document per file, per line, or per "
                        "blank-line-separated paragraph")
    g.add_argument("--skip-invalid", action="store_true",
                   help="skip (and count) malformed lines instead of stopping at the first")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model",
                   help="SentencePiece .model file, a Hugging Face tokenizer.json (or its "
                        "directory) for HuggingFaceTokenizer, a tiktoken .json for "
                        "TikTokenizer")
    g.add_argument("--vocab-file", help="GPT-2 BPE vocab.json")
    g.add_argument("--merge-file", help="GPT-2 BPE merges.txt")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size (TikTokenizer: "
                                                  "the most ids, Megatron's --vocab-size)")
    g.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default="v2",
                   help="TikTokenizer's pre-tokenizer pattern")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer's ids reserved before the vocabulary")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every document")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_{key}_document.bin/.idx")
    g.add_argument("--dtype", choices=["uint16", "int32", "int64"],
                   help="token dtype (default: uint16 when the vocabulary fits, else int32)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenising processes")
    g.add_argument("--chunk-size", type=int, default=64, help="records per worker task")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tokenizer_args = {"tokenizer_type": args.tokenizer_type,
                      "tokenizer_model": args.tokenizer_model, "vocab_file": args.vocab_file,
                      "merge_file": args.merge_file, "vocab_size": args.vocab_size}
    if args.tokenizer_type == "TikTokenizer":
        tokenizer_args.update(tiktoken_pattern=args.tiktoken_pattern,
                              tiktoken_num_special_tokens=args.tiktoken_num_special_tokens)
    if args.workers < 1:
        print("error: --workers must be >= 1", file=sys.stderr)
        return 2
    try:
        stats = preprocess(args.input, args.output_prefix, tokenizer_args,
                           json_keys=args.json_keys, append_eod=args.append_eod,
                           workers=args.workers, skip_invalid=args.skip_invalid,
                           text_mode=args.text_mode, dtype=args.dtype,
                           chunksize=args.chunk_size)
    except (PreprocessError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for prefix in stats.outputs:
        print(f"wrote {prefix}.bin and {prefix}.idx", file=sys.stderr)
    print(f"{stats.documents} documents, {stats.tokens} tokens, "
          f"{stats.skipped_invalid} invalid records skipped, {stats.seconds:.1f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
