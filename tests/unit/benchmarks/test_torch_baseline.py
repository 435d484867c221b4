"""The PyTorch baseline of `bench.py --compare torch` is our model, and its absence is one line.

Tests needing PyTorch skip without it (it is the optional `[torch]` extra);
the missing-torch tests hide it and run everywhere.
"""

import math
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_model_config

import flaxformer_lite
from flaxformer_lite.benchmarks import train_speed
from flaxformer_lite.models.autoregressive import shift_right
from flaxformer_lite.models.transformer import Transformer
from flaxformer_lite.objectives import cross_entropy

TINY = tiny_model_config(vocab_size=40, d_model=16, num_heads=2, d_ff=24, num_encoder_layers=1)


@pytest.fixture
def torch_baseline():
    pytest.importorskip("torch")
    from flaxformer_lite.benchmarks import torch_baseline

    torch_baseline.setup(threads=1)  # the test machine's cores are shared
    return torch_baseline


def _our_params(config, src, tgt):
    model = Transformer(config)
    return nn.meta.unbox(model.init(jax.random.PRNGKey(0), src, tgt)["params"])


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_same_parameter_count(torch_baseline, norm, positions):
    cfg = TINY.replace(norm=norm, positions=positions)
    one = jnp.ones((1, 4), jnp.int32)
    ours = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: _our_params(cfg, one, one))))
    theirs = torch_baseline.num_params(torch_baseline.Seq2Seq(cfg))
    # nn.Transformer ends both stacks with a LayerNorm (scale + bias). Pre-LN has
    # them too (our final_norm); post-LN does not, so torch has 2 * 2 * d_model more.
    extra = 2 * 2 * cfg.d_model if norm == "post" else 0
    assert theirs == ours + extra


@pytest.mark.parametrize("norm, activation", [("post", "relu"), ("pre", "gelu")])
def test_same_logits_and_loss_with_our_parameters(torch_baseline, norm, activation):
    import torch

    cfg = TINY.replace(norm=norm, activation=activation)
    # Padding in both sides (never a whole row), BOS = 2 after the shift.
    src = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]], np.int32)
    tgt = np.array([[14, 15, 16, 17, 3], [18, 19, 3, 0, 0]], np.int32)
    dec = shift_right(jnp.asarray(tgt), 2)
    params = _our_params(cfg, src, dec)
    ours = Transformer(cfg).apply({"params": params}, src, dec)  # [B, T, V]

    model = torch_baseline.Seq2Seq(cfg).train()  # dropout 0: training mode is deterministic
    torch_baseline.load_flax_params(model, jax.device_get(params))
    with torch.no_grad():
        dec_t = torch_baseline.shift_right(torch.from_numpy(tgt).long(), 2)
        theirs = model(torch.from_numpy(src).long(), dec_t)
        np.testing.assert_array_equal(dec_t.numpy(), np.asarray(dec))
        real = tgt != 0  # logits at padded target positions are never used
        np.testing.assert_allclose(theirs.numpy()[real], np.asarray(ours)[real], atol=2e-5)

        labels = torch.from_numpy(tgt).long()
        total, tokens = torch_baseline.loss_sums(theirs, labels, 0.1, cfg.vocab_size)
        smoothed, _ = cross_entropy.cross_entropy(
            jnp.asarray(theirs.numpy()), tgt, 0.1, cfg.vocab_size
        )
        assert tokens.item() == real.sum()
        assert total.item() == pytest.approx(float(smoothed.sum()), rel=1e-5)


def test_compare_interleaves_and_reports_the_ratio(torch_baseline):
    r = train_speed.compare_train_benchmark(
        TINY,
        batch=2,
        source_len=6,
        target_len=5,
        repeats=2,
        warmup=1,
        peak_flops=1e9,
        threads=1,
        log=lambda s: None,
    )
    assert len(r["step_samples_s"]) == len(r["torch_step_samples_s"]) == 2
    assert r["step_s"] == np.median(r["step_samples_s"])
    assert r["torch_step_s"] == np.median(r["torch_step_samples_s"])
    assert r["torch_over_ours"] == pytest.approx(r["torch_step_s"] / r["step_s"])
    flops = train_speed.train_flops_per_step(TINY, 2, 6, 5)
    assert r["flops_per_step"] == flops
    assert r["torch_mfu"] == pytest.approx(flops / r["torch_step_s"] / 1e9)
    assert r["torch_tokens_per_s"] == pytest.approx(2 * 11 / r["torch_step_s"])
    assert r["torch_params"] == r["params"] + 4 * TINY.d_model  # see the test above
    # Same batch every step, no dropout: both losses fall from about ln(V).
    for name in ("losses", "torch_losses"):
        assert len(r[name]) == 3 and all(math.isfinite(x) for x in r[name])
        assert r[name][-1] < r[name][0] < 1.2 * math.log(TINY.vocab_size), name


@pytest.mark.slow
def test_compiled_baseline_trains(torch_baseline):
    # torch.compile builds C++ kernels for the forward and backward passes: about a minute.
    r = train_speed.compare_train_benchmark(
        TINY,
        baseline="torch_compile",
        batch=2,
        source_len=6,
        target_len=5,
        repeats=2,
        warmup=1,
        peak_flops=1e9,
        threads=1,
        log=lambda s: None,
    )
    assert r["baseline"] == "torch_compile"
    assert r["torch_losses"][-1] < r["torch_losses"][0]


@pytest.fixture
def no_torch(monkeypatch):
    """Makes `import torch` fail as when it is not installed."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "flaxformer_lite.benchmarks.torch_baseline", raising=False)
    monkeypatch.delattr(flaxformer_lite.benchmarks, "torch_baseline", raising=False)


def test_without_torch_the_library_says_how_to_install_it(no_torch):
    with pytest.raises(ImportError, match=r'pip install -e "\.\[torch\]"'):
        train_speed.compare_train_benchmark(TINY, log=lambda s: None)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--mode=train", "--compare=torch"], 'pip install -e ".[torch]"'),
        (["--mode=decode", "--compare=torch"], "use it with --mode train or all"),
    ],
)
def test_without_torch_the_cli_gets_one_line(flags, words):
    hide_torch = (
        "import runpy, sys; sys.modules['torch'] = None; "
        f"sys.argv = ['bench.py', *{flags!r}]; runpy.run_path('bench.py', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide_torch], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], result.stderr
    assert "Traceback" not in result.stderr
