"""The ``olproute`` command line: simulate | compare."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from olproute.cli.args import int_at_least, positive_float
from olproute.config.loader import (
    DEFAULT_CONFIG,
    ConfigError,
    LoadedConfig,
    load_config,
    load_workload,
)
from olproute.estimate.calibration import CalibrationError
from olproute.operator.executors import ExecutorError
from olproute.policies import REGISTRY, PolicyError
from olproute.predict import PredictorError
from olproute.sim.workloads import WorkloadError

if TYPE_CHECKING:
    from olproute.sim.scenario import PolicyWrap

Handler = Callable[[argparse.Namespace], int]


_seed = int_at_least(0)  # numpy's SeedSequence rejects negative seeds
_positive_int = int_at_least(1)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help="run configuration YAML (default: %(default)s)")
    p.add_argument("--workload", metavar="YAML",
                   help="YAML file whose 'workload' mapping replaces the config's workload")
    _add_weights_option(p)
    p.add_argument("--seed", type=_seed, help="run seed (default: sim.seed of the config)")
    p.add_argument("--time-scale", type=positive_float, metavar="X",
                   help="stretch trace arrivals by X (<1 raises the load)")
    p.add_argument("--duration-s", type=positive_float, metavar="S",
                   help="simulate only arrivals in the first S seconds")
    p.add_argument("--out", metavar="DIR", help="folder for records, logs and plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_weights_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", action="append", default=[], metavar="YAML",
                   help="weight profile merged over the config's reward/admission/prices "
                        "(a file, or a name in configs/weights: throughput, mean_latency, "
                        "tail_latency, balanced, quality_first); repeat to stack")


def _weights(args: argparse.Namespace) -> list[Path]:
    from olproute.config.profiles import resolve_profile

    return [resolve_profile(w) for w in args.weights]


def _loaded(args: argparse.Namespace) -> LoadedConfig:
    loaded = load_config(args.config, _weights(args))
    workload = loaded.config.workload
    if args.workload:
        workload = load_workload(args.workload)
    updates: dict[str, Any] = {}
    if args.time_scale is not None:
        updates["time_scale"] = args.time_scale
    if args.duration_s is not None:
        updates["duration_s"] = args.duration_s
    if updates:
        workload = workload.model_copy(update=updates)
    if args.workload or loaded.has_workload:   # else it stays missing, and says so
        loaded = loaded.with_updates(workload=workload)
    if args.seed is not None:
        loaded = loaded.with_updates(sim=loaded.config.sim.model_copy(update={"seed": args.seed}))
    return loaded


def _cmd_simulate(args: argparse.Namespace) -> int:
    from olproute.sim.runner import run_policy, summary_table

    loaded = _loaded(args)
    name = args.policy or loaded.config.router.policy
    run = run_policy(loaded, name, progress=not args.no_progress,
                     out_dir=Path(args.out) if args.out else None, wrap=_resolving(loaded))
    print(summary_table([(name, run.summary)]))
    if args.out:
        print(f"wrote {args.out}/: records_{name}.csv, batches_{name}.csv, summary_{name}.json")
    return 0


def _resolving(loaded: LoadedConfig) -> PolicyWrap | None:
    """bid_price's re-solves for the simulator when the config asks for them."""
    if loaded.config.prices.resolve_period_s is None:
        return None
    from solvers.resolve import resolving

    return resolving


# what `olproute compare` runs without --policies
MIXED_COMPARE = "round_robin,random,least_outstanding,power_of_two"
POOL_COMPARE = "round_robin,least_outstanding,least_tokens,calibrated_cost,bid_price"


