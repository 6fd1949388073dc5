"""End-to-end tests of the ``olproute`` command line on small simulator runs."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from olproute.cli.main import main
from olproute.sim.metrics import RECORD_COLUMNS
from tests.conftest import HANG_S, serve_config_data
from tests.support.processes import stop_process

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILES = REPO_ROOT / "configs" / "profiles.yaml"
TRACE = REPO_ROOT / "data" / "traces" / "splitwise_conv.csv"
BASELINES = ("least_outstanding", "power_of_two", "random", "round_robin")
DURATION_S = 60.0
QUIET = ["--no-progress"]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """Two Llama-2-7B engines replaying the first minute of the conversation trace."""
    data = {
        "profiles": str(PROFILES),
        "instances": [{"name": "llama", "model": "llama-2-7b", "gpu": "a100-80gb",
                       "replicas": 2}],
        "workload": {"kind": "trace", "path": str(TRACE), "duration_s": DURATION_S},
        "sim": {"seed": 0},
    }
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _trace_rows_in_window() -> int:
    """Requests of the trace arriving in the first DURATION_S seconds, counted directly."""
    with TRACE.open() as f:
        arrivals = [float(row["arrived_at"]) for row in csv.DictReader(f)]
    return sum(1 for a in arrivals if a - arrivals[0] < DURATION_S)


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def _table_rows(out: str) -> dict[str, list[str]]:
    """Body rows of the printed summary table, by policy name."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    assert set(lines[start + 1].replace(" ", "")) == {"-"}
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip() or line.startswith("wrote "):
            break
        cells = line.split()
        rows[cells[0]] = cells[1:]
    return rows


