"""The live page: ``/dashboard/data`` over HTTP, and ``/dashboard`` rendered by headless
Chromium (Debian's ``chromium``; ``scripts/test`` installs it) against a real router with fake
backends. No Chromium is a failure, not a skip: the page is only tested in a browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from olproute.cli.main import main
from olproute.config.loader import load_config
from olproute.pricing.reward import RESOURCES
from olproute.server.dashboard import PRICE_BINS, quantile
from olproute.server.state import STATE
from olproute.sim.scenario import CalibrationSource
from tests.integration.server_harness import Stack, wait_until
from tests.integration.test_server import CAL, _config, request

NAMES = ["q-0", "q-1", "q-2"]
BATCH_PRICE = (0.01, 0.02, 0.03)   # per slot, on all 600 slots: sums 6, 12, 18
KV_PRICE = (0.0, 0.005, 0.0)       # sums 0, 3, 0
COMPUTE_PRICE = (0.0, 0.0, 0.05)   # sums 0, 0, 30: q-2's bottleneck is compute


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    # prices frozen (no learning), so the prices the test puts in the book stay there
    loaded = load_config(_config(tmp_path, prices={"enabled": False}))
    s = Stack(loaded, num_fakes=3, calibration=CalibrationSource(loaded, known=[CAL] * 3))
    try:
        yield s
    finally:
        s.close()


def _traffic(stack: Stack, n: int) -> None:
    """n completions through the proxy (observed TTFT), then known prices in the book."""
    for fake in stack.fakes:
        fake.delay_s = 0.005
    for i in range(n):
        status, _, _ = request(stack.url, "POST", "/v1/completions",
                               {"prompt": f"hello {i}", "max_tokens": 3})
        assert status == 200

    def put_prices() -> None:
        book = stack.app[STATE].router.policy.book  # type: ignore[attr-defined]
        for g in range(3):
            book.p[g, :, 0] = BATCH_PRICE[g]
            book.p[g, :, 1] = KV_PRICE[g]
            book.p[g, :, 2] = COMPUTE_PRICE[g]

    stack.call(put_prices)


def _get(stack: Stack, path: str) -> dict:  # type: ignore[type-arg]
    status, _, raw = request(stack.url, "GET", path)
    assert status == 200, raw
    return json.loads(raw)  # type: ignore[no-any-return]


def test_dashboard_data(stack: Stack) -> None:
    d = _get(stack, "/dashboard/data")
    assert d["policy"] == "bid_price" and d["has_prices"]
    assert [i["name"] for i in d["instances"]] == NAMES
    assert all(len(i[r]) == PRICE_BINS for i in d["instances"] for r in RESOURCES)
    assert d["decisions"]["total"] == {"dispatch": 0, "hold": 0, "shed": 0}
    assert d["ttft"]["all"]["count"] == 0 and d["ttft"]["all"]["mean_s"] is None
    # started without a certifier (olproute serve injects one): no live certificate
    assert d["certificate"] is None and "no certifier" in d["certificate_message"]

    _traffic(stack, 6)
    assert wait_until(lambda: _get(stack, "/dashboard/data")["ttft"]["all"]["count"] == 6)
    d = _get(stack, "/dashboard/data")
    assert d["decisions"]["total"]["dispatch"] == 6
    assert d["decisions"]["per_s"]["dispatch"] > 0 and d["decisions"]["per_s"]["shed"] == 0
    assert sum(i["dispatch_per_s"] for i in d["instances"]) == pytest.approx(
        d["decisions"]["per_s"]["dispatch"])
    ttft = d["ttft"]["all"]
    assert 0 < ttft["mean_s"] < 5 and 0 < ttft["p50_s"] <= ttft["p99_s"]
    for g, inst in enumerate(d["instances"]):
        assert inst["price_sum"]["batch"] == pytest.approx(600 * BATCH_PRICE[g])
        assert inst["price_sum"]["kv"] == pytest.approx(600 * KV_PRICE[g])
        assert inst["price_sum"]["compute"] == pytest.approx(600 * COMPUTE_PRICE[g])
        assert inst["batch"] == pytest.approx([BATCH_PRICE[g]] * PRICE_BINS)
        assert inst["compute"] == pytest.approx([COMPUTE_PRICE[g]] * PRICE_BINS)
    assert [i["bottleneck"] for i in d["instances"]] == ["batch", "batch", "compute"]
    status, headers, raw = request(stack.url, "GET", "/dashboard")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b"/dashboard/data" in raw
    # the page must work offline: nothing loaded from another origin
    assert not re.search(rb"""(src|href)\s*=\s*["']?(https?:)?//""", raw)


