"""Exported models (CTranslate2, Hugging Face Marian) compute what ours computes.

Two ways of computing the same numbers: our `score` / logits / searches against the
engine's, on a trained tiny workdir (real text, `export.py` end to end) and on
randomly perturbed parameters of the variants the workdir does not cover (pre-LN,
separate vocabularies of different sizes, an untied output layer with its bias, gelu,
learned positions, d_kv, scanned layers). Skipped without the `export` extras.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_config, tiny_model_config

from flaxformer_lite.cli import export as export_cli
from flaxformer_lite.config.run import RunConfig, parse
from flaxformer_lite.config.variants import CopyHead, NATConfig
from flaxformer_lite.export import int8_check, layout, parity
from flaxformer_lite.models import from_config

ctranslate2 = pytest.importorskip("ctranslate2")

TOLERANCE = 1e-4  # fp32 |log p| difference
LINES = [f"{lang} {n}" for lang in ("en", "de") for n in (3, 17, 42, 58, 80, 99, 7, 61)]


def _has_marian() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


needs_marian = pytest.mark.skipif(not _has_marian(), reason="needs torch and transformers")


@pytest.fixture(scope="module")
def workdir(tfds_dir, tmp_path_factory):
    from flaxformer_lite.training import loop

    path = str(tmp_path_factory.mktemp("export") / "run")
    config = tiny_config(tfds_dir, num_steps=80, checkpoint_every=40)
    config.model.layer_norm_epsilon = 1e-5  # Marian's fixed epsilon: both engines apply
    loop.train_and_evaluate(parse(config), path, log=lambda s: None)
    return path


@pytest.fixture(scope="module")
def trained(workdir):
    from flaxformer_lite.training import restore
    from flaxformer_lite.translate import runner

    run_config, vocab = runner.open_workdir(workdir)
    params, _ = restore.restore_params(workdir)
    return from_config.build_model(run_config), params, vocab, run_config


def _export(workdir, to, out, *flags):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "export.py"), "--workdir", workdir, "--to", to]
        + ["--out", str(out), *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    return proc


def _export_here(workdir, to, out, **options):
    """export.py's work in this process, which has compiled our side of the parity check
    already (export.py itself runs in test_ctranslate2_int8_without_vnni_warns_and_names_the_fix,
    test_marian_export_end_to_end and the refusals). Returns the manifest and the log."""
    lines = []
    o = export_cli.Options(workdir=workdir, to=to, out=str(out), **options)
    manifest = export_cli.export(o, log=lines.append)
    return manifest, "\n".join(lines)


@pytest.fixture(scope="module")
def ct2_dir(workdir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ct2") / "model"
    _export_here(workdir, "ctranslate2", out)
    return str(out)


def _pairs(vocab, lines):
    """Real (source ids, target ids) pairs: the source lines and their spelled-out numbers."""
    from num2words import num2words

    pairs = []
    for line in lines:
        lang, n = line.split()
        pairs.append((vocab.source.encode(line), vocab.target.encode(num2words(int(n), lang=lang))))
    return pairs


def _ours_vs(model, params, pairs, got):
    want = parity.ours(model, params, [p[0] for p in pairs], [p[1] for p in pairs])
    return parity.max_difference(want, got)


def test_ctranslate2_scores_equal_ours_on_real_pairs(trained, ct2_dir):
    model, params, vocab, _ = trained
    pairs = _pairs(vocab, LINES)
    translator = ctranslate2.Translator(ct2_dir, device="cpu")
    src = [vocab.source.encode_with_pieces(line)[1] for line in LINES]
    tgt = [[vocab.target.id_to_piece(i) for i in t] for _, t in pairs]
    got = parity.ctranslate2_scores(translator, src, tgt, None, None)
    assert _ours_vs(model, params, pairs, got) < TOLERANCE
    with open(os.path.join(ct2_dir, export_cli.MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["max_logprob_difference"] < TOLERANCE and manifest["step"] == 80
    assert os.path.exists(os.path.join(ct2_dir, "vocab.spm"))


@pytest.mark.parametrize("beam", [1, 4])
def test_ctranslate2_search_outputs_equal_ours(trained, ct2_dir, beam):
    """Greedy, and beam 4 without a length penalty (the two engines normalise lengths
    differently; without one both rank by the summed log-probability)."""
    import sentencepiece as spm

    from flaxformer_lite.translate import runner

    model, params, vocab, run_config = trained
    search = runner.make_search(run_config, beam_size=beam, alpha=0.0)
    ours = runner.decode_lines(model, params, vocab, run_config, LINES, search=search).texts
    sp = spm.SentencePieceProcessor(model_file=os.path.join(ct2_dir, "vocab.spm"))
    translator = ctranslate2.Translator(ct2_dir, device="cpu")
    results = translator.translate_batch(
        [sp.encode(line, out_type=str) for line in LINES],
        beam_size=beam,
        length_penalty=0.0,
        max_decoding_length=run_config.data.max_target_len,
    )
    theirs = [sp.decode(r.hypotheses[0]) for r in results]
    assert theirs == ours


# The int8 kernels of a CPU without VNNI (AVX2-only AMD EPYC, older Xeons), on any x86
# CPU: both GEMM backends capped at AVX2, oneDNN chosen (CTranslate2's choice on AMD).
NO_VNNI = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "CT2_USE_MKL": "0"}


def _int8_difference(model, params, vocab, directory):
    pairs = _pairs(vocab, LINES)
    translator = ctranslate2.Translator(str(directory), device="cpu", compute_type="int8")
    src = [[vocab.source.id_to_piece(i) for i in s] for s, _ in pairs]
    tgt = [[vocab.target.id_to_piece(i) for i in t] for _, t in pairs]
    got = parity.ctranslate2_scores(translator, src, tgt, None, None)
    return _ours_vs(model, params, pairs, got)


def test_ctranslate2_int8_reports_what_this_machine_computes(workdir, trained, tmp_path):
    """On whatever CPU runs this: the export measures the int8 model where it runs, writes
    that figure, and warns exactly when it is far; 7-bit weights are close here."""
    model, params, vocab, _ = trained
    out = tmp_path / "int8"
    _, logged = _export_here(workdir, "ctranslate2", out, quantization="int8")
    with open(out / export_cli.MANIFEST) as f:
        manifest = json.load(f)
    assert manifest["quantization"] == "int8" and manifest["int8_weight_bits"] == 8
    assert manifest["ct2_int8_backend"] != "backend not reported"
    # The probe pairs differ from LINES, so the two figures need not be equal; both are
    # quantized (> fp32 tolerance), and they agree on being near or far.
    ours = _int8_difference(model, params, vocab, out)
    assert ours > TOLERANCE and manifest["max_logprob_difference"] > TOLERANCE
    far = manifest["max_logprob_difference"] > int8_check.INT8_WARNING
    assert far == ("warning:" in logged) == manifest.get("int8_warning", False)
    assert "int8 on this machine: max |log p difference|" in logged

    seven = tmp_path / "int8_7bit"
    _, logged = _export_here(workdir, "ctranslate2", seven, quantization="int8", int8_weight_bits=7)
    assert "warning:" not in logged
    assert TOLERANCE < _int8_difference(model, params, vocab, seven) < int8_check.INT8_WARNING


@pytest.mark.parametrize("bits", [8, 7])
def test_int8_weights_within_their_range(trained, bits):
    """Every quantized weight lies within +-(2**(bits-1) - 1) and dequantizes to the float
    weight within half a step; 8 bits is CTranslate2's own quantization."""
    from ctranslate2.specs import model_spec

    from flaxformer_lite.export import to_ctranslate2

    model, params, vocab, run_config = trained
    cfg = model.config
    pieces = [vocab.source.id_to_piece(i) for i in range(vocab.source.vocab_size)]

    def spec(quantization=None):
        built = to_ctranslate2.build_spec(layout.model_layout(params, cfg, 64), pieces, pieces)
        built.validate()
        built.optimize(quantization)  # CTranslate2's converter: aliases, then quantization
        return built

    def arrays(of):
        into = {}

        def keep(_, name, value):
            if isinstance(value, model_spec.Variable) and not value.is_scalar():
                into[name] = np.array(value.numpy())

        model_spec.visit_spec(of, keep)
        return into

    floats = arrays(spec())
    if bits == 8:
        quantized = arrays(spec("int8"))
    else:
        seven = spec()
        int8_check.quantize_weights(seven, bits)
        quantized = arrays(seven)
    scales = {n[: -len("_scale")]: v for n, v in quantized.items() if n.endswith("_scale")}
    assert scales  # the linear layers and embeddings
    for name, scale in scales.items():
        q = quantized[name]
        assert q.dtype == np.int8 and np.abs(q.astype(np.int32)).max() == 2 ** (bits - 1) - 1
        back = q.reshape(len(q), -1) / scale[:, None]
        step = 1.0 / scale[:, None]
        assert np.all(np.abs(back - floats[name].reshape(len(q), -1)) <= 0.5 * step + 1e-7)


