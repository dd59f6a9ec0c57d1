"""Shared by the RecurrentGemma parity and convert tests."""
import jax


def perturbed(params, rng):
  """Adds noise to biases, norm scales and a_param (zero or structured at init), so that
  a mapping error cannot hide behind a zero."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(rng, len(leaves))
  out = []
  for (path, x), key in zip(leaves, keys):
    name = jax.tree_util.keystr(path)
    if any(s in name for s in ("['b']", "['bias']", "['scale']", "['a_param']")):
      x = x + 0.3 * jax.random.normal(key, x.shape, x.dtype)
    out.append(x)
  return jax.tree_util.tree_unflatten(treedef, out)
