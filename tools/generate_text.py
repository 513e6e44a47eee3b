"""Generate text from a megazero checkpoint.

The model (shape, activation, positions, norms, vocabulary) and the tokenizer come from the
checkpoint's saved configuration, as Megatron's ``--use-checkpoint-args``; the tokenizer files
may be pointed elsewhere with ``--tokenizer-model`` / ``--vocab-file`` / ``--merge-file``.

Example::

    python tools/generate_text.py --load ckpt/ --prompt "Once upon a time" --max-new-tokens 40 \\
        --temperature 0.8 --top-p 0.9 --seed 7 --json

A checkpoint saved at any layout (tp, pp, vpp, dp, ZeRO stage) loads: the tool reads the global
tensors and builds the whole model on one pipeline stage, cutting only tensor-parallel slices.

Without ``--temperature``, ``--top-k`` or ``--top-p`` decoding is greedy. Launched with
``torchrun --nproc_per_node T`` the model is split over T tensor-parallel ranks (every rank
computes the same tokens; rank 0 prints).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="generate_text.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (a run's --save)")
    p.add_argument("--iteration", type=int, default=None,
                   help="checkpoint iteration; None: the latest")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text, tokenised with the checkpoint's tokenizer")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens to generate after the prompt (fewer if all reach eod)")
    p.add_argument("--greedy", action="store_true",
                   help="argmax decoding (the default when no sampling flag is given)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (sampling mode; 1.0 when only top-k/p are given)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1.0: off")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--no-stop-at-eod", action="store_true",
                   help="keep generating after the tokenizer's end-of-document token")
    p.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece model to use instead of the saved path")
    p.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json instead of the saved one")
    p.add_argument("--merge-file", default=None, help="GPT-2 merges.txt instead of the saved one")
    p.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="torch.distributed backend under torchrun (default: nccl with GPUs, "
                        "gloo without)")
    p.add_argument("--device", default=None,
                   help="torch device; None: cuda when available, else cpu")
    p.add_argument("--json", action="store_true",
                   help='print {"prompt_ids": [...], "output_ids": [...], "text": "..."}')
    return p


def _tokenizer(config: dict, args: argparse.Namespace, vocab_size: int):
    from megazero.data.tokenizers import build_tokenizer

    data = dict(config.get("data") or {})
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    kind = data.get("tokenizer_type")
    if not kind:
        return None
    return build_tokenizer(kind, tokenizer_model=data.get("tokenizer_model"),
                           vocab_file=data.get("vocab_file"), merge_file=data.get("merge_file"),
                           vocab_size=vocab_size if kind == "NullTokenizer" else None,
                           tiktoken_pattern=data.get("tiktoken_pattern"),
                           tiktoken_num_special_tokens=data.get("tiktoken_num_special_tokens",
                                                                1000))


def _topology(backend: str | None = None):
    """Single process, or (under torchrun) every rank one tensor-parallel slice."""
    import torch

    from megazero.distributed.topology import ParallelTopology

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return ParallelTopology.single(), "cuda" if torch.cuda.is_available() else "cpu"
    from megazero.distributed.startup import initialize_distributed

    env = initialize_distributed(backend)
    return ParallelTopology.build(tp=env.world_size), env.device


def run(args: argparse.Namespace) -> dict:
    """Generate; the result dict is what ``--json`` prints (``text`` decodes ``output_ids``,
    prompt included, or is null without a tokenizer)."""
    import torch

    from megazero.checkpoint import read_model_state
    from megazero.convert import load_global_state, model_config_from_dict
    from megazero.model.generation import SamplingConfig, generate
    from megazero.model.gpt import GPTModel
    from megazero.tensor_parallel import ParallelContext

    sampling_flags = args.temperature is not None or args.top_k > 0 or args.top_p < 1.0
    if args.greedy and sampling_flags:
        raise SystemExit("--greedy and --temperature/--top-k/--top-p exclude each other; "
                         "drop one")
    sampling = SamplingConfig(greedy=not sampling_flags, temperature=args.temperature or 1.0,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    config, state = read_model_state(args.load, args.iteration)
    mc = model_config_from_dict(config)
    tokenizer = _tokenizer(config, args, mc.vocab_size)
    if args.prompt is not None:
        if tokenizer is None:
            raise SystemExit(f"the checkpoint {args.load} names no tokenizer "
                             "(data.tokenizer_type); give --prompt-ids instead of --prompt")
        prompt = tokenizer.tokenize(args.prompt)
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated "
                             "integers such as 1,2,3") from None
    bad = [i for i in prompt if not 0 <= i < mc.vocab_size]
    if bad:
        raise SystemExit(f"prompt ids {bad} are outside the vocabulary of {mc.vocab_size}")
    topo, device = _topology(args.distributed_backend)
    parallel = ParallelContext.from_topology(topo, attention_backend="sdpa")
    model = GPTModel(mc, topo, parallel=parallel).eval()
    load_global_state(model, state, topo)
    model.to(args.device or device)
    eos = None if args.no_stop_at_eod or tokenizer is None else tokenizer.eod
    out = generate(model, torch.tensor([prompt]), args.max_new_tokens, sampling, eos_id=eos)
    ids = out[0].tolist()
    text = tokenizer.detokenize(ids) if tokenizer is not None else None
    return {"prompt_ids": prompt, "output_ids": ids, "text": text}


def main(argv: list[str] | None = None) -> int:
    """Errors megazero raises on purpose (a missing or damaged checkpoint, a wrong flag) are one
    ``generate_text.py: error: ...`` line and exit status 2, as in ``pretrain_gpt.py`` and
    ``convert.py`` (``MEGAZERO_DEBUG=1`` adds the traceback)."""
    import torch.distributed as dist

    from megazero.distributed.startup import destroy
    from megazero.errors import expected_errors, report_error

    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except expected_errors() as e:
        return report_error(e, "generate_text.py")
    if dist.is_initialized():
        rank = dist.get_rank()
        destroy(orderly=True)  # every rank finished the same generation
        if rank != 0:
            return 0
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"] if result["text"] is not None else
              " ".join(map(str, result["output_ids"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