def _cmd_compare(args: argparse.Namespace) -> int:
    from olproute.sim.runner import compare_policies, summary_table

    loaded = _loaded(args)
    if args.policies is None:
        pools = any(s.role != "mixed" for s in loaded.specs)
        args.policies = POOL_COMPARE if pools else MIXED_COMPARE
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    if not names:
        raise PolicyError(f"--policies names no policy: {args.policies!r}")
    out = Path(args.out) if args.out else None
    runs = compare_policies(loaded, names, progress=not args.no_progress, out_dir=out,
                            wrap=_resolving(loaded))
    print(summary_table([(r.policy, r.summary) for r in runs]))
    if out is not None:
        print(f"wrote {out}/compare.csv, {out}/cdf.png and per-policy records")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {r.policy: r.summary.as_json() for r in runs}, indent=2))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if args.all_backends:
        if args.backend:
            raise CalibrationError("give --backend or --all-backends, not both")
        backends = load_config(args.config).config.server.backends
        if not backends:
            raise ConfigError(args.config, [("server.backends", "--all-backends: none "
                                             "listed")])
        args.backend = [(b.name, b.url.rstrip("/")) for b in backends]
    if args.backend:
        from olproute.cli.calibrate import calibrate_backends

        if args.batch_log:
            raise CalibrationError("give --batch-log or --backend, not both")
        return calibrate_backends(args)
    if not args.batch_log:
        raise CalibrationError("give --batch-log CSV (a simulator batch log) or --backend "
                               "NAME=URL (live backends)")
    from olproute.estimate.calibration import (
        calibrate_log,
        design_matrix,
        read_batch_log,
        write_calibration,
    )

    log, names = read_batch_log(args.batch_log)
    cal = calibrate_log(log, names)
    write_calibration(cal, args.out)
    print(f"{'instance':<20} {'batches':>8} {'beta0 ms':>9} {'beta1 us/tok':>13} "
          f"{'beta2 ns/ctx':>13} {'beta3 ps/attn':>14} {'fit MAPE %':>10}")
    for g, name in enumerate(names):
        rows = log[log[:, 0] == g]
        b = cal[name].beta
        mape = float(abs(design_matrix(rows) @ b / rows[:, 2] - 1.0).mean() * 100)
        print(f"{name:<20} {len(rows):>8} {b[0] * 1e3:>9.3f} {b[1] * 1e6:>13.4f} "
              f"{b[2] * 1e9:>13.4f} {b[3] * 1e12:>14.4f} {mape:>10.2f}")
    print(f"wrote {args.out}")
    return 0


