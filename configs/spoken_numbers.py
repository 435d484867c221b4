"""A small speech recogniser: English numbers 0..999 spoken by espeak-ng -> their words.

Needs espeak-ng to generate the data once (`pip install '.[speech]'` or `apt-get install
espeak-ng`): about 2300 training utterances (420 numbers, 20 of them held out for validation and
20 for test, never heard in training), each in a voice, rate, pitch and noise level of its own.
The encoder reads 80 log-mel channels per 10 ms frame (`model.input_features`); utterances run
to about 2.8 s, hence `data.max_source_len=320` frames. Shrink it from the command line, e.g.
`--config.data.spoken_numbers.numbers=40 --config.data.spoken_numbers.utterances_per_number=1`.
"""

import ml_collections

from configs import default
from flaxformer_lite.config import defaults


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    m, d, o, t = config.model, config.data, config.optim, config.train
    m.d_model, m.num_heads, m.d_ff = 128, 4, 512  # width, heads, feed-forward size
    m.max_len = 320  # learned positions would need a row per frame (sinusoids need none)
    m.num_encoder_layers = m.num_decoder_layers = 2  # depth
    m.norm = "pre"  # pre-LN: steadier on long frame sequences
    m.share_embeddings = False  # the encoder reads frames, not the target vocabulary
    m.input_features = 80  # = data.spoken_numbers.num_mels
    m.subsampling_layers = 2  # two stride-2 convs: 4x fewer encoder positions (40 ms each)
    d.dataset = "spoken_numbers"  # flaxformer_lite/data/spoken_numbers.py
    s = d.spoken_numbers
    s.languages = ("en",)  # espeak-ng voices (en, de, fr)
    s.max_number = 999  # numbers 0..999
    s.numbers = 400  # drawn from 20..999, plus 0..19 always in train
    s.always_train_below = 20  # the words no model can infer (thirteen) stay in train
    s.utterances_per_number = 6  # training utterances per number
    s.target = "words"  # words | digits
    s.num_mels = 80  # log-mel channels per frame
    d.valid_fraction = d.test_fraction = 0.05  # 20 + 20 held-out numbers
    d.vocab_size = 64  # SentencePiece pieces of the transcripts
    d.max_source_len = 320  # frames (3.2 s)
    d.max_target_len = 16  # pieces incl. EOS ("seven hundred and seventy-seven": 11)
    d.batching = "bucket"  # utterances grouped by frame count
    d.max_tokens = 6400  # frames per batch: 20 rows of 320, 50 of 128
    o.schedule, o.learning_rate, o.warmup_steps = "cosine", 1e-3, 200
    t.num_steps, t.eval_every, t.checkpoint_every = 3000, 1000, 1000
    t.eval_batch_size = 32
    t.best_metric = "wer"  # checkpoints ranked by validation word error rate
    t.exposure_report = False
    # objectives/guided_attention.py, off (weight 0): --config.guided_attention.weight=10
    # adds 10 * mean(A * W) of the guided layers and heads to the loss
    config.guided_attention = defaults.section_config("guided_attention")
    return config
