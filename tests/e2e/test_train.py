"""Training end to end in-process: learning, resuming, and refusing foreign workdirs."""

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import TRAINED_TINY_STEPS, tiny_config

from flaxformer_lite.config.run import parse
from flaxformer_lite.training import checkpoint_format, checkpoints, loop
from flaxformer_lite.training.checkpoint_format import CheckpointIntegrityError
from flaxformer_lite.training.workdir import WorkdirError


def _train_records(workdir, split="train"):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


def test_tiny_config_learns(tfds_dir, tmp_path):
    config = tiny_config(tfds_dir, num_steps=300, log_every=25, exposure_report=True)
    config.optim.learning_rate = 5e-3
    logs = []
    results = loop.train_and_evaluate(parse(config), str(tmp_path / "run"), log=logs.append)
    records = _train_records(tmp_path / "run")
    first, last = records[0]["nll"], records[-1]["nll"]
    assert last < 0.25 * first, (first, last)
    assert results["step"] == 300
    assert results["validation_token_accuracy"] > 0.5
    for key in ("test_exact_match", "test_loss", "test_perplexity", "validation_nll"):
        assert key in results
    assert records[-1]["tokens_per_sec"] > 0
    # The exposure-bias report of every evaluation: metrics.jsonl and a table at the end.
    (test,) = _train_records(tmp_path / "run", "test")
    assert test["eb_tf_token_accuracy"] == pytest.approx(test["token_accuracy"])
    assert 0 < test["eb_fr_token_accuracy"] <= test["eb_tf_token_accuracy"]
    assert test["eb_prefix_n_k1"] > 0 and test["eb_prefix_ratio_k1"] > 0
    assert results["test_eb_accuracy_gap"] == pytest.approx(test["eb_accuracy_gap"])
    errors = test["eb_first_error_hist"]  # examples per first-error position
    assert len(errors) == 16 and sum(errors) == round(20 * (1 - test["exact_match"]))
    (table,) = [m for m in logs if m.startswith("test exposure bias report:")]
    assert "prefix swap" in table and "by length" in table
    (shown,) = [m for m in logs if m.startswith("step 300 test:")]
    assert "eb_accuracy_gap=" in shown and "eb_prefix" not in shown  # details: jsonl only


