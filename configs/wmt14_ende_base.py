"""Transformer base (Vaswani et al. 2017, Table 3 "base") for WMT14 English->German.

N=6, d_model=512, d_ff=2048, h=8, d_k=d_v=64, P_drop=0.1, eps_ls=0.1, a
shared 37000-token vocabulary, Adam(0.9, 0.98, 1e-9) with 4000 warm-up steps.
`python train.py --config configs/wmt14_ende_base.py --dry_run` shows its
parameters on any machine.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()

    m = config.model
    m.vocab_size = 37000  # shared source/target vocabulary (§5.1)
    m.d_model = 512
    m.num_heads = 8
    m.d_kv = 64  # d_model / h, set explicitly as in Table 3 (rows A and B vary it)
    m.d_ff = 2048
    m.num_encoder_layers = 6
    m.num_decoder_layers = 6
    m.dropout_rate = 0.1  # P_drop of the base model (§5.4)
    m.max_len = 256  # learned-position table size (unused with sinusoids)

    d = config.data
    d.dataset = "wmt14_translate/de-en"  # TFDS catalog name (needs the download)
    d.source_lang = "en"  # the catalog's features are "de" and "en"
    d.target_lang = "de"
    d.vocab_size = 37000  # shared SentencePiece vocabulary
    d.max_source_len = 256  # tokens incl. EOS
    d.max_target_len = 256

    o = config.optim
    o.schedule = "rsqrt"  # the paper's lrate formula (§5.3)
    o.learning_rate = 1.0  # multiplier of that formula: 1.0 is the paper
    o.warmup_steps = 4000  # the paper's warmup_steps (§5.3)

    t = config.train
    t.batch_size = 128  # sentences per step (the paper batches ~25k tokens per side)
    t.num_steps = 100_000  # base model: 100k steps (§5.2)
    t.label_smoothing = 0.1  # eps_ls of §5.4
    t.eval_every = 5000
    t.eval_max_batches = 20
    t.checkpoint_every = 5000
    return config
