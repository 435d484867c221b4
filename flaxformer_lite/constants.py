"""The reserved token ids, the one home of the project's special ids.

Every vocabulary (`data/tokenizer.py`) is trained with these ids fixed, and
every module that needs one (masks, losses, search, benchmarks) imports it
from here.
"""

PAD_ID: int = 0  # right padding of every id array; masked out of attention and of the loss
UNK_ID: int = 1  # characters the vocabulary does not cover
BOS_ID: int = 2  # the decoder's start token; never produced by encoding
EOS_ID: int = 3  # end of sequence: appended by encoding, learned so decoding can stop

# Log-probability of an output id that has neither vocabulary nor copy mass (the copy head's
# extended ids no source position holds): finite, far below any real log-probability.
IMPOSSIBLE = -1.0e30
