"""Generation: greedy ids equal transformers' ``generate(do_sample=False)`` on the imported
model; the KV-cache path equals the full forward (logits to 1e-5 relative, sampled ids exactly);
tp=2 generates the ids of tp=1."""

import pytest
import torch

from megazero.convert import hf_to_megazero, load_global_state
from megazero.distributed.topology import ParallelTopology
from megazero.model.generation import (
    KVCache,
    SamplingConfig,
    forward_full,
    forward_with_cache,
    generate,
    sample,
)
from megazero.model.gpt import GPTModel
from megazero.testing import run_distributed
from megazero.testing.hf_models import VOCAB, build

KINDS = {"gpt2": dict(initializer_range=0.3), "llama": dict(initializer_range=0.1)}
PROMPT = [[5, 17, 42, 8, 99, 3], [1, 2, 3, 4, 5, 6]]


def imported(kind):
    hf = build(kind, seed=11, **KINDS[kind])
    mc, state = hf_to_megazero(hf.config.to_dict(), hf.state_dict())
    topo = ParallelTopology.single()
    model = GPTModel(mc, topo).eval()
    load_global_state(model, state, topo)
    return hf, mc, state, model


@pytest.fixture(scope="module", params=list(KINDS))
def models(request):
    return request.param, *imported(request.param)


def test_greedy_matches_transformers_generate(models):
    kind, hf, _, _, model = models
    prompt = torch.tensor(PROMPT)
    hf.generation_config.eos_token_id = None  # run the full length on both sides
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=12)
    got = generate(model, prompt, 12)
    assert got.tolist() == ref.tolist()


def test_cache_logits_equal_full_forward(models):
    _, _, _, _, model = models
    toks = torch.tensor(PROMPT + [[7] * 6])[:, :6]
    toks = torch.cat([toks, torch.randint(0, VOCAB, (3, 10), generator=torch.Generator()
                                          .manual_seed(0))], dim=1)
    ref = forward_full(model, toks)
    cache = KVCache()
    parts = [forward_with_cache(model, toks[:, :7], cache)]  # prompt, then one token at a time
    for i in range(7, toks.shape[1]):
        parts.append(forward_with_cache(model, toks[:, i:i + 1], cache))
    got = torch.cat(parts, dim=1)
    err = (got - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), err


