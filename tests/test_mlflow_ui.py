"""The MLflow UI, as a user opens it: the compare page of two budgets' runs shows the budget param and
a quality metric per run (a real ``mlflow server`` on 127.0.0.1, read by headless Chromium)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from kvpop import tracking


@pytest.fixture(scope="module")
def chromium() -> str:
    """A Chromium on PATH, else the test is skipped: tests install nothing (.ci/run installs Debian's chromium)."""
    found = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if found is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_compare_page_shows_budget_and_quality(chromium, tmp_path, monkeypatch):
    db = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    children = {}
    for budget, acc in ((48, 0.3125), (64, 0.5625)):  # as the evaluate stage logs: a parent run, a child per policy
        with tracking.stage_run("evaluate", {"budget": budget}) as run:
            for policy, q in (("dense", 0.8125), ("kvpop_mlp", acc)):
                with run.child(policy, {"policy": policy, "budget": budget}, tags={"policy": policy}) as child:
                    child.metrics({"quote_accuracy": q, "kl": 0.03})
                    children[(policy, budget)] = child.run_id
    import mlflow

    exp = mlflow.get_experiment_by_name(tracking.EXPERIMENT).experiment_id
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{db}", "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline and server.poll() is None, "mlflow server did not come up"
            time.sleep(1)
        runs = json.dumps([children[("kvpop_mlp", 48)], children[("kvpop_mlp", 64)]]).replace(" ", "")
        url = f"http://127.0.0.1:{port}/#/compare-runs?runs={runs}&experiments=[\"{exp}\"]"
        dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                              "--virtual-time-budget=30000", "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert "budget" in dom and "quote_accuracy" in dom, dom[-2000:]
    assert "0.3125" in dom and "0.5625" in dom  # each budget's quote accuracy, side by side
    assert ">48<" in dom and ">64<" in dom  # the budget param of each run
