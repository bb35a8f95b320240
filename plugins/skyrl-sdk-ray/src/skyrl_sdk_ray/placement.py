"""Placement groups: where a set of actors goes, reserved before any of them starts.

A :class:`Placement` reserves one bundle per actor (``{"CPU": c}`` in CPU tests, ``{"GPU": 1,
"CPU": c}`` on GPUs), ``PACK`` by default (as few nodes as fit: the fsdp ranks of one job talk
most to each other) or ``SPREAD``. A group the cluster cannot hold is refused by name after
``timeout_s`` instead of waiting forever.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skyrl_sdk.errors import InputError

from .cluster import actor_env, cluster_resources

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class Placement:
    """One placement group of ``len(bundles)`` bundles (see the module docstring)."""

    def __init__(self, bundles: list[Mapping[str, float]], *, strategy: str = "PACK", name: str = "",
                 timeout_s: float = 120.0, what: str = "actors") -> None:
        import ray
        from ray.util.placement_group import placement_group

        if strategy not in STRATEGIES:
            raise InputError(f"placement strategy {strategy!r}: expected one of {list(STRATEGIES)}")
        self.bundles = [dict(b) for b in bundles]
        self.group = placement_group(self.bundles, strategy=strategy, name=name)
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            self.remove()
            need: dict[str, float] = {}
            for b in self.bundles:
                for k, v in b.items():
                    need[k] = need.get(k, 0) + v
            raise InputError(f"Ray cannot place {len(self.bundles)} {what} ({self.bundles[0]} each, {strategy}; "
                             f"{need} in all) within {timeout_s:.0f}s: the cluster has {cluster_resources()}")

    def options(self, index: int, *, env: Mapping[str, str] | None = None, **resources: Any) -> dict[str, Any]:
        """``Actor.options(...)`` that put an actor on bundle ``index``, with the caller's forwarded
        environment (``cluster.actor_env``) plus ``env``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles[index]
        return dict(num_cpus=resources.get("num_cpus", bundle.get("CPU", 0)),
                    num_gpus=resources.get("num_gpus", bundle.get("GPU", 0)),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.group, placement_group_bundle_index=index),
                    runtime_env={"env_vars": {**actor_env(), **(env or {})}})

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        group, self.group = getattr(self, "group", None), None
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception:  # the cluster is gone already
                pass


_trainer: Placement | None = None


def share_with_engines(placement: Placement | None) -> None:
    """Offer ``placement`` (the fsdp engine's Ray ranks, one GPU bundle each) to colocated inference
    engines of this process (``None``: withdraw it)."""
    global _trainer
    _trainer = placement


def trainer_placement() -> Placement | None:
    """The placement group colocated engines share with the trainer, if an fsdp engine offered one."""
    return _trainer if _trainer is not None and _trainer.group is not None else None
