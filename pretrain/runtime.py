"""The runtime of a model on a device mesh: what train, evaluate, sample and load share.

A `Runtime` is built from explicit configs (model, mesh, logical-axis rules), never from
Gin, so the same arguments always give the same programs. It holds the mesh, the
sharded layout of the parameters (and, for a given optimizer, of its state), and turns
each process's rows of a batch into one global array.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import flax.linen as nn
import jax
import numpy as np
import optax

from model.config import ModelConfig
from model.lm import LanguageModel, init_params, param_logical_axes
from sharding import partition
from sharding import rules as rules_lib
from sharding.mesh import MeshConfig, create_mesh

# The features of a packed batch that the model and the losses read.
BATCH_FEATURES = ("inputs", "targets", "positions", "segment_ids", "weights")


def host_scalar(x: jax.Array) -> float:
  """A replicated scalar as a Python float, also when it spans several processes."""
  return float(np.asarray(x.addressable_data(0)))


def with_shardings(shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying their target shardings (what Orbax restores onto)."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


class Runtime:
  """A model, its mesh and its shardings.

  Attributes:
    config: the model's ModelConfig.
    mesh: the device mesh (all global devices).
    rules: the logical-axis rule table.
    model: the LanguageModel module.
    param_shardings: NamedShardings of the parameter tree.
    abstract_params: ShapeDtypeStructs (with shardings) of the parameter tree.
    replicated: the fully replicated sharding (scalars, metrics).
  """

  def __init__(self, config: ModelConfig, mesh: jax.sharding.Mesh,
               rules: rules_lib.Rules = rules_lib.DEFAULT_RULES,
               replication_check: partition.ReplicationCheck = partition.ReplicationCheck()):
    self.config = config
    self.mesh = mesh
    self.rules = tuple(rules)
    self.model = LanguageModel(config)
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    self.param_shardings = partition.param_shardings(
        mesh, param_logical_axes(config), shapes, self.rules)
    partition.check_no_large_replicated(
        shapes, self.param_shardings, mesh,
        max_replicated_bytes=replication_check.max_replicated_bytes,
        action=replication_check.action)
    self.abstract_params = with_shardings(shapes, self.param_shardings)
    self.replicated = partition.replicated(mesh)

  @classmethod
  def create(cls, config: ModelConfig, mesh_config: MeshConfig = MeshConfig(),
             rules: rules_lib.Rules = rules_lib.DEFAULT_RULES,
             replication_check: partition.ReplicationCheck = partition.ReplicationCheck()
             ) -> "Runtime":
    """A runtime over a new mesh of all devices shaped by `mesh_config`."""
    return cls(config, create_mesh(mesh_config), rules, replication_check)

  @contextlib.contextmanager
  def activation_context(self) -> Iterator[None]:
    """Mesh and logical rules in scope, so the model's activation constraints apply."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield

  def init_params(self, seed: int) -> Any:
    """Parameters created directly in their sharded layout."""
    fn = jax.jit(lambda key: init_params(self.config, key),
                 out_shardings=self.param_shardings)
    with self.activation_context():
      return fn(jax.random.key(seed))

  def opt_state_layout(self, optimizer: optax.GradientTransformation) -> tuple[Any, Any]:
    """(abstract optimizer state with shardings, its shardings) for `optimizer`."""
    shapes = jax.eval_shape(optimizer.init, self.abstract_params)
    shardings = partition.opt_state_shardings(optimizer, shapes, self.param_shardings,
                                              self.mesh)
    return with_shardings(shapes, shardings), shardings

  def global_batch(self, local_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows of the model's features, as global sharded arrays."""
    features = {name: local_batch[name] for name in BATCH_FEATURES}
    return partition.make_global_batch(self.mesh, features, self.rules)

  def batch_shardings(self) -> dict[str, Any]:
    sharding = partition.batch_sharding(self.mesh, 2, self.rules)
    return {name: sharding for name in BATCH_FEATURES}

  def process_batch_rows(self, batch_size: int) -> slice:
    """The rows of a global batch that this process feeds."""
    return partition.process_batch_rows(self.mesh, batch_size, self.rules)
