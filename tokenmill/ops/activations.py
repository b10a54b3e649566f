"""Activations by their HF names."""

import jax

_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def get_activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}") from None


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, act: str) -> jax.Array:
    """act(x @ gate) * (x @ up) @ down: SwiGLU for Llama, GeGLU for Gemma."""
    h = get_activation(act)(x @ w_gate) * (x @ w_up)
    return (h @ w_down).astype(x.dtype)
