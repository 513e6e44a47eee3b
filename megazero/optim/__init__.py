"""DeepSpeed's own optimizers beside torch's: Lamb (:mod:`.lamb`, with the whole-parameter norms
it needs under ZeRO and TP in :mod:`.whole_norms`), and the 1-bit family's compressed
all-reduce (:mod:`.compressed`)."""
