"""The training tokenizer as a Hugging Face tokenizer that gives the same ids.

A model trained by megazero saw ``tokenizer.tokenize(text)``: no BOS, no EOS (documents are
separated by the end-of-document id alone), and for SentencePiece whatever the model's own
normaliser did. ``AutoTokenizer.from_pretrained`` on the exported directory must give exactly
those ids, so the export does not leave that to transformers' slow-to-fast conversion (which
applies Llama's assumptions, not the model's: no NFKC where the model had it, whitespace kept
where the model folded it). Instead ``tokenizer.json`` is built here from the SentencePiece
model's own ``normalizer_spec`` and ``trainer_spec``:

* normaliser: the model's precompiled NFKC map if it has one; SentencePiece's
  ``remove_extra_whitespaces`` as "collapse runs of spaces, strip the ends" (spaces only, as
  SentencePiece does);
* then the dummy ``▁`` prefix (only if the model adds one, and also before text that starts
  with a space, unlike ``Metaspace``) and spaces -> ``▁``; no pre-tokeniser: SentencePiece
  segments the whole text;
* model: BPE with merges ranked by the merged piece's id (SentencePiece BPE merges the pair whose
  result scores highest, and its BPE scores fall with the id) or Unigram with the pieces'
  scores; byte fallback as trained. BPE (what ``tools/train_tokenizer.py`` and the demo train by
  default) gives SentencePiece's ids exactly; Unigram can differ where two segmentations score
  exactly the same (the Viterbi searches break ties differently, e.g. ``▁ ▁ ▁▁▁`` against
  ``▁▁▁ ▁ ▁``);
* special pieces are added tokens that are *not* matched in raw text
  (``split_special_tokens``), as SentencePiece never reads ``</s>`` in text as the control piece;
  no post-processor, so nothing is added around the text.

``tokenizer.model`` is shipped beside it for sentencepiece users and for ``--loader hf``.
GPT-2 BPE files are copied as they are, with the byte-level ``tokenizer.json`` of the same
vocabulary and merges (``<|endoftext|>`` in text is read as text, as megazero's tokenizer reads
it). A Hugging Face ``tokenizer.json`` is copied as it is, except that a post-processor adding
special tokens is dropped: megazero never added them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

SP_MODEL, GPT2_VOCAB, GPT2_MERGES = "tokenizer.model", "vocab.json", "merges.txt"
HF_JSON, HF_CONFIG = "tokenizer.json", "tokenizer_config.json"
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>")
# sentencepiece_model.proto ModelProto.SentencePiece.Type and TrainerSpec.ModelType
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_UNIGRAM, _BPE = 1, 2


@dataclass(frozen=True)
class TokenizerExport:
    """What an export wrote and the special ids ``config.json`` and ``generation_config.json``
    name (None where the vocabulary has no such token)."""

    files: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


def _sp_proto(model_file: str) -> Any:
    from sentencepiece import sentencepiece_model_pb2  # needs protobuf

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def sentencepiece_to_hf(model_file: str) -> Any:
    """A ``tokenizers.Tokenizer`` that encodes (without special tokens) as ``model_file`` does."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

    proto = _sp_proto(model_file)
    ns, ts = proto.normalizer_spec, proto.trainer_spec
    if ts.treat_whitespace_as_suffix:
        raise ValueError(f"{model_file}: treat_whitespace_as_suffix is not supported by the "
                         "Hugging Face export")
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    unk = next((i for i, (_, _, t) in enumerate(pieces) if t == _UNKNOWN), None)
    if ts.model_type == _BPE:
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        mergeable = {piece for piece, _, t in pieces if t in (_NORMAL, _USER_DEFINED)}
        merges: list[tuple[str, str]] = []
        for piece, _, t in pieces:  # in id order: the merge rank
            if t != _NORMAL or len(piece) < 2:
                continue
            splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
            merges += sorted(((a, b) for a, b in splits if a in mergeable and b in mergeable),
                             key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
        model = models.BPE(vocab=vocab, merges=merges, byte_fallback=ts.byte_fallback,
                           unk_token=None if unk is None else pieces[unk][0], fuse_unk=True)
    elif ts.model_type == _UNIGRAM:
        # SentencePiece never matches control, byte or unused pieces in text; HF's lattice
        # would, so they get a score no path through real pieces can lose to.
        floor = min(score for _, score, t in pieces if t == _NORMAL) - 1e6
        model = models.Unigram([(piece, score if t in (_NORMAL, _USER_DEFINED) else floor)
                                for piece, score, t in pieces], unk_id=unk,
                               byte_fallback=ts.byte_fallback)
    else:
        raise ValueError(f"{model_file}: SentencePiece model type {ts.model_type} (word/char) "
                         "has no Hugging Face export; train a bpe or unigram model")
    tok = Tokenizer(model)
    steps = []
    if ns.precompiled_charsmap:
        steps.append(normalizers.Precompiled(ns.precompiled_charsmap))
    if ns.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex("^ | $"), "")]
    if ns.add_dummy_prefix:  # not Metaspace's prepend: it skips text that starts with a space
        steps.append(normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if ns.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    tok.add_tokens([AddedToken(p, special=False, normalized=False)
                    for p, _, t in pieces if t == _USER_DEFINED])
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False)
                            for p, _, t in pieces if t in (_UNKNOWN, _CONTROL)])
    return tok