def test_ctranslate2_int8_without_vnni_warns_and_names_the_fix(workdir, tmp_path):
    """A CPU without VNNI saturates u8 x s8 pairs: the export says so with the difference it
    measured, and the measured alternative that brings it back (7-bit weights)."""
    out = tmp_path / "int8"
    env = {**os.environ, **NO_VNNI}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "export.py"), "--workdir", workdir]
        + ["--to", "ctranslate2", "--out", str(out), "--quantization", "int8"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr  # written as asked, with the warning
    warning = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1, proc.stderr
    with open(out / export_cli.MANIFEST) as f:
        manifest = json.load(f)
    difference = manifest["max_logprob_difference"]
    assert difference > int8_check.INT8_WARNING
    assert f"{difference:.3g}" in warning[0] and "DNNL" in manifest["ct2_int8_backend"]
    tried = {t["setting"]: t["difference"] for t in manifest["int8_alternatives"]}
    assert set(tried) == {"CT2_USE_MKL=1", "--int8_weight_bits 7"}
    assert TOLERANCE < tried["--int8_weight_bits 7"] <= int8_check.INT8_WARNING
    assert f"--int8_weight_bits 7 ({tried['--int8_weight_bits 7']:.3g})" in warning[0]


def _variant(seed=0, **overrides):
    """A model config, its protocol model and perturbed parameters (no bias is zero)."""
    from flaxformer_lite.models.autoregressive import AutoregressiveModel

    cfg = tiny_model_config(**overrides)
    model = AutoregressiveModel(cfg)
    import flax.linen as nn

    boxed = model.init(jax.random.PRNGKey(seed), {"inputs": (1, 8), "targets": (1, 8)})
    params = nn.meta.unbox(boxed)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    noisy = [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return cfg, model, jax.tree.unflatten(tree, noisy)


def _random_pairs(cfg, count=6, seed=0):
    rng = np.random.default_rng(seed)
    target_vocab = cfg.output_vocab_size
    return [
        (
            rng.integers(4, cfg.vocab_size, 2 + 3 * i).tolist(),
            rng.integers(4, target_vocab, 1 + 2 * i).tolist(),
        )
        for i in range(count)
    ]


def _pieces(n, prefix):
    return ["<pad>", "<unk>", "<s>", "</s>"] + [f"{prefix}{i}" for i in range(4, n)]


VARIANTS = {
    "post_shared": {},
    "pre_ln": dict(norm="pre"),
    "separate_sizes": dict(share_embeddings=False, target_vocab_size=37),
    "untied_gelu": dict(tie_output_embedding=False, activation="gelu"),
    "learned_dkv": dict(positions="learned", d_kv=12, max_len=64),
    "scanned_pre": dict(norm="pre", scan_layers=True, layer_norm_epsilon=1e-5),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ctranslate2_variant_scores_equal_ours(name, tmp_path):
    from flaxformer_lite.export import to_ctranslate2

    cfg, model, params = _variant(**VARIANTS[name])
    lay = layout.model_layout(params, cfg, position_rows=64)
    to_ctranslate2.save(
        lay, _pieces(cfg.vocab_size, "s"), _pieces(cfg.output_vocab_size, "t"), str(tmp_path)
    )
    translator = ctranslate2.Translator(str(tmp_path), device="cpu")
    pairs = _random_pairs(cfg)
    src = [[f"s{i}" for i in s] for s, _ in pairs]
    tgt = [[f"t{i}" for i in t] for _, t in pairs]
    got = parity.ctranslate2_scores(translator, src, tgt, None, None)
    assert _ours_vs(model, params, pairs, got) < TOLERANCE


def _our_logits(cfg, params, pairs):
    from flaxformer_lite.constants import BOS_ID, EOS_ID
    from flaxformer_lite.models.transformer import Transformer

    inputs = parity.padded([[*s, EOS_ID] for s, _ in pairs])
    decoder_inputs = parity.padded([[BOS_ID, *t] for _, t in pairs])
    logits = np.asarray(Transformer(cfg).apply({"params": params}, inputs, decoder_inputs))
    return [logits[i, : len(t) + 1] for i, (_, t) in enumerate(pairs)]


@needs_marian
@pytest.mark.parametrize(
    "overrides",
    [
        dict(layer_norm_epsilon=1e-5),
        dict(layer_norm_epsilon=1e-5, share_embeddings=False, target_vocab_size=37),
        dict(layer_norm_epsilon=1e-5, tie_output_embedding=False, activation="gelu"),
    ],
    ids=["shared", "separate_sizes", "untied_gelu"],
)
def test_marian_logits_equal_ours(overrides):
    from flaxformer_lite.export import to_huggingface

    cfg, model, params = _variant(**overrides)
    marian = to_huggingface.build_model(layout.model_layout(params, cfg), max_positions=64)
    pairs = _random_pairs(cfg)
    scores, logits = parity.marian_scores(marian, [s for s, _ in pairs], [t for _, t in pairs])
    assert _ours_vs(model, params, pairs, scores) < TOLERANCE
    for theirs, ours in zip(logits, _our_logits(cfg, params, pairs), strict=True):
        np.testing.assert_allclose(theirs[:, : cfg.output_vocab_size], ours, atol=TOLERANCE)
        assert np.all(theirs[:, cfg.output_vocab_size :] < -1e8)  # padding never wins


@needs_marian
def test_marian_export_end_to_end(workdir, trained, tmp_path):
    """export.py --to hf; the saved model and tokenizer reload and decode as ours."""
    from transformers import MarianMTModel, MarianTokenizer

    from flaxformer_lite.translate import runner

    proc = _export(workdir, "hf", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    model, params, vocab, run_config = trained
    marian = MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    tokenizer = MarianTokenizer.from_pretrained(tmp_path / "hf")
    batch = tokenizer(LINES, return_tensors="pt", padding=True)
    for line, ids in zip(LINES, batch["input_ids"].tolist(), strict=True):
        assert [i for i in ids if i] == [*vocab.source.encode(line), 3]  # same ids as ours
    max_len = run_config.data.max_target_len
    generated = marian.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=max_len)
    theirs = tokenizer.batch_decode(generated, skip_special_tokens=True)
    search = runner.make_search(run_config, beam_size=1)
    ours = runner.decode_lines(model, params, vocab, run_config, LINES, search=search).texts
    assert theirs == ours


@needs_marian
@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(norm="pre", layer_norm_epsilon=1e-5), "model.norm"),
        (dict(), "model.layer_norm_epsilon"),
        (dict(positions="learned", layer_norm_epsilon=1e-5), "model.positions"),
    ],
)
def test_marian_refuses_what_it_cannot_compute(overrides, field):
    from flaxformer_lite.export import to_huggingface

    with pytest.raises(layout.ExportError, match=field):
        to_huggingface.check_representable(tiny_model_config(**overrides))


