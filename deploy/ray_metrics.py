"""Ray's metrics export of a Serve replica's serving metrics (``ray.util.metrics``).

Owns :func:`replica_metrics` (a Serve replica's ``ServingMetrics``: its ``/metrics``
registry and, unless the application's ``ray_metrics`` is off, Ray's export; the two
options checked by :func:`check_metrics_options`) and :class:`RayMetricsMirror`, the ``deploy.metrics.MetricsMirror`` that records every
family of ``deploy.metrics.FAMILIES`` into Ray's own metrics as well, the path Ray
Serve LLM's vLLM engines export through: each node's Ray metrics agent serves them
(``ray start --metrics-export-port``; Ray's Prometheus service discovery file lists
every node), every replica of the node in one scrape, told apart by the ``ReplicaId``
tag (Ray adds its own: ``WorkerId``, ``NodeAddress``, ``SessionName``). Ray puts
``ray_`` before each name and allows no ``:`` in it, so ``vllm:num_requests_running``
is exported as ``ray_vllm_num_requests_running``, the name Ray Serve LLM's vLLM
metrics carry.

Must not import: ``torch``, ``model``, ``cache``, ``cluster``, ``actors``, and from
``deploy`` only ``deploy.metrics``.
"""

from __future__ import annotations

import re

from ray import serve
from ray.util import metrics as ray_metrics

from dsv41.deploy.metrics import COUNTER, GAUGE, LABELS, MetricFamily, ServingMetrics, check_metrics_prefix

REPLICA_TAG = "ReplicaId"


def ray_metric_name(name: str) -> str:
    """``name`` with every character Ray's exporter refuses (``:`` among them) as ``_``."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


class RayMetricsMirror:
    """Records the serving metrics of the replica ``replica_id`` into Ray's metrics."""

    def __init__(self, replica_id: str) -> None:
        if not isinstance(replica_id, str) or not replica_id:
            raise ValueError(f"replica_id: {replica_id!r} (allowed: a non-empty string)")
        self.replica_id = replica_id
        self._metrics: dict[str, ray_metrics.Counter | ray_metrics.Gauge | ray_metrics.Histogram] = {}

    def declare(self, family: MetricFamily, name: str, buckets: tuple[float, ...] | None) -> None:
        tag_keys = (*LABELS, *family.labels, REPLICA_TAG)
        ray_name = ray_metric_name(name)
        if family.kind == COUNTER:
            metric = ray_metrics.Counter(ray_name, family.documentation, tag_keys=tag_keys)
        elif family.kind == GAUGE:
            metric = ray_metrics.Gauge(ray_name, family.documentation, tag_keys=tag_keys)
        else:
            assert buckets is not None
            metric = ray_metrics.Histogram(ray_name, family.documentation, boundaries=list(buckets), tag_keys=tag_keys)
        self._metrics[family.name] = metric

    def record(self, family: MetricFamily, value: float, labels: tuple[str, ...]) -> None:
        metric = self._metrics[family.name]
        tags = dict(zip((*LABELS, *family.labels, REPLICA_TAG), (*labels, self.replica_id)))
        if family.kind == COUNTER:
            metric.inc(value, tags=tags)
        elif family.kind == GAUGE:
            metric.set(value, tags=tags)
        else:
            metric.observe(value, tags=tags)


def replica_metrics(model_name: str, max_model_len: int, prefix: str, export_to_ray: bool) -> ServingMetrics:
    """The serving metrics of the Serve replica this runs in: scraped from it alone
    through ``/metrics`` and, with ``export_to_ray``, exported through Ray's metrics
    tagged with its id (each record then costs a Ray metrics call as well, on the
    engine's thread)."""
    mirrors = (RayMetricsMirror(serve.get_replica_context().replica_id.unique_id),) if export_to_ray else ()
    return ServingMetrics(model_name, max_model_len=max_model_len, prefix=prefix, mirrors=mirrors)


def check_metrics_options(prefix: object, export_to_ray: object) -> None:
    """The application's ``metrics_prefix`` and ``ray_metrics`` args, or ValueError naming the one refused."""
    check_metrics_prefix(prefix)
    if not isinstance(export_to_ray, bool):
        raise ValueError(f"ray_metrics: {export_to_ray!r} (allowed: true or false)")
