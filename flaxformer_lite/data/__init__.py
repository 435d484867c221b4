"""Data for flaxformer_lite: the number-words task, the tokenizer and the batching pipeline.

* :mod:`flaxformer_lite.data.numbers`: generates the task and stores it as a TFDS dataset.
* :mod:`flaxformer_lite.data.tokenizer`: SentencePiece tokenizer with fixed reserved ids.
* :mod:`flaxformer_lite.data.pipeline`: grain datasets of fixed-shape token-id batches.
"""
