"""The data plane's share of a step (algorithms/telemetry.py), the Prometheus exporter
(algorithms/exporter.py) scraped over real HTTP, and the Grafana dashboard against what the
exporter emits. A whole trainer run serving the endpoint: tests/functional/test_metrics_endpoint.py."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from algorithms.config import ConfigError, TrainerConfig
from algorithms.exporter import METRICS, PrometheusExporter, scrape
from algorithms.telemetry import OpLog, OpRecord, op_summary, union_seconds
from nemo_dataplane.wrappers.observed import OpEvent

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "nemo_dataplane.json"


def test_overlapping_intervals_count_once_and_are_clipped_to_the_step() -> None:
    assert union_seconds([(0, 2), (1, 3), (5, 6)], 0, 10) == 4
    assert union_seconds([(1, 2), (1, 2), (1.5, 1.7)], 0, 10) == 1
    assert union_seconds([(-5, 1), (9, 20)], 0, 10) == 2  # clipped to [0, 10]
    assert union_seconds([], 0, 10) == 0
    ops = [
        OpRecord("kv_batch_get", 2.0, 100, 4, 103.0, "rank"),  # [101, 103]
        OpRecord("kv_batch_get", 2.0, 100, 4, 103.5, "rank"),  # [101.5, 103.5]: overlaps the first
        OpRecord("kv_clear", 1.0, 0, 8, 106.0, "driver"),  # [105, 106]
        OpRecord("kv_batch_put", 3.0, 999, 8, 104.0, "collector"),  # beside the trainer: not its share
        OpRecord("kv_claim", 2.0, 0, 8, 109.0, "driver"),  # a long poll: the wait for rollouts
    ]
    s = op_summary(ops, 100.0, 110.0)
    assert s["dataplane_s"] == pytest.approx(3.5) and s["dataplane_step_fraction"] == pytest.approx(0.35)
    assert s["dp_bytes_get"] == 200 and s["dp_bytes_put"] == 999 and s["dp_ops"] == 5


def test_an_op_log_records_events_and_takes_records_back_from_other_processes() -> None:
    log = OpLog("rank")
    log(OpEvent("kv_batch_get", "p", 3, 120, 5.0, "ok", ended_at=50.0))
    (rec,) = log.drain()
    assert rec == OpRecord("kv_batch_get", 0.005, 120, 3, 50.0, "rank") and log.drain() == []
    driver = OpLog("driver")
    driver.extend([tuple(rec)])  # as it comes back through Ray
    assert driver.drain() == [rec]


def test_the_exporter_serves_each_steps_numbers_and_frees_its_port() -> None:
    ex = PrometheusExporter("127.0.0.1", 0, refit_bytes=4_000_000)
    try:
        assert ex.port > 0 and ex.url.startswith("http://127.0.0.1:")
        row = {
            "step": 0,
            "step_s": 0.5,
            "time/train": 0.2,
            "time/refit": 0.01,
            "keys_outstanding": 32,
            "dataplane_step_fraction": 0.2,
            "trainer_idle_ratio": 0.1,
            "generator_idle_ratio": 0.7,
            "tokens_per_s": 1000.0,
            "reward": 0.25,
            "refit_receive_s": 0.002,
            "groups_dropped_stale": 2,
            "reward_timeouts": 3,
        }
        ops = [
            OpRecord("kv_batch_put", 0.004, 800, 16, 1.0, "collector"),
            OpRecord("kv_claim", 0.02, 0, 16, 1.0, "driver"),
        ]
        ex.observe(row, ops, staleness=[1, 1, 0])
        ex.observe({**row, "step": 1, "groups_dropped_stale": 0, "reward_timeouts": 1}, [], [])
        got = scrape(ex.url)
        assert got["nemo_dataplane_steps_total"] == 2
        assert got["nemo_dataplane_step_seconds_count"] == 2 and got["nemo_dataplane_step_seconds_sum"] == 1.0
        assert got['nemo_dataplane_phase_seconds_count{phase="train"}'] == 2
        assert got['nemo_dataplane_op_seconds_count{op="kv_batch_put"}'] == 1
        assert got['nemo_dataplane_op_seconds_bucket{le="0.005",op="kv_batch_put"}'] == 1
        assert got['nemo_dataplane_bytes_total{direction="put"}'] == 800
        assert got["nemo_dataplane_keys_outstanding"] == 32 and got["nemo_dataplane_bytes_outstanding"] == 32 * 50
        assert got["nemo_dataplane_dataplane_step_fraction"] == 0.2
        assert got["nemo_dataplane_staleness_count"] == 3 and got['nemo_dataplane_staleness_bucket{le="0.0"}'] == 1
        assert got["nemo_dataplane_groups_dropped_stale_total"] == 2
        assert got["nemo_dataplane_refit_gbps"] == pytest.approx(2.0)
        assert got["nemo_dataplane_reward"] == 0.25
        assert got["nemo_dataplane_reward_timeouts_total"] == 4  # a counter: each step's timeouts added
    finally:
        ex.close()
    ex.close()  # idempotent
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(ex.url, timeout=5)


def test_every_dashboard_panel_queries_a_metric_the_exporter_emits() -> None:
    ex = PrometheusExporter("127.0.0.1", 0)
    try:
        ex.observe(
            {"step": 0, "step_s": 1.0, "time/x": 0.1, "keys_outstanding": 1, "refit_receive_s": 0.1},
            [OpRecord("kv_batch_get", 0.1, 1, 1, 1.0, "rank"), OpRecord("kv_batch_put", 0.1, 1, 1, 1.0, "rank")],
            [0],
        )
        ex.observe({"step": 1, "step_s": 1.0, "groups_dropped_stale": 1, "groups_requeued_failed": 1}, [], [])
        lost = {"generators_lost": 1, "groups_requeued_lost": 2, "generators_replaced": 1}
        ex.observe({"step": 2, "step_s": 1.0, **lost}, [], [])
        ex.observe({"step": 3, "step_s": 1.0, "generators_lost": 0, "generators_replaced": 1}, [], [])
        page = scrape(ex.url)
        # Counters of a step's increments: the run's totals.
        assert page["nemo_dataplane_generators_lost_total"] == 1.0
        assert page["nemo_dataplane_generators_replaced_total"] == 2.0
        assert page["nemo_dataplane_groups_requeued_lost_total"] == 2.0
        emitted = {name.split("{")[0] for name in scrape(ex.url)}
    finally:
        ex.close()
    dashboard = json.loads(DASHBOARD.read_text())
    queried = []
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = re.findall(r"nemo_dataplane_[a-z_]+", target["expr"])
            assert names, f"panel {panel['title']!r}: {target['expr']!r} names no metric"
            for name in names:
                assert name in emitted, f"panel {panel['title']!r} queries {name}, which the exporter does not emit"
            queried += names
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in queried}
    assert families == set(METRICS), f"metrics no panel shows: {set(METRICS) - families}"


def test_a_bad_port_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="prometheus_port"):
        TrainerConfig.from_dict(
            {"policy": {"model": {"arch": "llama", "hf_config": {}}}, "logging": {"prometheus_port": 70000}}
        )


def test_wandb_offline_gets_the_same_numbers_as_metrics_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")  # in the test extra: this runs in CI
    from algorithms.metrics import MetricsLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="nemo-dataplane-test", dir=str(tmp_path))
    logger = MetricsLogger(tmp_path, total_steps=2, progress=False, wandb_run=run)
    rows = [
        {"step": 0, "reward": 0.25, "loss": 0.5, "step_s": 1.0, "dataplane_step_fraction": 0.125},
        {"step": 1, "reward": 0.5, "loss": 0.25, "step_s": 1.0, "dataplane_step_fraction": 0.0625},
    ]
    for row in rows:
        logger.log_step(row)
    logged = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["dataplane_step_fraction"] for r in logged] == [0.125, 0.0625]
    logger.close()  # finishes the run
    # finish() returns once the service has the records; its writer may still hold them (seen
    # under load: a 7-byte file). teardown() waits for the service to exit, which closes the file.
    wandb.teardown()
    (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    for key, value in (("dataplane_step_fraction", b"0.125"), ("dataplane_step_fraction", b"0.0625"), ("loss", b"0.5")):
        assert key.encode() in data and value in data, (key, value)
