from setuptools import find_packages, setup

HF = ["transformers>=4.40", "safetensors", "tokenizers>=0.19", "protobuf"]
# fp8: torchao's float8 utilities, the tests' independent reference for megazero.fp8's scales
# and casts (megazero.fp8 itself is pure PyTorch and runs without it)
FP8 = ["torchao>=0.10"]

setup(
    name="megazero",
    version="0.1.0",
    description=(
        "Pretrain GPT models across many GPUs: tensor, sequence, pipeline and ZeRO data "
        "parallelism with one topology"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megazero", "megazero.*"]),
    py_modules=["pretrain_gpt"],
    install_requires=["torch>=2.11", "numpy", "sentencepiece", "tensorboard", "hjson"],
    # hf: tools/checkpoint/convert.py --loader/--saver hf and examples/finetune_engine.py
    # (protobuf reads SentencePiece models' settings for the tokenizer export)
    extras_require={
        "hf": HF,
        "fp8": FP8,
        "dev": ["pytest>=7", "ruff", "mypy", *HF, *FP8],
    },
    license="Apache-2.0",
)
