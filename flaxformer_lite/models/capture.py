"""Choosing attention layers to capture, and reading their sown probabilities.

Names are "encoder/self/I", "decoder/self/I" and "decoder/cross/I" (negative
I counts from the last layer). Unrolled, each chosen layer's attention module
sows "attention_weights" into the "intermediates" collection; under
`scan_layers` the stack re-sows them as "scanned_layer_I"
(`blocks.scan_layers`). `captured_attention` reads either layout.
"""

from __future__ import annotations

import jax

from flaxformer_lite.config import TransformerConfig

KINDS = {"self": "self_attention", "cross": "cross_attention"}


def parse_capture(
    capture: tuple[str, ...], config: TransformerConfig
) -> dict[str, tuple[int, ...]]:
    """("decoder/cross/-1", ...) -> {"encoder/self": (..), "decoder/self": .., "decoder/cross": ..}.

    Raises ValueError naming a bad entry.
    """
    depth = {"encoder": config.num_encoder_layers, "decoder": config.num_decoder_layers}
    out: dict[str, set[int]] = {
        "encoder/self": set(),
        "decoder/self": set(),
        "decoder/cross": set(),
    }
    for name in capture:
        stack, _, rest = name.partition("/")
        kind, _, index = rest.partition("/")
        key = f"{stack}/{kind}"
        try:
            i = int(index)
        except ValueError:
            i = None
        if key not in out or i is None or not -depth[stack] <= i < depth[stack]:
            raise ValueError(
                f"attention layer {name!r}: expected encoder/self/I, decoder/self/I or "
                f"decoder/cross/I with -{max(depth.values())} <= I < layers"
            )
        out[key].add(i % depth[stack])
    return {k: tuple(sorted(v)) for k, v in out.items()}


def captured_attention(
    intermediates: dict, capture: tuple[str, ...], config: TransformerConfig
) -> dict[str, jax.Array]:
    """The sown probabilities, {name in `capture`: float32[B, N, T_q, T_k]}, from any path."""
    out = {}
    for name in capture:
        stack, kind, index = name.split("/")
        i = int(index) % (
            config.num_encoder_layers if stack == "encoder" else config.num_decoder_layers
        )
        tree = intermediates[stack]
        # Unrolled: sown by the layer's attention module; scanned: re-sown by the stack.
        layer = tree[f"layer_{i}"] if f"layer_{i}" in tree else tree[f"scanned_layer_{i}"][-1]
        out[name] = layer[KINDS[kind]]["attention_weights"][-1]
    return out