def _cmd_estimate_eval(args: argparse.Namespace) -> int:
    import numpy as np

    from olproute.estimate.calibration import read_calibration
    from olproute.sim.estimate_eval import (
        error_rows,
        format_rows,
        run_estimate_eval,
        scatter_png,
    )

    loaded = _loaded(args)
    policy = args.policy or loaded.config.router.policy
    names = [n.strip() for n in args.estimators.split(",") if n.strip()]
    calibration = None
    if args.calibration:
        by_name = read_calibration(args.calibration)
        missing = [s.name for s in loaded.specs if s.name not in by_name]
        if missing:
            raise ConfigError(args.calibration, [("calibration", "no entry for instance(s) "
                                                  + ", ".join(missing))])
        calibration = [by_name[s.name] for s in loaded.specs]
    else:
        print("calibrating on a profiling run (another seed) and a saturation run ...",
              file=sys.stderr)
    age_ms = (loaded.config.sim.snapshot_age_ms if args.snapshot_age_ms is None
              else args.snapshot_age_ms)
    if age_ms < 0:
        raise ConfigError(args.config, [("sim.snapshot_age_ms", "must be >= 0")])
    if args.snapshot_view is not None:
        loaded = loaded.with_updates(sim=loaded.config.sim.model_copy(
            update={"snapshot_view": args.snapshot_view}))
    ev = run_estimate_eval(loaded, policy, names, calibration, snapshot_age_s=age_ms / 1e3)
    rows = error_rows(ev)
    batch_mape = float(np.mean(ev.batch_time_ape) * 100)
    print(format_rows(rows, batch_mape))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        scatter_png(ev, out / "estimate_eval.png",
                    title=f"{policy}, snapshot age {age_ms:g} ms")
        print(f"wrote {out / 'estimate_eval.png'}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"estimators": rows, "batch_time_mape_pct": batch_mape}, indent=2) + "\n")
    return 0


def _model_at_gpu(text: str) -> tuple[str, str]:
    """argparse type: MODEL@GPU (names from the profiles file)."""
    model, sep, gpu = text.partition("@")
    if not (model and sep and gpu):
        raise argparse.ArgumentTypeError(f"expected MODEL@GPU, got {text!r}")
    return model, gpu


def _cmd_emulate(args: argparse.Namespace) -> int:
    import uvloop

    from olproute.emulator import emulation_config, serve_emulators
    from olproute.emulator.lengths import DEFAULT_TRACE, output_lengths

    loaded = emulation_config(load_config(args.config), args.instances, args.profile)
    # read before serving, so that a bad truth file is an error naming its line
    lengths = output_lengths(loaded, seed=args.seed, truth_path=args.truth,
                             trace_path=args.lengths_trace or DEFAULT_TRACE,
                             exact=args.exact_lengths)
    uvloop.run(serve_emulators(loaded, host=args.host, base_port=args.base_port,
                               time_scale=args.time_scale, seed=args.seed, lengths=lengths,
                               stream_interval=args.stream_interval,
                               kv_events_base_port=args.kv_events_base_port))
    return 0


def _cmd_train_predictors(args: argparse.Namespace) -> int:
    from olproute.config.loader import load_profiles
    from olproute.predict import TrainConfig, read_training_file, train_and_evaluate

    if not 0.0 < args.holdout < 1.0:
        raise PredictorError(f"--holdout must be in (0, 1), got {args.holdout}")
    profiles = load_profiles(args.profiles)
    traits = {n: (m.num_params, m.max_context_tokens) for n, m in profiles.models.items()}
    if args.data == "synthetic":
        import numpy as np

        from olproute.sim.prompts import MODELS, generate_prompts, training_data
        from olproute.sim.prompts import write_training_file as write_rows

        models = [m.strip() for m in args.models.split(",")] if args.models else list(MODELS)
        print(f"generating {args.num_prompts:,} synthetic prompts for {len(models)} models",
              file=sys.stderr)
        try:
            prompts = generate_prompts(args.num_prompts, models, np.random.default_rng(args.seed))
        except ValueError as exc:
            raise PredictorError(f"--models: {exc}") from exc
        if args.save_data:
            print(f"wrote {write_rows(args.save_data, prompts):,} rows to {args.save_data}")
        data = training_data(prompts)
    else:
        data = read_training_file(args.data)
    print(f"training on {len(data):,} rows ({len(data.prompts):,} prompts)", file=sys.stderr)
    predictor, evaluation = train_and_evaluate(data, traits, args.holdout,
                                               TrainConfig(seed=args.seed),
                                               progress=not args.no_progress)
    out = Path(args.out)
    predictor.save(out)
    evaluation.plot(out / "eval.png")
    (out / "eval.json").write_text(json.dumps(evaluation.as_dict(), indent=2) + "\n")
    print(evaluation.table())
    print(f"wrote {out}/: decode_mean.txt, quality.txt, decode_p90.txt, pca.npz, "
          "feature_spec.json, eval.json, eval.png")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from olproute.routing.assembly import served_predictor
    from olproute.server import run_server
    from olproute.server.app import say
    from olproute.sim.scenario import CalibrationSource
    from solvers.live import certify
    from solvers.resolve import resolve_live

    loaded = load_config(args.config, _weights(args))
    if args.policy:
        router = loaded.config.router.model_copy(update={"policy": args.policy})
        loaded = loaded.with_updates(router=router)
        if args.policy not in REGISTRY.names():
            raise PolicyError(f"unknown policy {args.policy!r} "
                              f"(known: {', '.join(REGISTRY.names())})")
    loaded = _with_state(loaded, args.state, args.state_secret_file, args.state_insecure)
    if args.calibration:
        path = Path(args.calibration)
        if not path.is_file():
            raise ConfigError(path, [("", "--calibration: no such file")])
        loaded = loaded.with_updates(calibration=str(path.resolve()))
    # the predictor first: a folder that does not load stops serve before anything starts
    if loaded.config.prediction.serve == "predictor":
        say("loading the predictor ...")
    predictor = served_predictor(loaded)
    # calibration: auto profiles the scenario (or, with no workload, a sweep of each
    # instance) in the simulator, at start-up; a file is read and checked now; the live
    # certificate checks bid_price's prices with the exact LP in a worker process, and
    # the re-solves (prices.resolve_period_s) solve it for new prices in another
    calibration = CalibrationSource(loaded)
    if loaded.config.calibration != "auto":
        calibration()   # a file that does not read, or lacks an instance, stops serve here
    run_server(loaded, host=args.host, port=args.port, calibration=calibration,
               certifier=certify, predictor=predictor, resolver=resolve_live)
    return 0


def _with_state(loaded: LoadedConfig, url: str | None, secret_file: str | None,
                insecure: bool) -> LoadedConfig:
    """The config with ``state.url`` from ``--state`` (checked as the key is), and
    ``state.secret_file`` and ``state.insecure`` from their options; a ``ConfigError``
    now, before anything starts, for a shared state without a secret
    (``shared_auth.state_secret``)."""
    from pydantic import ValidationError

    from olproute.server.shared_auth import state_secret

    update: dict[str, Any] = {}
    if url:
        update["url"] = url
    if secret_file:
        update["secret_file"] = str(Path(secret_file).resolve())
    if insecure:
        update["insecure"] = True
    try:
        state = loaded.config.state.model_validate({**loaded.config.state.model_dump(),
                                                    **update})
    except ValidationError as exc:
        raise ConfigError(loaded.path, [("--state", "must be redis://HOST:PORT/DB (or "
                                         f"rediss://, unix://), got {url!r}")]) from exc
    loaded = loaded.with_updates(state=state)
    state_secret(loaded)
    return loaded


def _cmd_lp_check(args: argparse.Namespace) -> int:
    from solvers.check import lp_check_command

    return lp_check_command(_loaded(args), args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="olproute",
        description="Request router for LLM serving: online LP with bid-price control.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_serve, _add_simulate, _add_compare, _add_calibrate, _add_estimate_eval,
                _add_train_predictors, _add_emulate, _add_lp_check):
        add(sub)
    from olproute.cli.operator import add_operator_commands

    add_operator_commands(sub, _add_run_options, _loaded)  # tune, plots
    return parser


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the routing server (OpenAI-compatible proxy)",
                       description="Serve the router on uvloop: /v1/completions, "
                                   "/v1/chat/completions, /route, /prices, /instances, "
                                   "/metrics, /healthz, /openapi.json, /admin/reload, "
                                   "/dashboard (live page). With "
                                   "no server.backends in the config, the instances are "
                                   "emulated in-process. With bid_price, the exact LP "
                                   "checks its prices every prices.certify_period_s in a "
                                   "background process (/prices, /metrics, /dashboard), "
                                   "and with prices.resolve_period_s set, re-solves the "
                                   "recent window's LP for new prices in another.")
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help="configuration YAML (default: %(default)s)")
    p.add_argument("--host", help="address to bind (default: server.host)")
    p.add_argument("--port", type=int, help="port (default: server.port; 0 picks a free one)")
    p.add_argument("--policy", help="routing policy (default: router.policy of the config)")
    p.add_argument("--calibration", metavar="YAML",
                   help="the backends' calibration (olproute calibrate writes it; default: "
                        "the config's calibration key)")
    p.add_argument("--state", metavar="URL",
                   help="redis://HOST:PORT/DB: share the backends' ledgers, the demand and "
                        "the prices with the other replicas of this router there (default: "
                        "state.url of the config; none: in-process). A user and password "
                        "in the URL (redis://USER:PASSWORD@HOST:PORT/DB) or in "
                        "OLPROUTE_STATE_REDIS_USERNAME and _PASSWORD authenticate to Redis; "
                        "rediss:// is TLS")
    p.add_argument("--state-secret-file", metavar="PATH",
                   help="a file holding the secret every replica shares: what a replica "
                        "writes to Redis is signed with it, what it reads is checked "
                        "(default: state.secret_file of the config, else the environment "
                        "variable OLPROUTE_STATE_SECRET)")
    p.add_argument("--state-insecure", action="store_true",
                   help="share state without a secret (messages unsigned: anything that "
                        "can write to the Redis can steer the routers); without it, a "
                        "replica with no secret refuses to start")
    _add_weights_option(p)
    p.set_defaults(handler=_cmd_serve)


