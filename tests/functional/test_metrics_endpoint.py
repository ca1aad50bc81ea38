"""``logging.prometheus_port``: a real short run (sync and async, side by side) serves
``/metrics`` on loopback while it trains; the test scrapes it over HTTP the whole time.

While up: the step counter grows, the store-op histograms are not empty, the data plane's share
of a step lies in (0, 1) and the idle ratios in [0, 1]; every value the gauge showed is one the
run wrote to ``metrics.jsonl``. After the run the port no longer answers.

Each run's reward (``algorithms.faults:hanging_reward``) never returns on its first call: that
call is cut at ``task.reward_timeout_s``, scores 0, and shows once in ``reward_timeouts`` of
``metrics.jsonl`` and in the endpoint's counter; the run goes on.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from algorithms.exporter import scrape
from algorithms.faults import HANG_ONCE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
REWARD_TIMEOUT_S = 2.0


def _watch(proc: subprocess.Popen[Any], err: Path, timeout: float = 600) -> tuple[str, list[dict[str, float]]]:
    """The endpoint's URL (from the run's stderr) and every scrape taken until the run exits."""
    deadline = time.monotonic() + timeout
    url = None
    scrapes: list[dict[str, float]] = []
    while proc.poll() is None and time.monotonic() < deadline:
        if url is None:
            found = re.search(r"prometheus: serving (http://\S+/metrics)", err.read_text() if err.exists() else "")
            url = found.group(1) if found else None
        else:
            try:
                scrapes.append(scrape(url))
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # closing at the end of the run
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    proc.wait(60)
    assert url is not None, f"the run never announced its endpoint:\n{err.read_text()[-3000:]}"
    return url, scrapes


@pytest.fixture(scope="module")
def served(tmp_path_factory, trainer_command, small_overrides) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("metrics_endpoint")
    common = (
        f"trainer.steps={STEPS}",
        "trainer.val_every=0",
        "logging.prometheus_port=0",
        "task.reward_fn=algorithms.faults:hanging_reward",
        f"task.reward_timeout_s={REWARD_TIMEOUT_S:g}",
    )
    plan = {
        "sync": trainer_command(d / "sync", *common, small=True),
        "async": trainer_command(
            d / "async", *small_overrides, *common, "async.groups_per_generation=2", module="grpo_async"
        ),
    }
    procs = {}
    for name, (cmd, env) in plan.items():
        (d / name).mkdir(parents=True, exist_ok=True)
        err = d / name / "stderr.txt"
        env[HANG_ONCE_ENV] = str(d / name / "hung_once")
        procs[name] = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err.open("w")), err)
    watched: dict[str, Any] = {}

    def watch(name: str) -> None:
        proc, err = procs[name]
        try:
            watched[name] = _watch(proc, err)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread below
            watched[name] = e

    threads = [threading.Thread(target=watch, args=(name,)) for name in procs]  # both runs scraped at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {}
    for name, (proc, err) in procs.items():
        if isinstance(watched[name], BaseException):
            raise watched[name]
        assert proc.returncode == 0, err.read_text()[-4000:]
        out[name] = (*watched[name], d / name)
    return out


@pytest.mark.parametrize("trainer", ["sync", "async"])
def test_a_running_trainer_serves_its_step_accounting(served: dict[str, Any], trainer: str) -> None:
    import json

    url, scrapes, out = served[trainer]
    assert url.startswith("http://127.0.0.1:"), url
    steps = [s.get("nemo_dataplane_steps_total", 0.0) for s in scrapes]
    seen = sorted({v for v in steps if v > 0})
    assert len(seen) >= 2 and steps == sorted(steps), f"the step counter did not grow while scraped: {seen}"
    last = next(s for s in reversed(scrapes) if s.get("nemo_dataplane_steps_total", 0) > 0)
    ops = {k: v for k, v in last.items() if k.startswith("nemo_dataplane_op_seconds_count{")}
    assert ops and all(v > 0 for v in ops.values()), f"no store op was timed: {sorted(last)[:20]}"
    assert any('op="kv_batch_get"' in k for k in ops) and any('op="kv_clear"' in k for k in ops), ops
    assert last['nemo_dataplane_bytes_total{direction="get"}'] > 0
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    fractions = {r["dataplane_step_fraction"] for r in rows}
    for s in scrapes:
        if s.get("nemo_dataplane_steps_total", 0) > 0:
            f = s["nemo_dataplane_dataplane_step_fraction"]
            assert 0 < f < 1, f
            assert f in fractions, "the endpoint shows a fraction metrics.jsonl does not have"
            for k in ("nemo_dataplane_trainer_idle_ratio", "nemo_dataplane_generator_idle_ratio"):
                assert 0 <= s[k] <= 1, (k, s[k])
    assert all(0 < r["dataplane_step_fraction"] < 1 for r in rows) and len(rows) == STEPS
    if trainer == "async":
        assert last["nemo_dataplane_staleness_count"] > 0
    # The one reward call that never returned: cut short, scored 0, counted in both places.
    assert (out / "hung_once").exists(), "the hanging call never happened"
    assert sum(r["reward_timeouts"] for r in rows) == 1, [r["reward_timeouts"] for r in rows]
    assert rows[0]["reward_timeouts"] == 1, "the first reward call hung, before step 0's row"
    assert last["nemo_dataplane_reward_timeouts_total"] == 1
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(url, timeout=5)  # gone with the run
