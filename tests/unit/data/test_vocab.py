"""Shared and separate source/target vocabularies: files, errors, and a run end to end."""

import os

import numpy as np
import pytest
from conftest import tiny_config

from flaxformer_lite.config import ConfigError
from flaxformer_lite.config.run import parse
from flaxformer_lite.data import batching
from flaxformer_lite.data.tokenizer import (
    EOS_ID,
    SHARED_VOCAB_FILE,
    SOURCE_VOCAB_FILE,
    TARGET_VOCAB_FILE,
    Vocabularies,
)

SOURCES = [f"{n} {n + 7}" for n in range(300)]  # digits only
TARGETS = [f"la maison numéro {n % 17} est rouge et bleue" for n in range(300)]


@pytest.fixture(scope="module")
def separate():
    return Vocabularies.train(SOURCES, TARGETS, 40, shared=False, target_vocab_size=60)


def test_separate_vocabularies_cover_their_own_side(separate):
    assert not separate.shared
    # Digits and a space fit in fewer pieces than asked for (a soft limit).
    assert separate.source.vocab_size < separate.target.vocab_size <= 60
    pieces = {separate.source.id_to_piece(i) for i in range(separate.source.vocab_size)}
    assert not any("maison" in p for p in pieces)
    assert separate.target.decode(separate.target.encode(TARGETS[3])) == TARGETS[3]
    shared = Vocabularies.train(SOURCES, TARGETS, 60)
    assert shared.shared and shared.source is shared.target


def test_save_and_load_round_trip(separate, tmp_path):
    separate.save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [SOURCE_VOCAB_FILE, TARGET_VOCAB_FILE]
    assert Vocabularies.exists(tmp_path)
    loaded = Vocabularies.load(tmp_path)
    assert loaded == separate and not loaded.shared

    shared_dir = tmp_path / "shared"
    shared_dir.mkdir()
    Vocabularies.of(separate.target).save(shared_dir)
    assert os.listdir(shared_dir) == [SHARED_VOCAB_FILE]
    assert Vocabularies.load(shared_dir).shared


def test_missing_or_ambiguous_files_are_named(separate, tmp_path):
    with pytest.raises(FileNotFoundError, match=SHARED_VOCAB_FILE):
        Vocabularies.load(tmp_path)
    separate.source.save(tmp_path / SOURCE_VOCAB_FILE)
    assert not Vocabularies.exists(tmp_path)
    with pytest.raises(FileNotFoundError, match=TARGET_VOCAB_FILE):
        Vocabularies.load(tmp_path)
    separate.target.save(tmp_path / SHARED_VOCAB_FILE)
    with pytest.raises(FileNotFoundError, match="both a shared vocabulary"):
        Vocabularies.load(tmp_path)


def test_each_side_is_encoded_with_its_vocabulary(separate):
    split = [{"source": s, "target": t} for s, t in zip(SOURCES[:20], TARGETS[:20])]
    tokenized = batching.tokenize_split(split, separate, max_source_len=32, max_target_len=32)
    for i, example in enumerate(split):
        want_src = separate.source.encode(example["source"]) + [EOS_ID]
        want_tgt = separate.target.encode(example["target"]) + [EOS_ID]
        np.testing.assert_array_equal(tokenized.sources[i], want_src)
        np.testing.assert_array_equal(tokenized.targets[i], want_tgt)


def _separate_config(tfds_dir, **train):
    config = tiny_config(tfds_dir, **train)
    config.data.shared_vocab = False
    config.data.target_vocab_size = 80
    config.model.share_embeddings = False
    return config


def test_shared_embeddings_with_separate_vocabularies_is_refused(tfds_dir, tmp_path):
    from flaxformer_lite.training import loop

    config = _separate_config(tfds_dir)
    config.model.share_embeddings = True
    with pytest.raises(ConfigError, match="share_embeddings=False"):
        loop.train_and_evaluate(parse(config), str(tmp_path / "run"), log=lambda s: None)
    config = tiny_config(tfds_dir)
    config.data.target_vocab_size = 80
    with pytest.raises(ConfigError, match="shared_vocab=False"):
        loop.train_and_evaluate(parse(config), str(tmp_path / "run"), log=lambda s: None)
    assert not os.path.exists(tmp_path / "run")


def test_training_and_decoding_with_separate_vocabularies(tfds_dir, tmp_path, monkeypatch):
    from flaxformer_lite.training import load_state, loop
    from flaxformer_lite.translate import runner

    workdir = str(tmp_path / "run")
    config = _separate_config(tfds_dir, num_steps=10, checkpoint_every=10)
    results = loop.train_and_evaluate(parse(config), workdir, log=lambda s: None)
    assert results["step"] == 10
    assert {SOURCE_VOCAB_FILE, TARGET_VOCAB_FILE} <= set(os.listdir(workdir))
    assert SHARED_VOCAB_FILE not in os.listdir(workdir)

    run_config, vocab = runner.open_workdir(workdir)
    model, state, restored_vocab, _ = load_state.restore_trained(workdir)
    assert restored_vocab == vocab and not vocab.shared
    source_size, target_size = vocab.source.vocab_size, vocab.target.vocab_size
    assert source_size != target_size
    assert run_config.model.vocab_size == source_size
    assert run_config.model.target_vocab_size == target_size
    embeddings = state.params
    rows = model.config.padded  # the stored rows (`nn/vocab.py`)
    assert embeddings["source_embedding"]["embedding"].shape == (rows(source_size), 32)
    assert embeddings["target_embedding"]["embedding"].shape == (rows(target_size), 32)

    search = runner.make_search(run_config, beam_size=1)
    result = runner.decode_lines(
        model, state.params, vocab, run_config, ["en 12", "", "de 7"], search=search
    )
    assert len(result.texts) == 3 and result.texts[1] == ""
    assert result.output_ids[0] and max(result.output_ids[0]) < target_size

    # Hypotheses are decoded with the TARGET vocabulary: feed the runner ids
    # whose pieces differ between the two vocabularies and read the text back.
    common = range(4, min(source_size, target_size))  # past PAD, UNK, BOS, EOS
    chosen = [i for i in common if vocab.source.id_to_piece(i) != vocab.target.id_to_piece(i)][:4]
    assert len(chosen) == 4
    calls = []

    def fake_decode(model, params, inputs, *, search, **kw):
        calls.append(inputs.shape)
        tokens = np.zeros((inputs.shape[0], 1, search.max_len), np.int32)
        tokens[:, 0, : len(chosen) + 1] = chosen + [EOS_ID]
        return tokens, np.zeros((inputs.shape[0], 1), np.float32)

    monkeypatch.setattr(runner.predict, "decode", fake_decode)
    faked = runner.decode_lines(model, state.params, vocab, run_config, ["en 12"], search=search)
    assert calls and faked.output_ids == [chosen + [EOS_ID]]
    # The target text, spelled from the target's pieces (SentencePiece's word marker).
    spelled = "".join(vocab.target.id_to_piece(i) for i in chosen).replace("\u2581", " ").strip()
    assert faked.texts[0] == vocab.target.decode(chosen) == spelled
    assert faked.texts[0] != vocab.source.decode(chosen)

    # The same workdir with a shared-vocabulary config is refused, not reinterpreted.
    with pytest.raises(ConfigError, match="separate vocabularies"):
        loop.train_and_evaluate(
            parse(tiny_config(tfds_dir, num_steps=20)), workdir, log=lambda s: None
        )
