"""``olproute calibrate --backend NAME=URL``: a profiling sweep of live backends over HTTP
(``olproute.estimate.sweep``), one after the other, written as the calibration file ``olproute
calibrate --batch-log`` writes (keys: the config's instance names)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from olproute.config.loader import LoadedConfig, load_config
from olproute.estimate.calibration import CalibrationError, write_calibration
from olproute.types import InstanceSpec

if TYPE_CHECKING:   # aiohttp and the sweep are imported when a sweep runs
    from olproute.estimate.sweep import SweepPlan, SweepResult

# a backend's first requests may pay its compilations (20 s on vLLM's CPU build)
READ_TIMEOUT_S = 300.0


def backend_arg(text: str) -> tuple[str, str]:
    """argparse type: NAME=URL."""
    name, sep, url = text.partition("=")
    if not (name and sep and url.startswith(("http://", "https://"))):
        raise argparse.ArgumentTypeError(f"expected NAME=URL (an http:// or https:// URL), "
                                         f"got {text!r}")
    return name, url.rstrip("/")


def add_backend_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", type=backend_arg, default=[],
                   metavar="NAME=URL", help="profile the live backend of instance NAME (of "
                   "--config) at URL over HTTP; repeat for several (one after the other)")
    p.add_argument("--all-backends", action="store_true",
                   help="profile every backend of --config's server.backends")
    p.add_argument("--model", help="the model name to send (default: the backend's "
                                   "served_model in the config, else what /v1/models lists)")
    p.add_argument("--quick", action="store_true",
                   help="a shorter sweep (prompts 16/128/512, concurrency 1/4/16, 32 tokens)")
    p.add_argument("--seed", type=int, default=0, help="prompts' seed (default: %(default)s)")


def _specs(loaded: LoadedConfig, backends: Sequence[tuple[str, str]]) -> list[InstanceSpec]:
    by_name = {s.name: s for s in loaded.specs}
    unknown = [n for n, _ in backends if n not in by_name]
    if unknown:
        raise CalibrationError(f"--backend {', '.join(unknown)}: not an instance of "
                               f"{loaded.path} (instances: {', '.join(by_name)})")
    names = [n for n, _ in backends]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CalibrationError(f"--backend {', '.join(twice)} given more than once")
    return [by_name[n] for n in names]


def _served_model(loaded: LoadedConfig, name: str) -> str | None:
    for b in loaded.config.server.backends:
        if b.name == name:
            return b.served_model
    return None


async def _sweep_all(loaded: LoadedConfig, backends: Sequence[tuple[str, str]],
                     specs: Sequence[InstanceSpec], model: str | None,
                     plan: SweepPlan) -> list[SweepResult]:
    import aiohttp

    from olproute.estimate.sweep import backend_model, sweep_backend

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=READ_TIMEOUT_S)
    results = []
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        for (name, url), spec in zip(backends, specs, strict=True):
            hint = model or _served_model(loaded, name)
            served, length = await backend_model(session, name, url, spec, hint)
            profile = loaded.profiles.models.get(spec.model)
            if length is None:
                length = (profile.max_context_tokens if profile is not None
                          else spec.kv_capacity_tokens)
            print(f"{name}: {url}, model {served!r}, context {length} tokens",
                  file=sys.stderr)
            results.append(await sweep_backend(
                session, name, url, served, spec, length, plan,
                progress=lambda m: print(m, file=sys.stderr, flush=True)))
    return results


def calibrate_backends(args: argparse.Namespace) -> int:
    from olproute.estimate.sweep import QUICK_PLAN, SweepError, SweepPlan

    loaded = load_config(args.config)
    specs = _specs(loaded, args.backend)
    plan = replace(QUICK_PLAN if args.quick else SweepPlan(), seed=args.seed)
    try:
        results = asyncio.run(_sweep_all(loaded, args.backend, specs, args.model, plan))
    except TimeoutError as exc:
        raise SweepError(f"a backend did not answer within {READ_TIMEOUT_S:g} s") from exc
    write_calibration({r.name: r.calibration for r in results}, args.out)
    print(result_table(results))
    missing = [s.name for s in loaded.specs if s.name not in {r.name for r in results}]
    if missing:
        print(f"olproute: note: {args.out} has no entry for instance(s) "
              f"{', '.join(missing)}; `calibration: {args.out}` needs them all",
              file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


def result_table(results: Sequence[SweepResult]) -> str:
    """Per backend: rows, beta, the dispatch overhead, TPOT, prefill throughput, the
    fit's MAPE on its own rows and the sweep's time."""
    lines = [f"{'instance':<20} {'rows pre/dec':>12} {'beta0 ms':>9} {'beta1 us/tok':>12} "
             f"{'beta2 ns/ctx':>12} {'beta3 ps/attn':>13} {'overhead ms':>11} "
             f"{'TPOT ms':>8} {'prefill tok/s':>13} {'fit MAPE %':>10} {'sweep s':>8}"]
    for r in results:
        c = r.calibration
        b = c.beta
        rows = f"{r.num_prefill_rows}/{r.num_decode_rows}"
        lines.append(f"{r.name:<20} {rows:>12} {b[0] * 1e3:>9.3f} {b[1] * 1e6:>12.4f} "
                     f"{b[2] * 1e9:>12.4f} {b[3] * 1e12:>13.4f} {r.overhead_s * 1e3:>11.3f} "
                     f"{c.tpot_s * 1e3:>8.3f} {c.prefill_tokens_per_s:>13.0f} "
                     f"{r.fit_mape * 100:>10.2f} {r.duration_s:>8.1f}")
    return "\n".join(lines)
