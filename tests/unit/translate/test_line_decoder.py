"""translate/line_decoder.py, word_alignment.py and interactive.py on the tiny trained
workdir: records for every line, alignments batched == one line at a time, interactive
answers == a whole file's."""

import dataclasses
import functools
import io
import json

import jax
import numpy as np
import pytest
from flax.core import meta

from flaxformer_lite.config.variants import CopyHead, NATConfig
from flaxformer_lite.data.tokenizer import Vocabularies
from flaxformer_lite.models import from_config
from flaxformer_lite.translate import interactive, line_io, records, runner, word_alignment
from flaxformer_lite.translate.line_decoder import LineDecoder

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Normal lines, a blank line, CRLF, an over-long line, invalid UTF-8, no final newline.
MIXED = b"en 12\n\nde 45\r\nen " + b"1" * 200 + b"\nde \xff\xfe 3\n   \nen 7"
NUMBERS = [f"{'en' if i % 2 else 'de'} {str(7 * i + 1) * (1 + i % 7)}"[:10] for i in range(21)]


@pytest.fixture(scope="module")
def loaded(trained_tiny):
    from flaxformer_lite.training import restore

    run_config, vocab = runner.open_workdir(trained_tiny)
    params, _ = restore.restore_params(trained_tiny, None, log=lambda s: None)
    return from_config.build_model(run_config), params, vocab, run_config


def _decoder(loaded, *, beam_size=2, nbest=2, layer=-1, **kw):
    model, params, vocab, run_config = loaded
    search = runner.make_search(
        run_config, beam_size=beam_size, nbest=nbest, max_len=kw.pop("max_len", None)
    )
    return LineDecoder(
        model, params, vocab, run_config, search, nbest=nbest, alignment_layer=layer, **kw
    )


def _source_words(vocab, ids):
    return word_alignment.token_words(ids, vocab.source.id_to_piece)


def test_every_hypothesis_word_is_aligned_within_range(loaded):
    decoder = _decoder(loaded, batch_size=4)
    lines, _ = line_io.read_lines(io.BytesIO(MIXED))
    decoded, result = decoder.decode(lines)
    assert [d.number for d in decoded] == list(range(1, 8))
    assert decoded[1].hypotheses == decoded[5].hypotheses == ()
    for d, ids in zip(decoded, result.sources.ids):
        if not ids:
            continue
        num_source_words = max(w for w in _source_words(loaded[2], ids) if w is not None) + 1
        assert len(d.hypotheses) == 2
        for h in d.hypotheses:
            num_words = len(h.text.split())
            assert max(word_alignment.piece_words(h.tokens), default=-1) + 1 == num_words
            assert {j for _, j in h.alignment} == set(range(num_words)), (h, d.source)
            assert all(0 <= i < num_source_words for i, _ in h.alignment)
            assert list(h.alignment) == sorted(set(h.alignment))


@functools.partial(jax.jit, static_argnames=("model", "name"))
def _attention(model, params, batch, name):
    return model.attention_weights(params, batch, (name,))[name]


def _alone(model, params, vocab, source_ids, hypothesis_ids, layer):
    """The pairs of one hypothesis from its own unpadded teacher-forced pass."""
    name = f"decoder/cross/{layer}"
    batch = {"inputs": np.array([source_ids]), "targets": np.array([hypothesis_ids])}
    weights = _attention(model, params, batch, name)[0]  # [N, T, S]
    target_words = word_alignment.token_words(hypothesis_ids, vocab.target.id_to_piece)
    return word_alignment.align_attention(weights, _source_words(vocab, source_ids), target_words)


def test_batched_alignments_equal_each_hypothesis_aligned_alone(loaded, layer=-1):
    # (The tiny workdir has one decoder layer: -1 and 0 name the same one.)
    model, params, vocab, _ = loaded
    # 10 lines, 3 a batch: both source buckets, and a last batch padded with empty rows.
    decoded, result = _decoder(loaded, batch_size=3, layer=layer).decode(NUMBERS[:10])
    assert len(result.batch_shapes) == 2
    for d, ids, hyps in zip(decoded, result.sources.ids, result.nbest_ids):
        for h, hyp in zip(d.hypotheses, hyps):
            assert h.alignment == _alone(model, params, vocab, ids, hyp, layer)


def test_alignment_compiles_once_per_batch_shape(loaded, no_compilation_cache):
    compiled = []

    def listener(event, seconds, **kw):
        if event == BACKEND_COMPILE_EVENT and kw.get("fun_name") == "jit(_best_in_batch)":
            compiled.append(seconds)

    # A max_len no other test uses, so every compilation of this pass happens here.
    decoder = _decoder(loaded, beam_size=1, nbest=1, batch_size=4, max_len=11)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        _, result = decoder.decode(NUMBERS)
        decoder.decode(NUMBERS[::-1])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(result.batch_shapes) == 2  # both source buckets of the tiny model
    assert len(compiled) == len(result.batch_shapes), compiled


