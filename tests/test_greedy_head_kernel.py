"""The greedy LM head (greedy_head.cc) against the float32 head of the linear kernel: the same argmax,
the float32 logit's very bits wherever the maximum could be, every other value below the maximum.

The kernels (greedy_head.cc, and screen_head.cc for the int8 copy) must build on the test machine: if they
cannot, these tests fail (they never skip).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.ops.cpu import build, greedy_head
from tokenmill.ops.cpu.linear import linear, to_strips

K, V = 64, 4096


def head(seed: int, vocab: int = V) -> jax.Array:
    return to_strips(jnp.asarray(np.random.default_rng(seed).standard_normal((1, K, vocab)).astype(np.float32) * 0.05))


def both(x: np.ndarray, strips: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """(the linear kernel's float32 logits, the greedy head's values)"""
    assert greedy_head.available(), "the greedy head kernel did not build"
    screen = greedy_head.screen_head(strips)
    x = jnp.asarray(x, jnp.float32)
    full = jax.jit(lambda x: linear(x, strips, 0))(x)
    greedy = jax.jit(lambda x: greedy_head.greedy_logits(x, strips, screen))(x)
    return np.asarray(full), np.asarray(greedy)


def bound(x: np.ndarray, screen: dict[str, jax.Array]) -> np.ndarray:
    """|x|_2 * coeff as float64 [R, V]: how far the screened values may lie from the float32 logits."""
    norms = np.sqrt(np.sum(np.asarray(x, np.float64) ** 2, axis=1, keepdims=True))
    return norms * np.asarray(screen["coeff"], np.float64)[None]


def check(full: np.ndarray, greedy: np.ndarray) -> None:
    np.testing.assert_array_equal(greedy.argmax(axis=1), full.argmax(axis=1))
    for f, g in zip(full, greedy):
        exact = f == g
        assert exact[f.argmax()], "the maximum is not the float32 logit"
        assert (g[~exact] < f.max()).all(), "a screened value reaches the maximum"


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_same_argmax_and_bits_as_the_float32_head(rows):
    strips = head(rows)
    rng = np.random.default_rng(100 + rows)
    for scale in (0.1, 1.0, 30.0):  # flat to peaked rows
        full, greedy = both(rng.standard_normal((rows, K)) * scale, strips)
        check(full, greedy)
        # the screen leaves few columns to compute: here a handful of V
        assert ((full == greedy).sum(axis=1) < V // 16).all()


def test_near_ties_keep_the_first_maximum():
    """Columns that differ from the best one in their last bits: their logits tie or nearly tie with
    it, well inside the int8 copy's error; the argmax is still the float32 head's, ties to the first."""
    w = np.random.default_rng(1).standard_normal((1, K, V)).astype(np.float32) * 0.05
    x = np.random.default_rng(2).standard_normal((1, K)).astype(np.float32)
    best = int((x @ w[0]).argmax())
    for i, col in enumerate((7, 100, 2000, 4000)):
        w[0, :, col] = np.nextafter(w[0, :, best], np.float32(i - 1.5))  # just below / above best's values
    w[0, :, 3] = w[0, :, best]  # an exact tie before it
    full, greedy = both(x, to_strips(jnp.asarray(w)))
    check(full, greedy)
    assert (full == greedy).sum() >= 5


def test_rows_it_cannot_screen_get_every_float32_logit():
    """A row of zeros ties every column, and a row with a NaN has no finite bound: both come out as the
    float32 head's logits, bit for bit."""
    x = np.zeros((3, K), np.float32)
    x[1] = np.random.default_rng(3).standard_normal(K)
    x[2, 5] = np.nan
    full, greedy = both(x, head(4, vocab=8192))
    np.testing.assert_array_equal(greedy[[0, 2]], full[[0, 2]])  # NaNs in the same places
    check(full[1:2], greedy[1:2])


def test_the_bound_covers_the_int8_copy():
    """The screened values of the columns left out lie within |x| * coeff of their float32 logits."""
    strips = head(5)
    screen = greedy_head.screen_head(strips)
    x = np.random.default_rng(6).standard_normal((4, K)).astype(np.float32)
    full, greedy = both(x, strips)
    limit = bound(x, screen)
    exact = full == greedy
    # a left-out column holds a - |x| c, and |a - z| <= |x| c: so z - 2 |x| c <= value <= z
    assert (greedy[~exact] <= full[~exact]).all()
    assert (greedy[~exact] >= full[~exact] - 2 * limit[~exact] * (1 + 1e-4)).all()


@pytest.mark.parametrize("k, vocab", [(64, 4096), (128, 96), (576, 1024)])
def test_screen_kernel_gives_the_reference_copy(k, vocab):
    """screen_head.cc against the jnp `screen_head_reference`: the very codes and scales (ties of the
    rounding included), coeff within float32 rounding; a column of zeros keeps scale 1, one huge value
    takes its column's scale."""
    assert build.load(build.SCREEN_HEAD), "the screen head kernel did not build"
    w = np.random.default_rng(k).standard_normal((1, k, vocab)).astype(np.float32) * 0.05
    w[0, :, 5] = 0
    w[0, 3, 7] = 1e15
    w[0, :, 9] = (np.arange(k) % 40 - 19.5) * 0.125  # scale 0.125 (15.875 / 127): x / 0.125 ends in .5
    w[0, 0, 9] = 15.875
    strips = to_strips(jnp.asarray(w))
    got = jax.device_get(greedy_head.screen_head(strips))
    want = jax.device_get(greedy_head.screen_head_reference(strips))
    np.testing.assert_array_equal(got["q"], want["q"])
    np.testing.assert_array_equal(got["scale"], want["scale"])
    assert got["scale"][5] == 1 and got["coeff"][5] == 0
    np.testing.assert_allclose(got["coeff"], want["coeff"], rtol=2e-6)
