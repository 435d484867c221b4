"""`--dry_run` parameter counts against the analytic count of the architecture."""

import pytest
from conftest import ROOT  # noqa: F401  (puts configs/ on the path)

from configs import default, wmt14_ende_base, wmt14_ende_big
from flaxformer_lite.config import run as run_config
from flaxformer_lite.training import dry_run


def analytic_count(m) -> int:
    """Parameters of the encoder-decoder as built here, from the config alone.

    Attention: W_Q, W_K, W_V [D, h*d_kv] + biases, W_O [h*d_kv, D] + bias.
    FFN: [D, F] + F, [F, D] + D. LayerNorm: 2D per sub-layer (+1 per stack if pre-LN).
    """
    d, f, inner = m.d_model, m.d_ff, m.num_heads * (m.d_kv or m.d_model // m.num_heads)
    attn = 3 * (d * inner + inner) + inner * d + d
    ffn = d * f + f + f * d + d
    enc_layer = attn + ffn + 2 * (2 * d)
    dec_layer = 2 * attn + ffn + 3 * (2 * d)
    total = m.num_encoder_layers * enc_layer + m.num_decoder_layers * dec_layer
    # Vocabulary tables store V rounded up to model.vocab_multiple rows (`nn/vocab.py`).
    pad = lambda v: -(-v // m.vocab_multiple) * m.vocab_multiple  # noqa: E731
    vocab_s, vocab_t = pad(m.vocab_size), pad(m.target_vocab_size or m.vocab_size)
    if m.share_embeddings:
        total += vocab_s * d
    else:
        total += vocab_s * d + vocab_t * d
        if not m.tie_output_embedding:
            total += d * vocab_t + vocab_t
    if m.norm == "pre":
        total += 2 * (2 * d)
    if m.positions == "learned":
        total += 2 * m.max_len * d
    return total


@pytest.mark.parametrize(
    "module, expected",
    # The paper's 63,082,496 and 214,245,376, plus 120 padding rows of 37,120 (`nn/vocab.py`).
    [(wmt14_ende_base, 63_143_936), (wmt14_ende_big, 214_368_256)],
)
def test_paper_configs(module, expected, capsys):
    config = module.get_config()
    total = dry_run.print_parameter_table(run_config.parse(config))
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"total_params={total}"
    assert total == analytic_count(config.model) == expected
    assert any(line.startswith("decoder/layer_5/cross_attention") for line in out)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"norm": "pre", "positions": "learned"},
        {
            "share_embeddings": False,
            "tie_output_embedding": False,
            "data.shared_vocab": False,
            "data.target_vocab_size": 300,
        },
        {"share_embeddings": False, "tie_output_embedding": True},
        {"d_kv": 24, "num_heads": 6},
    ],
)
def test_variants(changes):
    config = default.get_config()
    for k, v in changes.items():
        section, _, name = k.rpartition(".")
        config[section or "model"][name] = v
    planned = run_config.parse(config)
    params = dry_run.abstract_params(planned)
    total = sum(row[2] for row in dry_run.parameter_table(params))
    planned = planned.model
    assert total == analytic_count(planned)
    assert planned.output_vocab_size == (config.data.target_vocab_size or 256)