def test_sampled_ids_equal_with_and_without_cache(models):
    _, _, _, _, model = models
    cfg = SamplingConfig(greedy=False, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    a = generate(model, PROMPT, 10, cfg)
    b = generate(model, PROMPT, 10, cfg, use_cache=False)
    assert a.tolist() == b.tolist()
    assert generate(model, PROMPT, 10, cfg).tolist() == a.tolist()  # the seed fixes the draw


def test_eos_stops_and_pads():
    _, _, _, model = imported("gpt2")
    first = generate(model, PROMPT[:1], 4)
    eos = int(first[0, len(PROMPT[0]) + 1])  # the second generated token
    out = generate(model, PROMPT[:1], 8, eos_id=eos)
    assert out.shape[1] == len(PROMPT[0]) + 2 and int(out[0, -1]) == eos


def test_sampling_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    top1 = SamplingConfig(greedy=False, top_k=1)
    assert {int(sample(logits, top1, g)) for _ in range(20)} == {0}
    # softmax = [.64, .24, .09, .03, .01]: top_p 0.7 keeps the first two tokens only
    nucleus = SamplingConfig(greedy=False, top_p=0.7)
    assert {int(sample(logits, nucleus, g)) for _ in range(200)} == {0, 1}
    topk3 = SamplingConfig(greedy=False, top_k=3, temperature=100.0)
    assert {int(sample(logits, topk3, g)) for _ in range(200)} == {0, 1, 2}
    with pytest.raises(ValueError, match="--top-p"):
        SamplingConfig(greedy=False, top_p=0.0)


def _tp_generate(rank, world, mc, state, prompt):
    topo = ParallelTopology.build(tp=2)
    model = GPTModel(mc, topo).eval()
    load_global_state(model, state, topo)
    cfg = SamplingConfig(greedy=False, temperature=0.9, top_p=0.95, seed=5)
    return generate(model, prompt, 8).tolist(), generate(model, prompt, 8, cfg).tolist()


def test_tp2_generates_the_tp1_ids():
    _, mc, state, model = imported("llama")
    cfg = SamplingConfig(greedy=False, temperature=0.9, top_p=0.95, seed=5)
    ref = generate(model, PROMPT, 8).tolist(), generate(model, PROMPT, 8, cfg).tolist()
    out = run_distributed(_tp_generate, 2, mc, state, PROMPT)
    assert out[0] == out[1] == ref


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A tiny GPT-2-style megazero checkpoint (tp=1) whose config names a GPT-2 BPE tokenizer."""
    from megazero.checkpoint import save_checkpoint
    from megazero.config import DataConfig, MegazeroConfig, ModelConfig
    from megazero.testing.hf_models import write_bpe_files

    d = tmp_path_factory.mktemp("gen")
    vocab_file, merge_file, vocab = write_bpe_files(str(d))
    mc = ModelConfig.preset("gpt2", num_layers=2, hidden_size=32, num_attention_heads=4,
                            seq_length=32, vocab_size=vocab, openai_gelu=True,
                            init_method_std=0.2)
    cfg = MegazeroConfig(model=mc, data=DataConfig(tokenizer_type="GPT2BPETokenizer",
                                                   vocab_file=vocab_file, merge_file=merge_file))
    topo = ParallelTopology.single()
    model = GPTModel(mc, topo, seed=3).eval()
    save_checkpoint(str(d / "ckpt"), 0, topo, models=[model], optimizer=None, scheduler=None,
                    consumed_samples=0, config=cfg, barrier=lambda: None)
    return str(d / "ckpt"), model


def _tool():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "tools", "generate_text.py")
    spec = importlib.util.spec_from_file_location("generate_text", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generate_text_tool(saved_run, capsys):
    import json

    from megazero.data.tokenizers import build_tokenizer

    root, model = saved_run
    tool = _tool()
    cfg = json.load(open(f"{root}/iter_0000000/config.json"))["data"]
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=cfg["vocab_file"],
                          merge_file=cfg["merge_file"])
    prompt = tok.tokenize("hello world")
    tool.main(["--load", root, "--prompt", "hello world", "--max-new-tokens", "6",
               "--no-stop-at-eod", "--json"])
    out = json.loads(capsys.readouterr().out)
    ref = generate(model, prompt, 6)[0].tolist()
    assert out == {"prompt_ids": prompt, "output_ids": ref, "text": tok.detokenize(ref)}

    args = tool.build_parser().parse_args(
        ["--load", root, "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--top-k", "10",
         "--temperature", "0.7", "--seed", "9", "--no-stop-at-eod"])
    want = generate(model, [1, 2, 3], 5, SamplingConfig(greedy=False, temperature=0.7, top_k=10,
                                                        seed=9))[0].tolist()
    assert tool.run(args)["output_ids"] == want
    help_text = tool.build_parser().format_help()
    assert "(default: 32)" in help_text and "(default: 1234)" in help_text
    with pytest.raises(SystemExit, match="exclude each other"):
        tool.run(tool.build_parser().parse_args(
            ["--load", root, "--prompt-ids", "1", "--greedy", "--top-p", "0.5"]))


def test_generate_text_under_torchrun_tp2(saved_run):
    """Two tensor-parallel ranks launched by torchrun print the ids of the single process."""
    import json
    import os
    import subprocess
    import sys

    root, model = saved_run
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", os.path.join(repo, "tools", "generate_text.py"), "--load", root,
           "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "6", "--no-stop-at-eod", "--json",
           "--distributed-backend", "gloo"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # rank 0 only
    assert json.loads(lines[0])["output_ids"] == generate(model, [3, 1, 4, 1, 5], 6)[0].tolist()


def _save_tp2_pp2(rank, world, root, mc, cfg):
    from megazero.checkpoint import save_checkpoint
    from megazero.pipeline.partition import build_model_chunks

    topo = ParallelTopology.build(tp=2, pp=2)
    chunks = build_model_chunks(mc, topo, seed=5)
    save_checkpoint(root, 7, topo, models=chunks, optimizer=None, scheduler=None,
                    consumed_samples=0, config=cfg)


def test_generate_text_loads_a_tp2_pp2_checkpoint_in_one_process(tmp_path, capsys):
    """A checkpoint saved by 4 ranks (tp2 x pp2, tied embeddings split over the stages) is
    resharded on load into one process: the tool generates the ids of the tp1 model built from
    the same seed, and holds its weights exactly."""
    import json

    from megazero.checkpoint import read_model_state
    from megazero.config import MegazeroConfig, ModelConfig
    from megazero.tensor_parallel import full_model_state_dict

    mc = ModelConfig.preset("gpt2", num_layers=4, hidden_size=32, num_attention_heads=4,
                            seq_length=32, vocab_size=101, openai_gelu=True,
                            init_method_std=0.2)
    root = str(tmp_path / "tp2pp2")
    run_distributed(_save_tp2_pp2, 4, root, mc, MegazeroConfig(model=mc), timeout=120)
    single = ParallelTopology.single()
    ref = GPTModel(mc, single, seed=5).eval()
    ref_state = full_model_state_dict(ref, single)
    _, saved = read_model_state(root)
    assert sorted(saved) == sorted(ref_state)
    for name, t in ref_state.items():
        assert torch.equal(saved[name], t[:101] if name.startswith("embedding.word") else t)
    tool = _tool()
    tool.main(["--load", root, "--prompt-ids", "5,17,42,8", "--max-new-tokens", "8",
               "--no-stop-at-eod", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["output_ids"] == generate(ref, [5, 17, 42, 8], 8)[0].tolist()
    other = GPTModel(mc, single, seed=6).eval()  # the ids depend on the weights
    assert out["output_ids"] != generate(other, [5, 17, 42, 8], 8)[0].tolist()
