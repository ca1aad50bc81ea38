"""The run's metrics for Prometheus: ``logging.prometheus_port`` serves ``/metrics`` from the driver.

One endpoint per run, on the driver: workers do not listen; their store-op timings come to the
driver with their replies (:mod:`algorithms.telemetry`), so every series here is the whole run's.
It binds ``logging.prometheus_host`` (default loopback); port 0 picks a free port, printed at
start. The endpoint lives as long as the run's metrics logger and is closed with it.

Every name starts with ``nemo_dataplane_``; :data:`METRICS` lists them (the Grafana dashboard,
``docs/grafana/nemo_dataplane.json``, is checked against it). ``prometheus-client`` (extra
``metrics``) is imported only when the endpoint is asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from algorithms.telemetry import OpRecord, direction

__all__ = ["METRICS", "PrometheusExporter", "scrape"]

P = "nemo_dataplane_"
# name as exposed -> (kind, help). A counter's samples carry the suffix ``_total``, a histogram's
# ``_bucket`` / ``_sum`` / ``_count``.
METRICS: dict[str, tuple[str, str]] = {
    P + "steps": ("counter", "trainer steps done"),
    P + "step_seconds": ("histogram", "wall seconds of a trainer step"),
    P + "phase_seconds": ("histogram", "seconds of a step phase (label phase)"),
    P + "op_seconds": ("histogram", "store op latency as its caller saw it (label op), every process"),
    P + "bytes": ("counter", "payload bytes moved through the store (label direction: put, get)"),
    P + "keys_outstanding": ("gauge", "keys held in the store after the step's release"),
    P + "bytes_outstanding": ("gauge", "bytes held in the store after the step (keys x mean bytes per key put)"),
    P + "dataplane_step_fraction": ("gauge", "the data plane's share of the trainer's step (overlaps once)"),
    P + "trainer_idle_ratio": ("gauge", "share of the step the trainer waited for rollouts or a refit"),
    P + "generator_idle_ratio": ("gauge", "share of the step the generators neither generated nor took weights"),
    P + "staleness": ("histogram", "weight versions between a trained group's sampler and the trainer"),
    P + "groups_dropped_stale": ("counter", "groups dropped as older than async.max_staleness"),
    P + "groups_requeued_failed": ("counter", "groups whose write failed and were generated again"),
    P + "generators_lost": ("counter", "generation engines found dead and dropped (grpo_sync, several engines)"),
    P + "generators_replaced": ("counter", "replacement engines that joined the refit group"),
    P + "groups_requeued_lost": ("counter", "groups a lost engine held, generated again by the others"),
    P + "refit_seconds": ("gauge", "seconds of the last refit's slowest receiver"),
    P + "refit_gbps": ("gauge", "weight bytes over the slowest receiver's seconds, GB/s"),
    P + "tokens_per_second": ("gauge", "tokens trained per second of step wall time"),
    P + "reward": ("gauge", "mean reward of the step's samples"),
    P + "reward_timeouts": ("counter", "reward calls past task.reward_timeout_s, each scored 0"),
}
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_STALENESS = (0, 1, 2, 3, 4, 6, 8, 16)


class PrometheusExporter:
    """Serves ``/metrics`` on ``host:port`` (``port`` 0: any free one, see :attr:`port`) until
    :meth:`close`. :meth:`observe` takes each step's row, store ops and group staleness.

    Args:
        refit_bytes: bytes one refit moves (the policy's weights in its precision), for GB/s.
    """

    def __init__(self, host: str, port: int, *, refit_bytes: int = 0) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.registry = r = CollectorRegistry()
        self.refit_bytes = int(refit_bytes)
        m: dict[str, Any] = {}
        for name, (kind, doc) in METRICS.items():
            labels = {"phase_seconds": ["phase"], "op_seconds": ["op"], "bytes": ["direction"]}.get(name[len(P) :], [])
            if kind == "counter":
                m[name] = Counter(name, doc, labels, registry=r)
            elif kind == "gauge":
                m[name] = Gauge(name, doc, labels, registry=r)
            else:
                buckets = _STALENESS if name.endswith("staleness") else _SECONDS
                m[name] = Histogram(name, doc, labels, buckets=buckets, registry=r)
        self._m = m
        self._put_bytes = self._put_keys = 0
        self.server: Any
        self.server, self._thread = start_http_server(int(port), addr=host, registry=r)
        self.host, self.port = host, int(self.server.server_port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def observe(self, row: Mapping[str, Any], ops: Sequence[OpRecord] = (), staleness: Sequence[int] = ()) -> None:
        """One step: its ``metrics.jsonl`` row, the store ops every caller made during it, and the
        staleness of each group it trained (async)."""
        m = self._m
        m[P + "steps"].inc()
        m[P + "step_seconds"].observe(float(row["step_s"]))
        for key, value in row.items():
            if key.startswith("time/") and isinstance(value, (int, float)):
                m[P + "phase_seconds"].labels(phase=key[5:]).observe(float(value))
        for rec in ops:
            m[P + "op_seconds"].labels(op=rec.op).observe(rec.seconds)
            way = direction(rec.op)
            if way is not None:
                m[P + "bytes"].labels(direction=way).inc(rec.n_bytes)
            if way == "put":
                self._put_bytes += rec.n_bytes
                self._put_keys += rec.n_keys
        for s in staleness:
            m[P + "staleness"].observe(s)
        keys = row.get("keys_outstanding")
        if keys is not None:
            m[P + "keys_outstanding"].set(keys)
            m[P + "bytes_outstanding"].set(keys * self._put_bytes / max(self._put_keys, 1))
        for name, key in (
            ("dataplane_step_fraction", "dataplane_step_fraction"),
            ("trainer_idle_ratio", "trainer_idle_ratio"),
            ("generator_idle_ratio", "generator_idle_ratio"),
            ("tokens_per_second", "tokens_per_s"),
            ("reward", "reward"),
            ("refit_seconds", "refit_receive_s"),
        ):
            if row.get(key) is not None:
                m[P + name].set(float(row[key]))
        for name in (
            "groups_dropped_stale",
            "groups_requeued_failed",
            "reward_timeouts",
            "generators_lost",
            "generators_replaced",
            "groups_requeued_lost",
        ):
            if row.get(name):
                m[P + name].inc(float(row[name]))
        receive = row.get("refit_receive_s")
        if receive and self.refit_bytes:
            m[P + "refit_gbps"].set(self.refit_bytes / float(receive) / 1e9)

    def close(self) -> None:
        """Stop serving (idempotent): the port is free once this returns."""
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """One read of a ``/metrics`` page: ``{sample name with its labels: value}``, e.g.
    ``nemo_dataplane_steps_total`` or ``nemo_dataplane_bytes_total{direction="put"}``."""
    import urllib.request

    text = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
