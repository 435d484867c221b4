"""The embedded default: numbers in digits -> words in English, German and French.

Generated locally (no download); a small Transformer learns it on 2 CPU cores
in a few minutes. `python train.py` uses this config.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    config.model = m = ml_collections.ConfigDict()
    m.vocab_size = 256  # replaced by the trained tokenizer's size
    m.target_vocab_size = None  # None: one vocabulary for source and target
    # embedding/softmax rows padded to a multiple of this (1: none); 128 fills TPU lanes and
    # GPU tiles and divides over mesh.model; the padding is never an output (nn/vocab.py)
    m.vocab_multiple = 128
    m.share_embeddings = True  # tie encoder, decoder and softmax embeddings (§3.4)
    m.tie_output_embedding = True  # decoder embedding doubles as softmax weights
    m.d_model = 128  # a quarter of the paper's base: the task has a 60-piece vocabulary
    m.num_heads = 4  # attention heads h
    m.d_kv = None  # per-head size; None: d_model // num_heads
    m.d_ff = 512  # feed-forward hidden size
    m.num_encoder_layers = 2  # N = 2 of the paper's 6: enough to reorder German units/tens
    m.num_decoder_layers = 2
    m.dropout_rate = 0.0  # P_drop on sub-layer outputs and embedding sums; the task has no noise
    m.attention_dropout_rate = 0.0  # dropout on attention weights
    m.dropout_rng = "hash"  # mask bits: hash (fused into the layer, fast) | threefry (jax.random)
    m.max_len = 64  # rows of the learned-position table (unused by sinusoids)
    m.positions = "sinusoidal"  # sinusoidal | learned | none
    m.norm = "post"  # post (paper) | pre
    m.activation = "relu"  # relu | gelu
    m.attention_impl = "auto"  # auto: cuDNN flash (GPU) | splash (TPU) | XLA; or vmap | fast |
    # cudnn | splash to force one (nn/kernels.py); one line per run says which runs, and why
    m.encoder_window = 0  # > 0: encoder self-attention only within |i - j| <= r, O(n r); 0 = full
    m.decoder_window = 0  # > 0: decoder self-attention only to i - r <= j <= i; 0 = full
    m.subsampling_layers = 0  # features only: n stride-2 Conv1d + GLU layers (2**n fewer frames)
    m.subsampling_kernel = 5  # odd width of each subsampling conv
    m.subsampling_channels = 256  # channels after each subsampling conv's GLU
    m.layer_norm_epsilon = 1e-6  # added to the variance; 1e-6 as in tensor2tensor
    m.dtype = "auto"  # matmul operands: auto = bfloat16 on GPU/TPU, float32 on CPU; softmax,
    # LayerNorm statistics, loss and every matmul's accumulation stay float32
    m.param_dtype = "float32"  # storage of parameters (optim.state_dtype: of Adam's moments)
    m.scan_layers = False  # one lax.scan over layers stored stacked (faster compiles when deep)
    # per layer, what the backward pass recomputes instead of storing: none | full |
    # nothing_saveable | dots_saveable | dots_with_no_batch_dims_saveable
    m.remat = "none"

    config.data = d = ml_collections.ConfigDict()
    d.dataset = "number_words"  # the generated task (see flaxformer_lite/data/numbers.py)
    d.tfds_dir = ""  # where TFDS prepares data; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
    # number_words: which numbers in which languages.
    d.languages = ("en", "de", "fr")  # num2words language codes
    d.max_number = 9999  # numbers 0..max_number in every language
    d.always_train_below = 100  # never held out: below 100 are the irregular words (zwölf, douze)
    d.shape_balance = 0.7  # repeat rarer shapes (digits, non-zero digits): 12 22x, 9700 10x
    d.num_numbers = 0  # > 0: only this many numbers per language, drawn from 0..max_number
    # number_words and tsv: the seeded train/validation/test assignment.
    d.seed = 0  # seed of the assignment (not of training: that is train.seed)
    d.valid_fraction = 0.05  # share of pairs held out for validation
    d.test_fraction = 0.05  # share held out for the final test
    # names: the generated name-copy task's examples per split (drawn with data.seed).
    d.names_train, d.names_valid, d.names_test = 20_000, 500, 1_000
    # spoken_numbers: numbers spoken by espeak-ng (flaxformer_lite/data/spoken_numbers.py); the
    # split (data.seed and the fractions above) is by number, in every language at once.
    d.speech_languages = ("en",)  # espeak-ng voices that num2words spells: en, de, fr
    d.speech_max_number = 999  # numbers 0..speech_max_number
    d.speech_numbers = 0  # > 0: only this many numbers >= speech_always_train_below
    d.speech_always_train_below = 20  # never held out (thirteen, douze): always in train
    d.speech_utterances_per_number = 4  # training utterances per number and language
    d.speech_target = "words"  # words (as spoken) | digits ("4630")
    d.num_mels = 80  # log-mel channels per 10 ms frame (model.input_features must equal it)
    d.speech_synthesizer = "espeak"  # espeak (pip install '.[speech]') | tones (a test stand-in)
    # parallel_text: {split}.{lang} files (optionally .gz), one sentence a line.
    d.corpus_dir = ""  # a relative path is read from the working directory
    # parallel_text and TFDS catalog datasets: which side is which.
    d.source_lang = ""  # file suffix or catalog feature of the source, e.g. "en"
    d.target_lang = ""  # the same for the target, e.g. "de"
    # parallel_text, tsv and catalog: the corpus's names for our splits, e.g. {"validation":
    # "val"}; a split not named here is looked up under its own name.
    d.split_names = {}
    # tsv: a file of tab-separated pairs (e.g. Tatoeba's fra.txt), split by the seed above.
    d.tsv_path = ""
    d.source_column = 0  # 0-based column of the source sentence
    d.target_column = 1  # 0-based column of the target sentence
    d.vocab_size = 256  # SentencePiece vocabulary size (the shared, or the source, one)
    d.shared_vocab = True  # one vocabulary for both sides; False: one per side
    d.target_vocab_size = 0  # target vocabulary size when not shared (0: data.vocab_size)
    d.vocab_model_type = "unigram"  # SentencePiece model: unigram | bpe | char | word
    d.max_source_len = 10  # source tokens incl. EOS (longer are truncated)
    d.max_target_len = 16  # target tokens incl. EOS
    d.batching = "fixed"  # fixed (max shapes) | bucket (length buckets) | pack (packed rows)
    d.max_tokens = 0  # bucket: tokens per batch instead of train.batch_size rows (0: rows)

    config.optim = o = ml_collections.ConfigDict()
    o.schedule = "cosine"  # rsqrt (paper §5.3) | constant | cosine (to 0: short runs end sharp)
    o.learning_rate = 3e-3  # rsqrt: multiplier of the paper's rate; else the peak rate
    o.warmup_steps = 100  # linear warm-up steps
    o.b1 = 0.9  # Adam beta1
    o.b2 = 0.98  # Adam beta2
    o.eps = 1e-9  # Adam epsilon
    o.weight_decay = 0.0  # decoupled weight decay (AdamW) when > 0
    o.grad_clip_norm = 0.0  # global-norm clipping when > 0
    o.state_dtype = "float32"  # Adam's moments and update math: float32 | bfloat16 (halves them)

    # Device mesh data x fsdp x model (see flaxformer_lite/parallel/partitioning.py); data gets
    # the devices that fsdp and model leave.
    config.mesh = mesh = ml_collections.ConfigDict()
    mesh.fsdp = 1  # shard parameters and optimiser state over this many devices (ZeRO-3)
    mesh.model = 1  # tensor parallelism: heads, feed-forward and vocabulary split this many ways

    config.train = t = ml_collections.ConfigDict()
    t.seed = 0  # parameter init and dropout
    t.batch_size = 128  # examples per step
    t.grad_accum_steps = 1  # split each batch into this many sequential micro-batches
    t.num_steps = 1000  # total optimiser steps
    t.label_smoothing = 0.1  # eps_ls of §5.4: hurts perplexity, helps accuracy and BLEU
    t.log_every = 50  # steps between train-metric records
    t.eval_every = 500  # steps between validation evaluations (0: only at the end)
    t.eval_max_batches = 0  # batches per intermediate evaluation (0: the whole split)
    t.eval_batch_size = 256  # examples per eval batch
    t.eval_search = "greedy"  # decoding for evaluation: greedy | beam
    t.eval_beam_size = 4  # beams when eval_search is beam
    t.eval_alpha = 0.6  # GNMT length penalty for beam search
    t.eval_bleu = False  # also report sacreBLEU and chrF
    # Exposure-bias report with every evaluation (eb_* metrics, a table at the end): TF vs
    # greedy accuracy, first errors, prefix swaps; one argmax + 5 scoring passes per batch.
    t.exposure_report = True
    t.checkpoint_every = 500  # steps between checkpoints
    t.keep_checkpoints = 3  # most recent checkpoints kept
    # Checksums, write and read-back of a checkpoint on a background thread (one process);
    # the step path only copies the state to host memory. False: all of it between steps.
    t.async_checkpoints = True
    t.keep_best_checkpoints = 1  # also kept: the best by validation best_metric (0: none)
    t.best_metric = "loss"  # validation metric ranking checkpoints: loss, exact_match, bleu, ...
    t.early_stop_patience = 0  # stop after this many evaluations without a new best (0: never)
    t.nonfinite = "stop"  # non-finite loss or gradient: stop | skip (the update; stop after
    t.nonfinite_max_skips = 10  # ... this many skipped steps in a row)
    t.hang_factor = 20.0  # a step, evaluation or save this many times its median is a hang:
    t.hang_min_seconds = 600.0  # ... but never before this; the run then exits (0: no watchdog)
    # With several processes, agree on a stop signal (a collective) at every Nth step or
    # evaluation batch only; one process checks its own at each.
    t.preemption_check_every = 10
    t.num_examples_to_print = 8  # test examples printed at the end
    t.progress_bar = True  # tqdm bar on stderr
    t.tensorboard = True  # also write TensorBoard event files

    # Scheduled sampling (flaxformer_lite/objectives/scheduled_sampling.py): decoder inputs fed,
    # with probability 1 - eps_i at step i, from the model's own previous-position predictions.
    config.scheduled_sampling = s = ml_collections.ConfigDict()
    s.mode = "off"  # off (teacher forcing) | argmax | sample | soft (softmax-weighted embedding)
    s.schedule = "linear"  # eps_i: linear max(eps_min, k - c*i) | exponential k**i |
    s.k = 1.0  # ... inverse_sigmoid k / (k + exp(i / k)) | constant k
    s.c = 1e-4  # linear: decrease of eps_i per step
    s.eps_min = 0.0  # floor of eps_i
    s.warmup_steps = 0  # steps of pure teacher forcing; i counts from their end
    s.temperature = 1.0  # sample, soft: softmax temperature of the fed predictions
    s.gradient = "last"  # last: gradient through the last pass only | all (soft only)
    s.passes = 2  # decoder passes: 2 = two-pass decoder, more = the parallel variant
    return config