def test_histogram_quantile() -> None:
    le = (0.1, 0.5, 1.0, float("inf"))
    assert quantile(le, np.array([0.0, 0.0, 0.0, 0.0]), 0.5) != quantile(le, np.ones(4), 0.5)
    assert np.isnan(quantile(le, np.zeros(4), 0.5))
    assert quantile(le, np.array([2.0, 4.0, 4.0, 4.0]), 0.5) == pytest.approx(0.1)
    assert quantile(le, np.array([2.0, 4.0, 4.0, 4.0]), 0.75) == pytest.approx(0.3)
    assert quantile(le, np.array([0.0, 0.0, 0.0, 4.0]), 0.99) == 1.0  # +inf bucket


class _Cells(HTMLParser):
    """Text of every <td> with a data-instance attribute, by (class, instance)."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[tuple[str, str], str] = {}
        self.ids: dict[str, str] = {}
        self._open: tuple[str, str] | None = None
        self._id: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "td" and a.get("data-instance"):
            self._open = ((a.get("class") or "").split()[0], a["data-instance"] or "")
            self.cells[self._open] = ""
        elif a.get("id"):
            self._id = a["id"]
            self.ids[self._id] = ""

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self.cells[self._open] += data
        elif self._id is not None:
            self.ids[self._id] += data

    def handle_endtag(self, tag: str) -> None:
        self._open = None
        self._id = None


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("Chromium is not installed: `apt-get install -y chromium` (scripts/test does "
                "this); the dashboard is only tested in a real browser")


def dump_dom(url: str, tmp_path: Path) -> str:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chrome'}",
           "--virtual-time-budget=5000", "--dump-dom", url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_dashboard_page_in_headless_chromium(stack: Stack, tmp_path: Path) -> None:
    _traffic(stack, 4)
    t0 = time.monotonic()
    assert wait_until(lambda: _get(stack, "/dashboard/data")["ttft"]["all"]["count"] == 4)
    # all up before the page is drawn (a probe can miss its 1 s timeout under load)
    assert wait_until(lambda: all(i["healthy"] for i in _get(stack, "/instances")["instances"]))
    dom = dump_dom(stack.url + "/dashboard", tmp_path)
    recent = time.monotonic() - t0 < 4.0  # the rate window is 5 s
    page = _Cells()
    page.feed(dom)
    assert page.ids.get("policy") == "bid_price", dom[:2000]
    assert page.ids.get("status") == "", page.ids.get("status")  # no fetch error shown
    for g, name in enumerate(NAMES):
        assert page.cells[("name", name)] == name
        batch, kv = page.cells[("price-batch", name)], page.cells[("price-kv", name)]
        assert float(batch) == pytest.approx(600 * BATCH_PRICE[g]), batch
        assert float(kv) == pytest.approx(600 * KV_PRICE[g]), kv
        compute = page.cells[("price-compute", name)]
        assert float(compute) == pytest.approx(600 * COMPUTE_PRICE[g]), compute
        assert page.cells[("health", name)] == "up"
        assert page.cells[("bottleneck", name)] == ("compute" if g == 2 else "batch")
    assert "dispatch 4" in page.ids["totals"]
    rate = float(page.ids["rate-dispatch"])
    assert rate > 0 if recent else rate >= 0, rate
    assert page.ids["ttft-all-count"] == "4" and float(page.ids["ttft-all-mean"]) > 0
    assert dom.count('class="heat"') == 3
    assert "no certifier" in page.ids["certificate"]


def test_plots_from_a_live_server(stack: Stack, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``olproute plots --from-server`` polls GET /prices and draws the price plots."""
    _traffic(stack, 2)
    out = tmp_path / "live"
    assert main(["plots", "--from-server", stack.url, "--poll-s", "1.0", "--period-s", "0.25",
                 "--out", str(out)]) == 0
    assert "prices.png" in capsys.readouterr().out
    for name in ("prices.png", "bottleneck.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5_000
