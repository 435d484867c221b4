"""Multi30k English->German, the CTC non-autoregressive model trained on distilled targets.

configs/multi30k_ende_ctc.py reading the corpus distill.py writes from a trained
autoregressive workdir (the training sources with the teacher's beam outputs as
targets; validation and test keep their gold references). The same corpus as
configs/multi30k_ende_nat_distilled.py:

  python train.py --config configs/multi30k_ende.py --workdir workdirs/multi30k_ende \
      --config.data.parallel_text.corpus_dir=<multi30k>
  python distill.py --workdir workdirs/multi30k_ende --output_dir data/multi30k_ende_distilled
  python train.py --config configs/multi30k_ende_ctc_distilled.py --workdir workdirs/ctc_kd

data.parallel_text.corpus_dir is relative to the working directory, as distill.py's
--output_dir above.
"""

import ml_collections

from configs import multi30k_ende_ctc


def get_config() -> ml_collections.ConfigDict:
    config = multi30k_ende_ctc.get_config()
    d = config.data
    d.parallel_text.corpus_dir = "data/multi30k_ende_distilled"  # distill.py --output_dir
    d.split_names = {"validation": "val", "test": "test"}  # the names distill.py writes
    return config
