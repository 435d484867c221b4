"""Training runs end to end on spoken numbers: tone "speech" (no espeak-ng) and espeak-ng."""

import json
import os

import numpy as np
import pytest

from configs import spoken_numbers
from flaxformer_lite.config.run import parse
from flaxformer_lite.data import speech_synthesis
from flaxformer_lite.data.examples import texts
from flaxformer_lite.data.tokenizer import Vocabularies
from flaxformer_lite.models import from_config
from flaxformer_lite.training import loop
from flaxformer_lite.training.workdir import load_run_config


def _tiny(tfds_dir, synthesizer, target="digits"):
    config = spoken_numbers.get_config()
    m, d, t = config.model, config.data, config.train
    m.d_model, m.num_heads, m.d_ff, m.max_len = 16, 2, 32, 64
    m.num_encoder_layers = m.num_decoder_layers = 1
    s = d.spoken_numbers
    m.input_features = s.num_mels = 8
    d.tfds_dir = str(tfds_dir)
    s.synthesizer, s.target = synthesizer, target
    s.languages = ("en",)
    s.max_number, s.numbers, s.always_train_below = 40, 16, 5
    s.utterances_per_number = 2
    d.valid_fraction = d.test_fraction = 0.125  # 2 + 2 held-out numbers
    d.vocab_size, d.max_source_len, d.max_target_len, d.max_tokens = 20, 48, 8, 384
    t.num_steps, t.log_every, t.eval_every, t.checkpoint_every = 2, 1, 0, 2
    t.eval_batch_size, t.num_examples_to_print = 4, 2
    config.optim.warmup_steps = 1
    t.progress_bar = t.tensorboard = False
    return config


@pytest.fixture(scope="module")
def tone_run(tmp_path_factory):
    """A 2-step run on tone "speech": (config, workdir, results, log lines)."""
    tmp = tmp_path_factory.mktemp("tone_run")
    logs = []
    config = _tiny(tmp / "tfds", "tones")
    workdir = str(tmp / "run")
    results = loop.train_and_evaluate(parse(config), workdir, log=logs.append)
    return config, workdir, results, logs


def test_two_steps_on_tone_speech(tone_run):
    """The tone stand-in goes through the same builder, loader, batching and evaluation."""
    config, workdir, results, logs = tone_run
    assert results["step"] == 2
    for split in ("validation", "test"):
        assert results[f"{split}_wer"] >= 0 and 0 <= results[f"{split}_exact_match"] <= 1
        assert np.isfinite(results[f"{split}_loss"])
    text = "\n".join(logs)
    # Examples print the utterance's description and the transcript.
    assert "held-out test examples" in text
    assert any(line.lstrip().split()[1:2] == ["en"] and "wpm" in line for line in logs), text
    # The vocabulary holds the transcripts' pieces only (digits), none of the descriptions'.
    vocab = Vocabularies.load(workdir).target
    pieces = {vocab.decode([i]) for i in range(4, vocab.vocab_size)}
    assert not any(c.isalpha() for p in pieces for c in p), pieces
    with open(os.path.join(workdir, "run_config.json")) as f:
        saved = json.load(f)
    assert saved["data"]["spoken_numbers"]["num_mels"] == 8
    assert saved["model"]["input_features"] == 8


@pytest.mark.skipif(not speech_synthesis.available(), reason="no espeak-ng backend")
def test_two_steps_on_espeak_speech(tmp_path):
    logs = []
    config = _tiny(tmp_path / "tfds", "espeak", target="words")
    config.data.max_source_len, config.data.max_tokens = 256, 2048
    config.data.max_target_len, config.data.vocab_size = 16, 40
    results = loop.train_and_evaluate(parse(config), str(tmp_path / "run"), log=logs.append)
    assert results["step"] == 2 and results["test_wer"] >= 0
    from flaxformer_lite import datasets
    from flaxformer_lite.config import run as run_config

    splits = datasets.load_splits(run_config.parse(config).data)
    assert texts(splits["test"], "target")[0].replace("-", " ").split()[0].isalpha()


def test_decode_reads_wav_files_as_training_reads_features(tone_run, tmp_path):
    """decode.py's WAV lines give the greedy outputs of the training batch path."""
    import jax

    from flaxformer_lite.cli import decode as decode_cli
    from flaxformer_lite.data import batching
    from flaxformer_lite.data.audio_features import speech_features, write_wav
    from flaxformer_lite.data.spoken_numbers import tones
    from flaxformer_lite.models.predict import SearchConfig
    from flaxformer_lite.training import restore
    from flaxformer_lite.translate import line_io

    config, workdir, _, _ = tone_run
    paths = []
    for i, text in enumerate(["twelve", "seven", "thirty-one"]):
        samples, rate = tones(text, "en", "", 160 + 20 * i, 50)
        paths.append(str(tmp_path / f"{i}.wav"))
        write_wav(paths[-1], samples, rate)
    listing = tmp_path / "wavs.txt"
    listing.write_text(f"{paths[0]}\n\n{paths[1]}\n{paths[2]}\n")
    refs = tmp_path / "refs.txt"
    refs.write_text("12\n\n7\n31\n")
    out = tmp_path / "out.txt"
    options = dict(workdir=workdir, input=str(listing), beam_size=1, batch_size=2)
    decode_cli.run(decode_cli.Options(**options, output=str(out), reference=str(refs)))
    lines = out.read_text().split("\n")
    assert len(lines) == 5 and lines[1] == "" and lines[4] == ""  # 4 lines, one blank

    # The same files through the training batch path and a plain greedy search.
    from flaxformer_lite.data.audio_features import read_wav

    split = []
    for path in paths:
        samples, rate = read_wav(path)
        split.append({"features": speech_features(samples, rate, 8), "target": b"0"})
    vocab = Vocabularies.load(workdir)
    d = config.data
    batches = batching.eval_batches(
        split, vocab, batch_size=4, max_source_len=d.max_source_len, max_target_len=8
    )
    params, _ = restore.restore_params(workdir, None)
    model = from_config.build_model(load_run_config(workdir))
    batch = {k: jax.numpy.asarray(v) for k, v in batches[0].items()}
    tokens, _ = model.predict(params, batch, SearchConfig("greedy", d.max_target_len))
    expected = vocab.target.decode_batch(np.asarray(tokens[:3, 0]))
    assert [lines[0], lines[2], lines[3]] == expected

    # Cross-attention plots over the encoder positions of the speech inputs.
    pngs = tmp_path / "png"
    decode_cli.run(decode_cli.Options(**options, output=str(out), attention_png=str(pngs)))
    assert sorted(os.listdir(pngs)) == [f"attention_{i:04d}.png" for i in (0, 2, 3)]

    listing.write_text(f"{paths[0]}\n{tmp_path / 'missing.wav'}\n")
    with pytest.raises(line_io.InputError, match=r"input line 2: .*missing\.wav: cannot be read"):
        decode_cli.run(decode_cli.Options(**options, output=str(out)))
    with pytest.raises(line_io.InputError, match="--report is not supported for a speech"):
        decode_cli.run(decode_cli.Options(**options, reference=str(refs), report=True))