def _add_simulate(sub: Any) -> None:
    p = sub.add_parser("simulate", help="run one policy in the cluster simulator",
                       description="Simulate the configured cluster and workload under one "
                                   "routing policy and print its summary.")
    _add_run_options(p)
    p.add_argument("--policy", help=f"policy name ({', '.join(REGISTRY.names())}; "
                                    "default: router.policy of the config)")
    p.set_defaults(handler=_cmd_simulate)


def _add_compare(sub: Any) -> None:
    p = sub.add_parser("compare", help="run several policies on the same workload and seed",
                       description="Run each policy on the same requests and seed; print a "
                                   "table, write compare.csv and a PNG of TTFT/EEL CDFs.")
    _add_run_options(p)
    p.add_argument("--policies", default=None,
                   help=f"comma-separated policy names (default: {MIXED_COMPARE}; on "
                        f"prefill/decode pools: {POOL_COMPARE})")
    p.add_argument("--json", metavar="PATH", help="also write the summaries as JSON")
    p.set_defaults(handler=_cmd_compare)


def _add_calibrate(sub: Any) -> None:
    from olproute.cli.calibrate import add_backend_options

    p = sub.add_parser("calibrate", help="fit per-instance batch-time coefficients (NNLS)",
                       description="Fit beta >= 0 of the 4-term batch-time model, prefill "
                                   "throughput and TPOT per instance from a batch log "
                                   "(batches_<policy>.csv of `simulate --out`), or from a "
                                   "profiling sweep of live backends over HTTP (--backend: "
                                   "streamed completions, prompt lengths x concurrency, "
                                   "timed by their token events).")
    p.add_argument("--batch-log", metavar="CSV", help="batch log to fit")
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help="with --backend: the configuration naming the instances "
                        "(default: %(default)s)")
    add_backend_options(p)
    p.add_argument("--out", default="calibration.yaml", metavar="YAML",
                   help="calibration file to write (default: %(default)s)")
    p.set_defaults(handler=_cmd_calibrate)