def _write_config(path: str, **fields: Any) -> None:
    base = {"clean_up_tokenization_spaces": False, "add_bos_token": False,
            "add_eos_token": False, "model_max_length": int(1e30)}
    with open(os.path.join(path, HF_CONFIG), "w", encoding="utf-8") as f:
        json.dump({**base, **fields}, f, indent=2)


def _export_sentencepiece(src: str, path: str, add_bos: bool = False) -> TokenizerExport:
    """``add_bos`` (Megatron's Llama2Tokenizer, which starts every text with ``<s>``): the
    exported tokenizer puts the bos id first too, so it gives the ids training saw."""
    import sentencepiece as spm
    from tokenizers import processors

    shutil.copyfile(src, os.path.join(path, SP_MODEL))
    sp = spm.SentencePieceProcessor(model_file=src)
    hf = sentencepiece_to_hf(src)
    if add_bos:
        bos = sp.id_to_piece(sp.bos_id())
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, sp.bos_id())])
    hf.save(os.path.join(path, HF_JSON))
    ids = {k: (i if i >= 0 else None) for k, i in
           (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("pad", sp.pad_id()), ("unk", sp.unk_id()))}
    names = {f"{k}_token": (sp.id_to_piece(i) if i is not None else None) for k, i in ids.items()}
    _write_config(path, tokenizer_class="PreTrainedTokenizerFast", split_special_tokens=True,
                  **names)
    return TokenizerExport([SP_MODEL, HF_JSON, HF_CONFIG], ids["bos"], ids["eos"], ids["pad"])


def _export_gpt2(info: dict[str, Any], path: str) -> TokenizerExport:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from megazero.data.gpt2_bpe import EOD_TOKEN

    for key, name in (("vocab_file", GPT2_VOCAB), ("merge_file", GPT2_MERGES)):
        need_file(info.get(key), f"{key} (--{key.replace('_', '-')})")
        shutil.copyfile(info[key], os.path.join(path, name))
    vocab, merges = models.BPE.read_file(info["vocab_file"], info["merge_file"])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    tok.save(os.path.join(path, HF_JSON))
    # megazero's GPT2BPETokenizer reads "<|endoftext|>" in text as text, not as the token.
    _write_config(path, tokenizer_class="PreTrainedTokenizerFast", split_special_tokens=True,
                  bos_token=EOD_TOKEN, eos_token=EOD_TOKEN, unk_token=EOD_TOKEN)
    eod = int(vocab[EOD_TOKEN])
    return TokenizerExport([GPT2_VOCAB, GPT2_MERGES, HF_JSON, HF_CONFIG], eod, eod, None)


def _export_hf_json(src: str, path: str) -> TokenizerExport:
    from tokenizers import Tokenizer

    from megazero.data.tokenizers import HuggingFaceTokenizer

    eod_tok = HuggingFaceTokenizer(src)
    tok = Tokenizer.from_file(eod_tok.model_file)
    plain = tok.encode("a", add_special_tokens=False).ids
    if tok.encode("a", add_special_tokens=True).ids != plain:
        data = json.loads(tok.to_str())
        data["post_processor"] = None
        tok = Tokenizer.from_str(json.dumps(data))
    tok.save(os.path.join(path, HF_JSON))
    eos = tok.id_to_token(eod_tok.eod)
    bos = next((t for t in BOS_CANDIDATES if tok.token_to_id(t) is not None), eos)
    _write_config(path, tokenizer_class="PreTrainedTokenizerFast", bos_token=bos, eos_token=eos)
    return TokenizerExport([HF_JSON, HF_CONFIG], tok.token_to_id(bos), eod_tok.eod, None)


def export_tokenizer(info: dict[str, Any] | None, path: str) -> TokenizerExport:
    """Write the HF tokenizer for megazero tokenizer settings ``info`` (a run config's ``data``
    block) into ``path``; no files and no ids when ``info`` names no tokenizer files."""
    info = info or {}
    kind = info.get("tokenizer_type")
    os.makedirs(path, exist_ok=True)
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        need_file(info.get("tokenizer_model"), "tokenizer_model (--tokenizer-model)")
        return _export_sentencepiece(info["tokenizer_model"], path,
                                     add_bos=kind == "Llama2Tokenizer")
    if kind == "GPT2BPETokenizer":
        return _export_gpt2(info, path)
    if kind == "HuggingFaceTokenizer":
        model = info.get("tokenizer_model")
        if not model or not os.path.exists(model):
            need_file(model, "tokenizer_model (--tokenizer-model)")
        return _export_hf_json(model, path)
    return TokenizerExport([], None, None, None)


def find_tokenizer(path: str) -> dict[str, str] | None:
    """megazero tokenizer settings for the tokenizer files in ``path`` (``tokenizer.model``,
    then ``vocab.json`` + ``merges.txt``, then ``tokenizer.json``), or None if it has none."""
    sp = os.path.join(path, SP_MODEL)
    if os.path.isfile(sp):
        return {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": os.path.abspath(sp)}
    vocab, merges = os.path.join(path, GPT2_VOCAB), os.path.join(path, GPT2_MERGES)
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": os.path.abspath(vocab),
                "merge_file": os.path.abspath(merges)}
    if os.path.isfile(os.path.join(path, HF_JSON)):
        return {"tokenizer_type": "HuggingFaceTokenizer",
                "tokenizer_model": os.path.abspath(os.path.join(path, HF_JSON))}
    return None


def need_file(path: str | None, what: str) -> None:
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file {path!r} ({what}) not found; point it at the "
                                "file or convert the weights alone")
