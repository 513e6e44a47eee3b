"""The GPT model built for one pipeline chunk, with tensor/sequence parallelism: the model
(:mod:`.gpt`: :class:`~megazero.model.gpt.GPTModel`), its layers (:mod:`.transformer`,
:mod:`.attention`, :mod:`.mlp`, :mod:`.norms`, :mod:`.positional`, :mod:`.qk_norm`,
:mod:`.dropout`), layout-independent initialisation (:mod:`.init`, :mod:`.materialize`),
activation recomputation (:mod:`.recompute`) and generation with a key/value cache
(:mod:`.generation`).

The package imports none of its modules here: the MoE layers (:mod:`megazero.moe`) build on
:mod:`.init` and :mod:`.mlp` while :mod:`.transformer` places them, so importing one module
must not import the whole model.
"""