def test_export_of_an_earlier_step(workdir, tmp_path):
    """--step picks the checkpoint; the export checks itself against that step's model."""
    _export_here(workdir, "ctranslate2", tmp_path / "s40", step="40", probes=4)
    with open(tmp_path / "s40" / export_cli.MANIFEST) as f:
        manifest = json.load(f)
    assert manifest["step"] == 40 and manifest["max_logprob_difference"] < TOLERANCE
    proc = _export(workdir, "ctranslate2", tmp_path / "s7", "--step", "7")
    assert proc.returncode == 2 and "--step 7" in proc.stderr and "40, 80" in proc.stderr
    assert not os.path.exists(tmp_path / "s7")


def test_refusals_are_one_line(workdir, ct2_dir, tmp_path):
    proc = _export(workdir, "ctranslate2", ct2_dir)  # not empty: never written over
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ")
    assert "already exists" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = _export(workdir, "ctranslate2", tmp_path / "q", "--quantization", "int3")
    assert proc.returncode == 2 and "int3" in proc.stderr and not os.path.exists(tmp_path / "q")
    plain = RunConfig(model=tiny_model_config())
    for run_config, what in (
        (dataclasses.replace(plain, nat=NATConfig()), "nat"),
        (dataclasses.replace(plain, copy=CopyHead()), "copy"),
    ):
        with pytest.raises(layout.ExportError, match=what):
            layout.check_exportable(run_config, "CTranslate2")
    features = RunConfig(model=tiny_model_config(input_features=8))
    with pytest.raises(layout.ExportError, match="input_features"):
        layout.check_exportable(features, "CTranslate2")


