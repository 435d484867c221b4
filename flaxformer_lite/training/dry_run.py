"""`--dry_run`: the model built with `jax.eval_shape` (nothing allocated) and its parameters."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.models.from_config import build_model
from flaxformer_lite.training.state import init_shapes


def abstract_params(config: RunConfig):
    """Parameter shapes (boxed with logical axes) of a parsed run config's model, with
    nothing allocated. The vocabulary sizes are those of `data` (what the tokenizer will be
    asked for) until the run has trained its vocabularies.
    """
    model = build_model(config)
    shapes = init_shapes(model, 8, 8)  # frames for a feature encoder
    return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), shapes))


def parameter_table(params) -> list[tuple[str, str, int]]:
    """Rows (module path, "name[shape] ...", parameter count), one per module."""
    rows: dict[str, list] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nn.meta.unbox(params))[0]:
        keys = [getattr(k, "key", str(k)) for k in path]
        rows.setdefault("/".join(keys[:-1]), []).append((keys[-1], tuple(leaf.shape)))
    return [
        (
            module,
            " ".join(f"{n}{list(s)}" for n, s in leaves),
            sum(int(jnp.prod(jnp.asarray(s))) if s else 1 for _, s in leaves),
        )
        for module, leaves in rows.items()
    ]


def print_parameter_table(config: RunConfig) -> int:
    """Prints one row per module and a last line `total_params=<N>`; returns N."""
    rows = parameter_table(abstract_params(config))
    width = max(len(r[0]) for r in rows)
    for module, shapes, count in rows:
        print(f"{module:<{width}}  {count:>12,}  {shapes}")
    total = sum(r[2] for r in rows)
    print(f"total_params={total}")
    return total