# -- simulate ---------------------------------------------------------------------------------
def test_simulate_prints_table_and_writes_outputs(
        config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "out"
    rc = main(["simulate", "--config", str(config), "--policy", "least_outstanding",
               "--out", str(out_dir), *QUIET])
    captured = capsys.readouterr()
    assert rc == 0
    header = captured.out.splitlines()[0]
    for word in ("policy", "TTFT", "goodput", "served"):
        assert word in header
    table = _table_rows(captured.out)
    assert list(table) == ["least_outstanding"]

    columns, rows = _read_csv(out_dir / "records_least_outstanding.csv")
    assert columns == list(RECORD_COLUMNS)
    assert {"request_id", "ttft_s", "slo_met"} <= set(columns)
    expected = _trace_rows_in_window()
    assert len(rows) == expected > 0
    assert sorted(int(r["request_id"]) for r in rows) == list(range(expected))
    assert {r["slo_met"] for r in rows} <= {"0", "1"}
    assert all(float(r["ttft_s"]) > 0 for r in rows if r["shed"] == "0")

    summary = json.loads((out_dir / "summary_least_outstanding.json").read_text())
    assert summary["num_requests"] == expected
    assert summary["num_served"] + summary["num_shed"] == expected
    assert table["least_outstanding"][0] == str(summary["num_served"])
    met = sum(r["slo_met"] == "1" for r in rows)
    assert summary["goodput"] == pytest.approx(met / expected)

    batch_cols, batches = _read_csv(out_dir / "batches_least_outstanding.csv")
    assert batch_cols
    assert len(batches) > 0


def test_simulate_defaults_to_the_config_policy(
        config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = yaml.safe_load(config.read_text())
    data["router"] = {"policy": "power_of_two"}
    config.write_text(yaml.safe_dump(data))
    assert main(["simulate", "--config", str(config), *QUIET]) == 0
    assert list(_table_rows(capsys.readouterr().out)) == ["power_of_two"]


# -- compare ----------------------------------------------------------------------------------
def test_compare_writes_table_csv_plot_and_json(
        config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "cmp"
    json_path = tmp_path / "summaries.json"
    names = ["round_robin", "least_outstanding"]
    rc = main(["compare", "--config", str(config), "--policies", ",".join(names),
               "--out", str(out_dir), "--json", str(json_path), *QUIET])
    captured = capsys.readouterr()
    assert rc == 0
    assert list(_table_rows(captured.out)) == names

    columns, rows = _read_csv(out_dir / "compare.csv")
    assert columns[0] == "policy"
    assert [r["policy"] for r in rows] == names

    png = (out_dir / "cdf.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) > 10_000

    summaries = json.loads(json_path.read_text())
    assert set(summaries) == set(names)
    counts = {summaries[n]["num_requests"] for n in names}
    assert counts == {_trace_rows_in_window()}
    for r in rows:
        assert int(r["num_requests"]) == summaries[r["policy"]]["num_requests"]

    # Every policy is run on the very same requests and targets.
    same = ("request_id", "arrival_s", "prompt_tokens", "decode_tokens",
            "predicted_decode_tokens", "ttft_target_s")
    per_policy = [_read_csv(out_dir / f"records_{n}.csv")[1] for n in names]
    first, second = ([tuple(r[c] for c in same) for r in recs] for recs in per_policy)
    assert first == second


# -- determinism --------------------------------------------------------------------------------
def test_same_seed_gives_byte_identical_records(
        config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(seed: int, name: str) -> bytes:
        out_dir = tmp_path / name
        assert main(["simulate", "--config", str(config), "--policy", "power_of_two",
                     "--seed", str(seed), "--out", str(out_dir), *QUIET]) == 0
        return (out_dir / "records_power_of_two.csv").read_bytes()

    first = run(3, "a")
    assert run(3, "b") == first
    assert run(4, "c") != first
    capsys.readouterr()


# -- bad input ------------------------------------------------------------------------------------
def test_bad_config_exits_2_naming_file_and_key(
        config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = yaml.safe_load(config.read_text())
    data["instances"] = [
        {"name": f"i{i}", "model": "llama-2-7b", "gpu": "a100-80gb"} for i in range(3)]
    data["instances"][2]["max_num_seqs"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    rc = main(["simulate", "--config", str(bad), *QUIET])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.out == ""
    assert captured.err == f"olproute: error: {bad}: instances[2].max_num_seqs: must be >= 1\n"


def test_missing_workload_file_exits_2(
        config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    assert main(["simulate", "--config", str(config), "--workload", str(missing), *QUIET]) == 2
    assert capsys.readouterr().err.startswith(f"olproute: error: {missing}: cannot read")


@pytest.mark.parametrize("command", [["simulate", "--policy", "nope"],
                                     ["compare", "--policies", "nope"],
                                     ["compare", "--policies", ","]])
def test_unknown_or_no_policy_exits_2(
        config: Path, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([*command, "--config", str(config), *QUIET])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("olproute: error: ")
    if "nope" in command:
        assert "unknown policy 'nope'" in err
        for name in BASELINES:
            assert name in err


@pytest.mark.parametrize(("option", "value"), [
    ("--time-scale", "0"),
    ("--time-scale", "abc"),
    ("--duration-s", "-5"),
    ("--duration-s", "inf"),
    ("--seed", "-1"),
    ("--seed", "1.5"),
])
def test_bad_option_values_are_usage_errors(
        config: Path, option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--config", str(config), option, value, *QUIET])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err
    assert "Traceback" not in err


def test_missing_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage: olproute" in capsys.readouterr().err


# -- help ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("command", "words"), [
    ([], ["simulate", "compare"]),
    (["simulate"], ["--config", "--policy", "--seed", "--out", *BASELINES]),
    (["compare"], ["--config", "--policies", "--json", "--out"]),
])
def test_help_exits_0_with_usage(
        command: list[str], words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(" ".join(["usage: olproute", *command]))
    for word in words:
        assert word in out


def test_module_entry_point_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "olproute.cli", "--help"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: olproute")
    assert "simulate" in proc.stdout
    assert "compare" in proc.stdout


def test_calibrate_then_estimate_eval(config: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config
    out = tmp_path / "sim"
    assert main(["simulate", "--config", str(cfg), "--no-progress", "--out", str(out)]) == 0
    cal = tmp_path / "cal.yaml"
    assert main(["calibrate", "--batch-log", str(out / "batches_round_robin.csv"),
                 "--out", str(cal)]) == 0
    text = capsys.readouterr().out
    assert "fit MAPE" in text and "llama-0" in text
    assert "calibration:" in cal.read_text()
    ev = tmp_path / "ev"
    js = tmp_path / "ev.json"
    assert main(["estimate-eval", "--config", str(cfg), "--no-progress", "--calibration",
                 str(cal), "--estimators", "bea,prefill_tps", "--out", str(ev),
                 "--json", str(js)]) == 0
    text = capsys.readouterr().out
    assert "bea" in text and "prefill_tps" in text and "MAPE" in text
    assert (ev / "estimate_eval.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads(js.read_text())
    assert [r["estimator"] for r in data["estimators"]] == ["bea", "prefill_tps"]
    assert all(r["n"] > 0 for r in data["estimators"])
    # the router's rebuilt snapshots (no batch in flight, no prefill progress): the same
    # dispatches, and BEA estimates them worse
    js2 = tmp_path / "ev-router.json"
    assert main(["estimate-eval", "--config", str(cfg), "--no-progress", "--calibration",
                 str(cal), "--estimators", "bea", "--snapshot-view", "router",
                 "--json", str(js2)]) == 0
    router = json.loads(js2.read_text())["estimators"][0]
    assert router["n"] == data["estimators"][0]["n"]
    assert router["mape_pct"] > data["estimators"][0]["mape_pct"]


def test_calibrate_rejects_a_malformed_log(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "b.csv"
    bad.write_text("not,a,batch,log\n")
    assert main(["calibrate", "--batch-log", str(bad), "--out", str(tmp_path / "c.yaml")]) == 2
    assert "line 1" in capsys.readouterr().err


def test_compare_on_pools_runs_the_pool_policies_by_default(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = {
        "profiles": str(PROFILES),
        "instances": [
            {"name": "p", "model": "qwen2.5-3b", "gpu": "a40", "role": "prefill"},
            {"name": "d", "model": "qwen2.5-3b", "gpu": "a40", "role": "decode",
             "replicas": 2, "kv_capacity_tokens": 60000}],
        "workload": {"kind": "poisson", "rate_per_s": 3.0, "duration_s": 10.0,
                     "lengths_path": str(TRACE)},
        "slo": {"mode": "classes"},
    }
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["compare", "--config", str(path), *QUIET]) == 0
    assert list(_table_rows(capsys.readouterr().out)) == [
        "round_robin", "least_outstanding", "least_tokens", "calibrated_cost", "bid_price"]


# -- emulate ------------------------------------------------------------------------------------
def test_emulate_length_and_stream_options_parse() -> None:
    from olproute.cli.main import _cmd_emulate, build_parser

    args = build_parser().parse_args(["emulate", "--exact-lengths", "--stream-interval", "4"])
    assert args.exact_lengths is True and args.stream_interval == 4
    assert args.handler is _cmd_emulate and args.truth is None
    args = build_parser().parse_args(["emulate", "--truth", "t.jsonl", "--lengths-trace",
                                      "x.csv", "--seed", "3"])
    assert (args.exact_lengths, args.stream_interval) == (False, 1)  # the defaults
    assert (args.truth, args.lengths_trace, args.seed) == ("t.jsonl", "x.csv", 3)


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "many"])
def test_emulate_stream_interval_must_be_a_positive_integer(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["emulate", "--stream-interval", value])
    assert info.value.code == 2
    assert "argument --stream-interval" in capsys.readouterr().err


def test_emulate_with_a_bad_truth_file_exits_2_naming_file_and_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Read before anything serves: the error names the file, the line and the column."""
    bad = tmp_path / "truth.csv"
    bad.write_text("prompt,model,output_tokens\nhello,llama-2-7b,12\nbye,llama-2-7b,-1\n")
    assert main(["emulate", "--truth", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"olproute: error: {bad}: line 3: output_tokens: expected an integer >= 1" in err
    assert "Traceback" not in err
    assert main(["emulate", "--truth", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: no such file" in capsys.readouterr().err


def test_emulate_help_names_the_length_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["emulate", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for words in ("--exact-lengths", "--stream-interval N", "--truth PATH", "--lengths-trace",
                  "finish_reason stop, or length when capped"):
        assert words in out, words


def test_emulate_kv_events_base_port_parses(capsys: pytest.CaptureFixture[str]) -> None:
    from olproute.cli.main import build_parser

    assert build_parser().parse_args(["emulate"]).kv_events_base_port is None
    args = build_parser().parse_args(["emulate", "--kv-events-base-port", "5557"])
    assert args.kv_events_base_port == 5557
    with pytest.raises(SystemExit) as info:
        main(["emulate", "--kv-events-base-port", "-1"])
    assert info.value.code == 2
    assert "argument --kv-events-base-port" in capsys.readouterr().err


def _two_emulators() -> Any:
    from olproute.config.loader import load_config
    from olproute.emulator import emulation_config

    return emulation_config(load_config(), num_instances=2)


def _emulators_printout(capsys: pytest.CaptureFixture[str]) -> str:
    """What ``serve_emulators`` prints at start for two emulated instances with KV events
    on free ports, up to its "serving" line."""
    import asyncio

    from olproute.emulator import serve_emulators

    loaded = _two_emulators()

    async def run() -> str:
        task = asyncio.create_task(serve_emulators(
            loaded, host="127.0.0.1", base_port=0, time_scale=1.0, exact_lengths=True,
            kv_events_base_port=0))
        out = ""
        while "serving" not in out:
            await asyncio.sleep(0.01)
            out += capsys.readouterr().out
        task.cancel()
        await asyncio.wait({task})
        return out

    return asyncio.run(asyncio.wait_for(run(), 60))


def test_emulate_prints_each_instances_kv_event_sockets(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``serve_emulators`` with KV events: the PUB and replay endpoints of every instance
    at start, P+2i and P+2i+1 (here free ports: 0)."""
    out = _emulators_printout(capsys)
    lines = [line for line in out.splitlines() if "KV events tcp://127.0.0.1:" in line]
    assert len(lines) == 2 and all("replay tcp://127.0.0.1:" in line for line in lines)
    assert "sha256" in lines[0]


def test_live_tables_backends_read_what_emulate_prints(
        capsys: pytest.CaptureFixture[str]) -> None:
    """bench/live_table.py builds its router's backends from ``olproute emulate``'s
    printout: with KV events, each backend's sockets from the line after its own."""
    from bench.live_table import _backends

    loaded = _two_emulators()
    lines = _emulators_printout(capsys).splitlines()
    with_events = _backends(lines, kv_events=True)
    assert [b["name"] for b in with_events] == [s.name for s in loaded.specs]
    for b in with_events:
        assert b["url"].startswith("http://127.0.0.1:")
        ev = b["kv_events"]
        assert ev["endpoint"].startswith("tcp://127.0.0.1:") and not ev["endpoint"].endswith(",")
        assert ev["replay_endpoint"].startswith("tcp://127.0.0.1:")
        assert (ev["topic"], ev["tokenizer"]) == ("", "words")
    assert all("kv_events" not in b for b in _backends(lines, kv_events=False))


def test_serve_says_what_it_starts_and_where_it_serves(tmp_path: Path) -> None:
    """``olproute serve`` (its own process, emulated engines) prints each slow start-up
    step on stderr and, once it listens, the URL it serves on, which answers."""
    data = serve_config_data()
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = subprocess.Popen([sys.executable, "-m", "olproute.cli", "serve", "--config",
                             str(path), "--port", "0"], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None
        said = []
        for line in proc.stderr:   # a hang is caught by the test's timeout
            said.append(line.rstrip("\n"))
            if "serving on" in line:
                break
        steps = [line for line in said if line.startswith("olproute: ")]
        assert steps[:4] == ["olproute: starting 2 emulated engines ...",
                             "olproute: building the router (policy bid_price) ...",
                             "olproute: calibrating the batch time (calibration: auto, in "
                             "the simulator) ...",
                             "olproute: compiling the price update ..."], said
        match = re.fullmatch(r"olproute: serving on (http://127\.0\.0\.1:\d+) "
                             r"\(Ctrl\+C stops it\)", steps[-1])
        assert match is not None, said
        with urllib.request.urlopen(match.group(1) + "/v1/models", timeout=HANG_S) as r:
            assert [m["id"] for m in json.load(r)["data"]] == ["qwen3-0.6b"]
    finally:
        stop_process(proc, grace_s=HANG_S)
