"""Data for flaxformer_lite: the tasks and corpora, the tokenizer and the batching plans.

* :mod:`flaxformer_lite.data.examples`: example fields, text decoding, the seeded split.
* :mod:`flaxformer_lite.data.numbers`: generates the task and stores it as a TFDS dataset.
* :mod:`flaxformer_lite.data.translation`: local corpora and TFDS catalog datasets.
* :mod:`flaxformer_lite.data.tokenizer`: SentencePiece tokenizer with fixed reserved ids.
* :mod:`flaxformer_lite.data.batching`: fixed, bucketed and packed batches of token ids.
* :mod:`flaxformer_lite.data.pipeline`: ``make_dataset``, the fixed batches' first signature.
"""