def test_interactive_answers_equal_a_whole_files(loaded):
    decoder = _decoder(loaded, beam_size=2, nbest=2)
    lines, _ = line_io.read_lines(io.BytesIO(MIXED))
    whole, _ = decoder.decode(lines)
    for output_format in records.FORMATS:
        out, logged = io.BytesIO(), []
        count = interactive.serve(
            decoder, io.BytesIO(MIXED), out, output_format=output_format, log=logged.append
        )
        answers = out.getvalue().decode("utf-8").split("\n")
        assert count == len(lines) == len(answers) - 1 and answers[-1] == ""
        want = [records.format_record(d, output_format, 2) for d in whole]
        assert answers[:-1] == want
    assert logged == [
        "line 4: warning: 1 line(s) longer than 10 source tokens were truncated (--strict "
        "refuses them)",
        "line 5: warning: 1 line(s) had invalid UTF-8 or NUL bytes, replaced by U+FFFD",
        "line 5: warning: 1 line(s) contain characters unknown to the vocabulary (decoded as "
        "<unk>)",
    ]


def test_interactive_strict_refuses_one_line_and_answers_the_rest(loaded):
    decoder = _decoder(loaded, beam_size=1, nbest=1, strict=True, layer=None)
    out, logged = io.BytesIO(), []
    serve = interactive.serve
    assert serve(decoder, io.BytesIO(MIXED), out, output_format="jsonl", log=logged.append) == 7
    got = [json.loads(line) for line in out.getvalue().decode("utf-8").splitlines()]
    assert [r["line"] for r in got] == list(range(1, 8))
    assert got[3]["hypotheses"] == [] and "(line 4)" in got[3]["error"]
    assert all("error" not in r for i, r in enumerate(got) if i != 3)
    assert all(r["hypotheses"] for r in (got[0], got[2], got[4], got[6]))
    assert "alignment" not in got[0]["hypotheses"][0] and got[0]["hypotheses"][0]["score"] is None
    assert logged[0].startswith("error: 1 input line(s) exceed") and "(line 4)" in logged[0]


@pytest.mark.parametrize(
    "variant",
    [
        dict(nat=NATConfig(iterations=2, length_beam=2)),
        dict(copy=CopyHead()),
    ],
    ids=["nat", "copy"],
)
def test_other_model_kinds_align_through_the_protocol(loaded, variant):
    """A non-autoregressive model and a copy head (untrained parameters): one aligned
    record per line, every hypothesis word aligned, as for the plain model."""
    _, _, vocab, run_config = loaded
    run_config = dataclasses.replace(run_config, **variant)
    model = from_config.build_model(run_config)
    shapes = {"inputs": (1, 10), "targets": (1, 16)}
    params = meta.unbox(jax.jit(lambda key: model.init(key, shapes))(jax.random.PRNGKey(0)))
    if run_config.nat is not None:
        search = runner.make_nat_search(run_config, nbest=2)
    else:
        search = runner.make_search(run_config, beam_size=2, nbest=2)
    decoder = LineDecoder(model, params, vocab, run_config, search, nbest=2, alignment_layer=-1)
    decoded, _ = decoder.decode(["en 12", "", "de \u017d 45"])
    assert [len(d.hypotheses) for d in decoded] == [2, 0, 2]
    for h in decoded[0].hypotheses + decoded[2].hypotheses:
        words = {w for w in word_alignment.piece_words(h.tokens) if w is not None}
        assert {j for _, j in h.alignment} == words == set(range(len(words)))
    assert Vocabularies.of(vocab).shared


def test_alignment_is_refused_for_speech_and_for_a_layer_out_of_range(loaded):
    model, params, vocab, run_config = loaded
    search = runner.make_search(run_config, beam_size=1)
    with pytest.raises(line_io.InputError, match="--alignment_layer -2 is out of range for 1"):
        LineDecoder(model, params, vocab, run_config, search, alignment_layer=-2)
    speech = dataclasses.replace(run_config, model=run_config.model.replace(input_features=8))
    with pytest.raises(line_io.InputError, match="source is audio frames"):
        LineDecoder(model, params, vocab, speech, search, alignment_layer=-1)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_continuous_batching_gives_the_padded_batches_records(loaded, beam_size):
    """`--batching continuous` (the server's slot engine, 4 slots for 21 lines of many
    lengths) against padded batches: the same texts, ids, alignments and beam scores."""
    nbest = min(beam_size, 2)
    padded = _decoder(loaded, beam_size=beam_size, nbest=nbest, batch_size=4)
    slots = dataclasses.replace(padded, batching="continuous")
    want, want_result = padded.decode(NUMBERS + [""])
    got, got_result = slots.decode(NUMBERS + [""])
    assert len(got) == len(want) == len(NUMBERS) + 1
    assert got[-1].hypotheses == () and all(g.hypotheses for g in got[:-1])
    for g, w in zip(got, want, strict=True):
        assert [h.text for h in g.hypotheses] == [h.text for h in w.hypotheses]
        assert [h.alignment for h in g.hypotheses] == [h.alignment for h in w.hypotheses]
        if beam_size > 1:
            assert [h.score for h in g.hypotheses] == pytest.approx(
                [h.score for h in w.hypotheses], abs=1e-4
            )
    assert got_result.nbest_ids == want_result.nbest_ids


def test_continuous_batching_refuses_sampling(loaded):
    model, params, vocab, run_config = loaded
    search = runner.make_search(run_config, temperature=1.0)
    with pytest.raises(line_io.InputError, match="greedy or beam search"):
        LineDecoder(model, params, vocab, run_config, search, batching="continuous")
