"""Data pipeline: Megatron-compatible indexed datasets, GPT samples, blending, sampling.

Importing this package does not import torch (preprocessing workers start faster); the
torch-facing helpers in :mod:`megazero.data.builder` are loaded on first use.
"""

from megazero.data.blended_dataset import (
    BlendedDataset,
    build_blending_indices,
    parse_data_path,
)
from megazero.data.gpt_dataset import GPTDataset
from megazero.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexFormatError,
    optimal_dtype,
)
from megazero.data.mock_dataset import MockGPTDataset
from megazero.data.sampler import MegatronPretrainingSampler
from megazero.data.split import split_document_ranges
from megazero.data.tokenizers import (
    GPT2BPETokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    train_sentencepiece,
)

_LAZY = {"DataConfig", "build_train_valid_test_datasets", "build_data_iterator",
         "train_valid_test_num_samples"}


def __getattr__(name: str):
    if name in _LAZY:
        from megazero.data import builder

        return getattr(builder, name)
    raise AttributeError(f"module 'megazero.data' has no attribute {name!r}")


__all__ = [
    "BlendedDataset",
    "DataConfig",
    "GPT2BPETokenizer",
    "GPTDataset",
    "IndexFormatError",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronPretrainingSampler",
    "MockGPTDataset",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "build_blending_indices",
    "build_data_iterator",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "optimal_dtype",
    "parse_data_path",
    "split_document_ranges",
    "train_sentencepiece",
    "train_valid_test_num_samples",
]
