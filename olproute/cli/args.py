"""argparse value types and options shared by the command line's modules
(``olproute.cli`` and ``olproute.cli.operator``) and the benches."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from olproute.operator.executors import EXECUTORS, Executor


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (the workload fields it overrides need one)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text!r}")
        return value
    return parse


def add_executor_options(p: argparse.ArgumentParser, jobs_option: str = "--jobs") -> None:
    """``--executor {process,ray}`` and ``--ray-address ADDR``: where independent points
    run (``olproute.operator.executors``); ``jobs_option`` is the command's count of workers."""
    p.add_argument("--executor", choices=EXECUTORS, default="process",
                   help="run the points in worker processes (default) or as Ray tasks: "
                        f"on a local Ray of {jobs_option} CPUs, or with --ray-address on a "
                        "Ray cluster (pip install 'olproute[ray]')")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="with --executor ray: the Ray cluster to run on (host:port of its "
                        f"head, or auto) instead of a local Ray; its CPUs, not {jobs_option}, "
                        "set how many points run at once")


def executor_of(args: argparse.Namespace, jobs: int) -> Executor:
    """The executor ``add_executor_options``' options name; ExecutorError if they do not
    go together (an address without ``--executor ray``) or Ray cannot start (not
    installed, nothing at the address)."""
    executor = Executor(args.executor, jobs, args.ray_address)
    executor.check()
    return executor