def _add_estimate_eval(sub: Any) -> None:
    from olproute.estimate.bea import ESTIMATORS

    p = sub.add_parser("estimate-eval", help="accuracy of every TTFT estimator in simulation",
                       description="Simulate; at each dispatch record every estimator's TTFT "
                                   "for the chosen instance, then compare with the realised "
                                   "TTFT: MAPE, median and P90 error, and a scatter PNG.")
    _add_run_options(p)
    p.add_argument("--policy", help="routing policy (default: router.policy of the config)")
    p.add_argument("--estimators", default=",".join(ESTIMATORS),
                   help="comma-separated estimators (default: %(default)s)")
    p.add_argument("--calibration", metavar="YAML",
                   help="calibration from `olproute calibrate` (default: profile first)")
    p.add_argument("--snapshot-age-ms", type=float, metavar="MS",
                   help="staleness of the snapshots the estimators see "
                        "(default: sim.snapshot_age_ms of the config)")
    p.add_argument("--snapshot-view", choices=("engine", "router"),
                   help="what the estimators see: the engines' exact state, or what a "
                        "router rebuilds of it from its own traffic, as olproute serve "
                        "does (default: sim.snapshot_view of the config)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.set_defaults(handler=_cmd_estimate_eval)


def _add_train_predictors(sub: Any) -> None:
    p = sub.add_parser("train-predictors", help="train the decode-length and quality predictors",
                       description="Train LightGBM predictors of decode length and quality "
                                   "from prompts, evaluate them on held-out prompts, and save "
                                   "them (with eval.json and eval.png) in --out.")
    p.add_argument("--data", required=True, metavar="PATH",
                   help="CSV or .jsonl of prompt, model, output_tokens, quality (optional "
                        "task); or 'synthetic' to generate prompts")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to save the predictor")
    p.add_argument("--holdout", type=float, default=0.2,
                   help="fraction of prompts held out for evaluation (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=5000,
                   help="synthetic prompts to generate (default: %(default)s)")
    p.add_argument("--models", help="comma-separated models for synthetic data "
                                    "(default: every model with synthetic truth)")
    p.add_argument("--seed", type=_seed, default=0, help="seed (default: %(default)s)")
    p.add_argument("--save-data", metavar="PATH",
                   help="also write the synthetic rows as CSV (or .jsonl)")
    p.add_argument("--profiles", default=str(DEFAULT_CONFIG.parent / "profiles.yaml"),
                   help="model profiles, for model traits (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=_cmd_train_predictors)


def _add_emulate(sub: Any) -> None:
    p = sub.add_parser("emulate", help="serve emulated vLLM-like instances over HTTP",
                       description="Run each configured instance as an emulated vLLM-like "
                                   "server (OpenAI-compatible completions with streaming, "
                                   "/metrics with vLLM names, /health), batches timed in "
                                   "real time by the simulator's ground truth, on its own "
                                   "port, until Ctrl-C. A request stops like a model, at a "
                                   "length set by its prompt (the truth of a synthetic "
                                   "workload's or --truth's prompts, else a seeded draw "
                                   "from a trace), capped at max_tokens: finish_reason "
                                   "stop, or length when capped.")
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help="configuration YAML (default: %(default)s)")
    p.add_argument("--instances", type=_positive_int, metavar="N",
                   help="N copies of the first configured instance (default: the config's)")
    p.add_argument("--profile", type=_model_at_gpu, metavar="MODEL@GPU",
                   help="run every instance as this model on this GPU (profiles names)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--base-port", type=int, default=0, metavar="P",
                   help="instance i listens on P+i (default: 0, free ports)")
    p.add_argument("--time-scale", type=positive_float, default=1.0, metavar="X",
                   help="multiply every batch duration by X (<1 runs faster; default: 1)")
    p.add_argument("--seed", type=_seed,
                   help="seed of the batch-time noise, of the output-length draws and of a "
                        "synthetic workload's regenerated prompts (default: sim.seed)")
    p.add_argument("--truth", metavar="PATH",
                   help="true output lengths of known prompts: CSV or JSONL with prompt, "
                        "model, output_tokens (as train-predictors --save-data writes); a "
                        "request with such a prompt stops there (capped at max_tokens)")
    p.add_argument("--lengths-trace", metavar="CSV",
                   help="other prompts stop at a length drawn, seeded by the prompt, from "
                        "this trace's num_decode_tokens (default: "
                        "data/traces/splitwise_conv.csv)")
    p.add_argument("--exact-lengths", action="store_true",
                   help="every request generates exactly max_tokens (finish_reason "
                        "length), the emulator's behaviour before it stopped like a model")
    p.add_argument("--stream-interval", type=_positive_int, default=1, metavar="N",
                   help="as vLLM's: a stream sends its first token at once, then every N "
                        "tokens (one SSE event each, in one write), the rest at its end "
                        "(default: 1)")
    p.add_argument("--kv-events-base-port", type=int_at_least(0), metavar="P",
                   help="publish each instance's KV-cache events as vLLM's "
                        "--kv-events-config does (zmq, topic empty, sha256 block hashes of "
                        "one token per word): instance i's PUB on P+2i, its replay socket "
                        "on P+2i+1 (0: free ports; default: no events)")
    p.set_defaults(handler=_cmd_emulate)


def _add_lp_check(sub: Any) -> None:
    p = sub.add_parser("lp-check", help="exact LP (HiGHS) of a bid_price run vs its prices",
                       description="Simulate with bid_price, recording its window and price "
                                   "history; solve the window's exact LP; print LP*, the "
                                   "online reward, D(p_online), the certificate and gaps, "
                                   "and binding vs priced capacity rows; draw LP duals vs "
                                   "online prices per instance (lp_check.png in --out, or "
                                   "--png).")
    _add_run_options(p)
    p.add_argument("--window-start-s", type=float, metavar="S",
                   help="window start (default: the first price tick)")
    p.add_argument("--window-s", type=positive_float, metavar="S",
                   help="window length (default: to the last arrival)")
    p.add_argument("--max-delay-slots", type=int, metavar="N",
                   help="latest LP start after the earliest, in slots (default: the "
                        "largest realised wait in the window, at most 200)")
    p.add_argument("--gap-tol", type=float, default=0.0, metavar="X",
                   help="stop column generation at D(p) - LP <= X * LP (default: exact)")
    p.add_argument("--png", metavar="PATH", help="price plot (default: OUT/lp_check.png "
                                                  "or lp_check.png)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.set_defaults(handler=_cmd_lp_check)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except (ConfigError, WorkloadError, PolicyError, CalibrationError, PredictorError,
            ExecutorError) as exc:
        print(f"olproute: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
