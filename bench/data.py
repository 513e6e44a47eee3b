"""Data pipeline benchmark: tokenising throughput and GPT index building on a large corpus.

    python bench/data.py [--index-tokens 50000000] [--tokenize-docs 20000] [--seq-length 2048]

1. Preprocessing: a synthetic JSON lines corpus (pseudo-words drawn from a Zipf law) tokenised
   with a SentencePiece BPE model trained on it, with 1 and 2 workers.
2. Index building: a synthetic ``.bin``/``.idx`` of ``--index-tokens`` tokens (log-normal
   document lengths) written with the builder, then the document, sample and shuffle indices of
   a GPTDataset built for one and for three epochs, the cached reload, a 1M-sample blending
   index, and random sample reads. Everything is written to a temporary directory that is
   deleted afterwards.

Prints a table and writes ``bench/results/data.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megazero.data.blended_dataset import build_blending_indices  # noqa: E402
from megazero.data.gpt_dataset import GPTDataset  # noqa: E402
from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from megazero.data.preprocess import Progress, preprocess  # noqa: E402
from megazero.data.sample_index import (  # noqa: E402
    build_document_index,
    build_sample_index,
    build_shuffle_index,
)
from megazero.data.tokenizers import train_sentencepiece  # noqa: E402


def synthetic_texts(n_docs: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, int(rng.integers(2, 10)))) for _ in range(5000)]
    ranks = np.arange(1, len(words) + 1)
    probs = (1.0 / ranks) / np.sum(1.0 / ranks)
    texts = []
    for _ in range(n_docs):
        n = int(rng.integers(50, 400))
        texts.append(" ".join(np.asarray(words)[rng.choice(len(words), n, p=probs)]) + ".")
    return texts


def bench_tokenize(tmp: str, n_docs: int, vocab_size: int) -> list[dict]:
    texts = synthetic_texts(n_docs)
    src = os.path.join(tmp, "corpus.jsonl")
    with open(src, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    t0 = time.perf_counter()
    model = train_sentencepiece(texts[:2000], os.path.join(tmp, "sp"), vocab_size,
                                num_threads=os.cpu_count() or 1)
    train_s = time.perf_counter() - t0
    rows = []
    for workers in (1, 2):
        cpu0 = time.process_time() + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        load0 = os.getloadavg()[0]
        stats = preprocess([src], os.path.join(tmp, f"tok{workers}"),
                           {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": model},
                           append_eod=True, workers=workers, progress=Progress(io.StringIO()))
        # pool workers are reaped when the pool closes, so RUSAGE_CHILDREN now includes them
        cpu = time.process_time() + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - cpu0
        rows.append({"workers": workers, "documents": stats.documents, "tokens": stats.tokens,
                     "input_mb": stats.input_bytes / 1e6, "seconds": stats.seconds,
                     "tokens_per_s": stats.tokens / stats.seconds,
                     "docs_per_s": stats.documents / stats.seconds,
                     "mb_per_s": stats.input_bytes / 1e6 / stats.seconds,
                     "cpu_s": cpu, "tokens_per_cpu_s": stats.tokens / cpu,
                     "load_average_before": load0,
                     "tokenizer_train_s": train_s, "vocab_size": vocab_size})
    return rows


class Timings(dict):
    """Wall-clock seconds under ``NAME_s`` and this process's CPU seconds under ``NAME_cpu_s``.

    CPU time is reported too because a shared machine can stretch wall time many-fold.
    """

    def run(self, name: str, fn, *args, **kwargs):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args, **kwargs)
        self[f"{name}_s"] = time.perf_counter() - w0
        self[f"{name}_cpu_s"] = time.process_time() - c0
        return out


def bench_index(tmp: str, n_tokens: int, seq_length: int) -> dict:
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(mean=6.0, sigma=1.0, size=4 * n_tokens // 400))
    lengths = lengths.astype(np.int64)
    cum = np.cumsum(lengths)
    lengths = lengths[: int(np.searchsorted(cum, n_tokens)) + 1]
    lengths[-1] -= int(lengths.sum() - n_tokens)
    lengths = lengths[lengths > 0]
    prefix = os.path.join(tmp, "big_text_document")
    res = Timings(tokens=n_tokens, seq_length=seq_length)

    def write() -> None:
        tokens = rng.integers(0, 32000, n_tokens, dtype=np.uint16)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        with IndexedDatasetBuilder(prefix, np.uint16) as b:
            for i in range(len(lengths)):
                b.add_document(tokens[bounds[i]:bounds[i + 1]])
            b.finalize()

    res.run("write", write)
    ds = res.run("open", IndexedDataset, prefix)
    res["documents"] = int(ds.num_documents)
    docs = np.arange(ds.num_documents)
    for e in (1, 3):
        r = np.random.RandomState(1234)
        doc_idx = res.run(f"document_index_{e}ep", build_document_index, docs, e, r)
        sample_idx = res.run(f"sample_index_{e}ep", build_sample_index, ds.sequence_lengths,
                             doc_idx, seq_length)
        n = sample_idx.shape[0] - 1
        res.run(f"shuffle_index_{e}ep", build_shuffle_index, n, n, r)
        res[f"samples_{e}ep"] = n
    # many short samples: the sample index of 3 epochs at seq_length 128 (~1.2M rows for 50M)
    r = np.random.RandomState(1234)
    doc_idx = build_document_index(docs, 3, r)
    short = res.run("sample_index_3ep_seq128", build_sample_index, ds.sequence_lengths, doc_idx,
                    128)
    res["samples_3ep_seq128"] = short.shape[0] - 1
    res.run("shuffle_index_3ep_seq128", build_shuffle_index, len(short) - 1, len(short) - 1, r)
    num_samples = 3 * ((n_tokens - 1) // seq_length) - 10
    cache = os.path.join(tmp, "cache")
    doc_range = (0, ds.num_documents)
    gpt = res.run("gpt_dataset_build", GPTDataset, ds, doc_range, seq_length, num_samples,
                  cache_dir=cache, is_builder=True)
    assert gpt.built_anew
    again = res.run("gpt_dataset_cached_load", GPTDataset, ds, doc_range, seq_length,
                    num_samples, cache_dir=cache, is_builder=True)
    assert not again.built_anew
    res.run("blend_1m_samples", build_blending_indices, [0.2, 0.3, 0.5], 1_000_000)
    picks = np.random.default_rng(1).integers(0, len(gpt), 2000)
    t0 = time.perf_counter()
    for i in picks:
        gpt[int(i)]
    res["random_samples_per_s"] = len(picks) / (time.perf_counter() - t0)
    return dict(res)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index-tokens", type=int, default=50_000_000)
    p.add_argument("--tokenize-docs", type=int, default=20_000)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "data.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="megazero-bench-data-") as tmp:
        tok_rows = bench_tokenize(tmp, args.tokenize_docs, args.vocab_size)
    with tempfile.TemporaryDirectory(prefix="megazero-bench-data-") as tmp:
        idx = bench_index(tmp, args.index_tokens, args.seq_length)

    print("\nPreprocessing (SentencePiece BPE, vocab "
          f"{args.vocab_size}, synthetic JSON lines, --append-eod)")
    print(f"{'workers':>7} {'docs':>8} {'tokens':>10} {'MB':>7} {'wall s':>7} {'tokens/s':>10} "
          f"{'docs/s':>8} {'MB/s':>6} {'CPU s':>7} {'tokens/CPU s':>12} {'load':>5}")
    for r in tok_rows:
        print(f"{r['workers']:>7} {r['documents']:>8} {r['tokens']:>10} {r['input_mb']:>7.1f} "
              f"{r['seconds']:>7.2f} {r['tokens_per_s']:>10.0f} {r['docs_per_s']:>8.0f} "
              f"{r['mb_per_s']:>6.2f} {r['cpu_s']:>7.2f} {r['tokens_per_cpu_s']:>12.0f} "
              f"{r['load_average_before']:>5.1f}")
    print(f"\nIndex building: {idx['tokens'] / 1e6:.0f}M tokens, {idx['documents']} documents, "
          f"seq_length {idx['seq_length']}")
    rows = [("write .bin/.idx (builder, incl. random tokens)", "write"),
            ("open IndexedDataset (validates)", "open")]
    for e in (1, 3):
        rows += [(f"document index, {e} epoch(s)", f"document_index_{e}ep"),
                 (f"sample index, {e} epoch(s), {idx[f'samples_{e}ep']} samples",
                  f"sample_index_{e}ep"),
                 (f"shuffle index, {e} epoch(s)", f"shuffle_index_{e}ep")]
    rows += [(f"sample index, 3 epochs, seq 128, {idx['samples_3ep_seq128']} samples",
              "sample_index_3ep_seq128"),
             ("shuffle index, 3 epochs, seq 128", "shuffle_index_3ep_seq128"),
             ("GPTDataset build + save to cache, 3 epochs", "gpt_dataset_build"),
             ("GPTDataset cached load", "gpt_dataset_cached_load"),
             ("blending index, 3 datasets, 1M samples", "blend_1m_samples")]
    print(f"  {'step':<52} {'wall s':>8} {'CPU s':>8}")
    for name, key in rows:
        print(f"  {name:<52} {idx[key + '_s']:8.3f} {idx[key + '_cpu_s']:8.3f}")
    print(f"  {'random sample reads':<52} {idx['random_samples_per_s']:8.0f} /s")
    result = {"machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(),
                          "python": platform.python_version(),
                          "numpy": np.__version__, "platform": platform.platform()},
              "preprocess": tok_rows, "index": idx}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