def test_compare_benchmark_times_every_engine_on_equal_work():
    """bench.py --compare ctranslate2's figures, at a size that runs in seconds."""
    from flaxformer_lite.benchmarks import engine_compare

    cfg = tiny_model_config(vocab_size=40, dropout_rate=0.0)
    out = engine_compare.compare_decode_benchmark(
        cfg, batch_sizes=(1, 3), source_len=6, new_tokens=5, beam_size=2, repeats=1, log=print
    )
    rows = out["rows"]
    assert [(r["search"], r["batch"]) for r in rows] == [
        ("greedy", 1), ("greedy", 3), ("beam2", 1), ("beam2", 3)
    ]  # fmt: skip
    for r in rows:
        for name in engine_compare.ENGINES:
            assert r[f"{name}_s"] > 0
            assert r[f"{name}_tokens_per_s"] == pytest.approx(r["batch"] * 5 / r[f"{name}_s"])
        assert r["ct2_fp32_over_ours"] == pytest.approx(r["ours_fp32_s"] / r["ct2_fp32_s"])


def test_compare_file_bleu_scores_the_same_outputs(workdir, tmp_path):
    """Greedy CTranslate2 fp32 output is ours line for line, so BLEU is equal too; ours with
    continuous batching gives the same lines as ours in padded batches."""
    from num2words import num2words

    from flaxformer_lite.benchmarks import engine_compare

    source, reference = tmp_path / "src", tmp_path / "ref"
    source.write_text("\n".join(LINES) + "\n")
    words = [num2words(int(n), lang=lang) for lang, n in (line.split() for line in LINES)]
    reference.write_text("\n".join(words) + "\n")
    out = engine_compare.file_bleu(workdir, str(source), str(reference), beam_size=2)
    assert out["greedy_batch32_ct2_fp32"]["same_as_ours"] == 1.0
    assert out["greedy_batch32_ct2_fp32"]["bleu"] == out["greedy_batch32_ours_fp32"]["bleu"]
    for search in ("greedy", "beam2"):
        assert out[f"{search}_batch32_ours_continuous"]["same_as_ours"] == 1.0
    engines = (*engine_compare.ENGINES, "ours_continuous")
    want = {f"{s}_batch32_{e}" for s in ("greedy", "beam2") for e in engines}
    assert set(out) == want