def test_checkpoints_store_the_data_iterator_state(trained_tiny, tfds_dir, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(trained_tiny, workdir)
    ckpt = checkpoints.Checkpointer(workdir, keep=5, save_every=0)
    data = ckpt.read_meta(TRAINED_TINY_STEPS)["data"]
    ckpt.close()
    assert data["next_batch"] == TRAINED_TINY_STEPS
    assert data["identity"]["train_examples"] == 160 and data["identity"]["batch_size"] == 16
    # Resuming with batches of another size is allowed, with a warning saying what changed.
    messages = []
    config = tiny_config(tfds_dir, num_steps=TRAINED_TINY_STEPS + 2, batch_size=32)
    loop.train_and_evaluate(parse(config), workdir, log=messages.append)
    warnings = [m for m in messages if m.startswith("warning: the training data changed")]
    assert len(warnings) == 1 and "batch_size: 16 -> 32" in warnings[0], messages


def test_workdir_with_other_model_is_refused_and_kept(trained_tiny, tfds_dir, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(trained_tiny, workdir)
    before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    other = tiny_config(tfds_dir, num_steps=TRAINED_TINY_STEPS + 10)
    other.model.d_ff = 128
    with pytest.raises(WorkdirError, match="d_ff"):
        loop.train_and_evaluate(parse(other), workdir, log=lambda s: None)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before


def test_foreign_directory_is_refused(tfds_dir, tmp_path):
    workdir = tmp_path / "mine"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("precious")
    with pytest.raises(WorkdirError, match="not empty"):
        loop.train_and_evaluate(parse(tiny_config(tfds_dir)), str(workdir), log=lambda s: None)
    assert (workdir / "notes.txt").read_text() == "precious"
    assert sorted(os.listdir(workdir)) == ["notes.txt"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(WorkdirError, match="is a file"):
        loop.train_and_evaluate(parse(tiny_config(tfds_dir)), str(a_file), log=lambda s: None)


def test_corrupted_checkpoint_is_detected(tmp_path):
    state = {"w": jax.numpy.arange(6.0), "b": jax.numpy.ones(2)}
    ckpt = checkpoints.Checkpointer(str(tmp_path), keep=2, save_every=1)
    ckpt.save(1, state, {"note": "x"})
    ckpt.wait()
    restored, meta = ckpt.restore(state)
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert meta["step"] == 1
    # Step 2 written behind the checkpointer's back, with orbax alone: a different array of
    # the same structure under step 1's checksums, as a silent bit flip would leave it.
    with ocp.CheckpointManager(
        ckpt.directory, item_names=(checkpoint_format.STATE_ITEM, checkpoint_format.META_ITEM)
    ) as foreign:
        foreign.save(
            2,
            args=ocp.args.Composite(
                **{
                    checkpoint_format.STATE_ITEM: ocp.args.StandardSave(
                        {"w": state["w"].at[3].set(7.0), "b": state["b"]}
                    ),
                    checkpoint_format.META_ITEM: ocp.args.JsonSave(meta | {"step": 2}),
                }
            ),
        )
    with pytest.raises(CheckpointIntegrityError, match="corrupted"):
        ckpt.restore(state, 2)
    ckpt.close()


@pytest.mark.parametrize("batching", ["bucket", "pack"])
def test_local_corpus_with_bucketed_or_packed_batches(tfds_dir, tmp_path, monkeypatch, batching):
    """A user's {split}.{lang} files train end to end and are scored with BLEU."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = ["red", "blue", "green", "cat", "dog", "big", "small", "runs", "sleeps", "the"]
    german = ["rot", "blau", "grün", "Katze", "Hund", "groß", "klein", "läuft", "schläft", "die"]
    rng = np.random.default_rng(0)
    for split, n in (("train", 120), ("dev", 12)):
        src, tgt = [], []
        for _ in range(n):
            idx = rng.integers(0, len(words), rng.integers(2, 7))
            src.append(" ".join(words[i] for i in idx))
            tgt.append(" ".join(german[i] for i in idx))
        (corpus / f"{split}.en").write_text("\n".join(src) + "\n")
        (corpus / f"{split}.de").write_text("\n".join(tgt) + "\n")
    config = tiny_config(tfds_dir, num_steps=40, eval_bleu=True)
    d = config.data
    d.dataset, d.parallel_text.corpus_dir = "parallel_text", str(corpus)
    d.source_lang, d.target_lang = "en", "de"
    d.split_names = {"validation": "dev"}
    d.batching, d.max_tokens = batching, 64
    messages = []
    workdir = str(tmp_path / "run")
    results = loop.train_and_evaluate(parse(config), workdir, log=messages.append)
    assert results["step"] == 40
    assert "test_loss" not in results  # the corpus has no test split
    assert any(f"train batches: {batching}" in m for m in messages)
    assert any("signature nrefs:1" in m for m in messages)
    assert "validation bleu_tok: BLEU4 on lowercased Moses-tokenized text" in "\n".join(messages)
    train = _train_records(workdir)
    assert train[-1]["loss"] < train[0]["loss"] - 1.0, train  # it learns (4.1 -> 2.6)
    # The run's validation BLEU and chrF are decode.py's on the same files with the same
    # (greedy) search: evaluation's fixed batches and the file decoder's length buckets
    # decode alike, and both score the detokenized text with sacreBLEU.
    from flaxformer_lite.cli import decode as decode_cli

    assert config.train.eval_search == "greedy"
    logged = []
    monkeypatch.setattr(decode_cli, "log", logged.append)
    decode_cli.run(
        decode_cli.Options(
            workdir=workdir,
            input=str(corpus / "dev.en"),
            output=str(tmp_path / "dev.out"),
            reference=str(corpus / "dev.de"),
            beam_size=1,
        )
    )
    (line,) = [m for m in logged if m.startswith("BLEU|")]
    bleu, chrf = (float(part.split(" = ")[1].split()[0]) for part in line.split("\n"))
    assert results["validation_chrf"] > 10
    assert bleu == pytest.approx(results["validation_bleu"], abs=0.005)
    assert chrf == pytest.approx(results["validation_chrf"], abs=0.005)
    # So is the tokenized BLEU4, by the German rules of the run's data.target_lang.
    (line,) = [m for m in logged if m.startswith("tokenized BLEU4 = ")]
    assert line.endswith("lang de, normalized punctuation)")
    bleu_tok = float(line.split(" = ")[1].split(",")[0])
    assert bleu_tok == pytest.approx(results["validation_bleu_tok"], abs=0.005)
