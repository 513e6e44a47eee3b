"""The default demo corpus: Python's own standard library, tokenized on the spot.

``pretrain_gpt.py`` with no ``--data-path`` and no ``--mock-data`` trains on this corpus, so a
fresh clone can run a real (if small) pretraining without downloading anything. The corpus is a
fixed, sorted list of pure-Python modules of the running interpreter's standard library (a few
MB; modules missing from a Python version are skipped). A SentencePiece BPE tokenizer is trained
on part of it and the whole corpus is written as a Megatron ``.bin``/``.idx`` dataset.

The tokenizer keeps every character (:func:`megazero.data.tokenizers.sentencepiece_text_options`:
newlines, indentation and runs of spaces survive, so the model can write code that runs).
Everything lands in a cache directory keyed by the Python version, the file list, the vocabulary
size and the tokenizer's text options, so the second run starts at once and a change of
tokenizer settings builds a new corpus instead of reusing ids made by the old tokenizer. The
directory is built under a temporary name and renamed into place, so concurrent launchers (one
per node) never see half a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

# Relative to the stdlib directory; for modules that became packages the package file follows.
DEMO_MODULES: tuple[str, ...] = (
    "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py", "cmd.py", "code.py",
    "codecs.py", "collections/__init__.py", "configparser.py", "contextlib.py", "copy.py",
    "csv.py", "dataclasses.py", "datetime.py", "difflib.py", "dis.py", "email/message.py",
    "enum.py", "fnmatch.py", "fractions.py", "ftplib.py", "functools.py", "getopt.py",
    "gettext.py", "glob.py", "gzip.py", "hashlib.py", "heapq.py", "hmac.py", "imaplib.py",
    "inspect.py", "ipaddress.py", "json/decoder.py", "json/encoder.py", "locale.py",
    "logging/__init__.py", "logging/handlers.py", "mailbox.py", "mimetypes.py", "ntpath.py",
    "numbers.py", "operator.py", "optparse.py", "os.py", "pathlib.py", "pathlib/_local.py",
    "pdb.py", "pickle.py", "pkgutil.py", "platform.py", "plistlib.py", "poplib.py",
    "posixpath.py", "pprint.py", "queue.py", "random.py", "re/_parser.py", "selectors.py",
    "shlex.py", "shutil.py", "smtplib.py", "socket.py", "socketserver.py", "statistics.py",
    "string.py", "subprocess.py", "tarfile.py", "tempfile.py", "textwrap.py", "threading.py",
    "timeit.py", "tokenize.py", "trace.py", "traceback.py", "typing.py", "unittest/case.py",
    "urllib/parse.py", "urllib/request.py", "uuid.py", "warnings.py", "wave.py", "weakref.py",
    "zipfile.py", "zipfile/__init__.py",
)
DEFAULT_VOCAB_SIZE = 2048
TOKENIZER_TRAIN_BYTES = 1_500_000  # enough text for a 2k BPE vocabulary, trained in seconds
_FORMAT = 2  # bump when the cache contents change (2: whitespace-keeping tokenizer)


@dataclass(frozen=True)
class DemoData:
    data_prefix: str  # pass as --data-path
    tokenizer_model: str  # SentencePiece .model
    num_files: int
    num_bytes: int


def demo_files() -> list[str]:
    """Absolute paths of the corpus files present in this interpreter, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    paths = [os.path.join(root, rel) for rel in sorted(DEMO_MODULES)]
    return [p for p in paths if os.path.isfile(p)]


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megazero", "demo")


def _cache_key(files: list[str], vocab_size: int) -> str:
    from megazero.data.tokenizers import sentencepiece_text_options

    h = hashlib.sha256()
    h.update(json.dumps([_FORMAT, sys.version_info[:2], vocab_size,
                         sentencepiece_text_options()], sort_keys=True).encode())
    for f in files:
        h.update(os.path.basename(f).encode())
        h.update(str(os.path.getsize(f)).encode())
    return f"py{sys.version_info[0]}{sys.version_info[1]}-v{vocab_size}-{h.hexdigest()[:12]}"


def _tokenizer_texts(files: list[str], budget: int) -> Iterator[str]:
    """The first files of the corpus, about ``budget`` characters (the trainer cuts them into
    lines itself)."""
    used = 0
    for path in files:
        text = open(path, encoding="utf-8", errors="replace").read()
        used += len(text)
        yield text
        if used >= budget:
            return


def _paths(directory: str) -> DemoData:
    meta = json.loads(open(os.path.join(directory, "demo.json"), encoding="utf-8").read())
    return DemoData(os.path.join(directory, "stdlib_text_document"),
                    os.path.join(directory, "tokenizer.model"), meta["files"], meta["bytes"])


def prepare_demo_data(cache_dir: str | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                      log=print) -> DemoData:
    """Build (or reuse) the demo dataset and tokenizer; returns where they are."""
    from megazero.data.preprocess import preprocess
    from megazero.data.tokenizers import train_sentencepiece

    files = demo_files()
    if not files:
        raise RuntimeError(f"no demo corpus files found under {sysconfig.get_paths()['stdlib']}; "
                           "pass --data-path (or --mock-data) instead")
    root = cache_dir or default_cache_dir()
    final = os.path.join(root, _cache_key(files, vocab_size))
    if os.path.isfile(os.path.join(final, "demo.json")):
        return _paths(final)
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".building-", dir=root)
    try:
        nbytes = sum(os.path.getsize(f) for f in files)
        log(f"> building the demo corpus: {len(files)} standard-library modules "
            f"({nbytes / 1e6:.1f} MB) -> {final}")
        model = train_sentencepiece(_tokenizer_texts(files, TOKENIZER_TRAIN_BYTES),
                                    os.path.join(work, "tokenizer"), vocab_size,
                                    max_sentence_length=8192)
        stats = preprocess(files, os.path.join(work, "stdlib"),
                           {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": model},
                           append_eod=True, text_mode="file")
        log(f"> demo corpus: {stats.documents} documents, {stats.tokens} tokens, "
            f"vocabulary {vocab_size}")
        with open(os.path.join(work, "demo.json"), "w", encoding="utf-8") as f:
            json.dump({"files": len(files), "bytes": nbytes, "tokens": stats.tokens,
                       "modules": [os.path.relpath(p, sysconfig.get_paths()["stdlib"])
                                   for p in files]}, f, indent=1)
        try:
            os.rename(work, final)
        except OSError:  # another launcher finished first; its copy is identical
            if not os.path.isfile(os.path.join(final, "demo.json")):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _paths(final)
