"""Topology, placement and cost model: pure functions of a described fleet (fleet_spec.py);
inputs.py is the one module that reads what they need from disk (measured results, a model's
config.json)."""

from macfleet.topology.planner import (N_TO_ONE, ONE_TO_N, ONE_TO_ONE, SHARDED, SINGLE,
                                       SPLIT_SEQUENCE, SPLIT_SEQUENCE_REFUSAL, TOPOLOGIES, Plan,
                                       Refused, RoleAssignment, best_plan, layer_ranges, plan,
                                       refuse_split_sequence, shard_mode)
from macfleet.topology.fleet_spec import (Fleet, Host, Link, ModelShape, Profile,
                                          ProposerProfile, SnapshotError, snapshot_from_dict)

__all__ = ["N_TO_ONE", "ONE_TO_N", "ONE_TO_ONE", "SHARDED", "SINGLE", "SPLIT_SEQUENCE",
           "SPLIT_SEQUENCE_REFUSAL", "TOPOLOGIES", "Fleet", "Host", "Link", "ModelShape", "Plan",
           "Profile", "ProposerProfile", "Refused", "RoleAssignment", "SnapshotError",
           "best_plan", "layer_ranges", "plan", "refuse_split_sequence", "shard_mode",
           "snapshot_from_dict"]
