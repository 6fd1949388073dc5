"""Run independent calls ``fn(*args)`` in worker processes or as Ray tasks: the points of
``olproute tune`` and of the paper-table benches.

One contract for both executors: ``Executor.run`` returns the results in the order the
calls were given, whatever order they finish in; calls ``on_done(index, result)`` as
each one finishes; and at the first call that raises, cancels the calls not yet started
and raises ``CallFailed``, which names the call and has the call's exception as its
cause.

- ``process``: a ``ProcessPoolExecutor`` of ``jobs`` spawned workers (spawn, not fork:
  the parent may hold JAX's threads, and fork would copy them); ``jobs == 1`` runs the
  calls in this process, one after another.
- ``ray``: each call a Ray task of one CPU. With ``ray_address``, on that cluster (its
  CPUs set how many run at once; its nodes need the same olproute installed); without,
  on a local Ray of ``jobs`` CPUs started for the run and shut down after it, or for
  several runs with ``Executor.session()``. A Ray this process is already connected to
  (a session's, or the caller's ``ray.init``) is used as it is and left running.
  Arguments shared by several calls (the requests, the config) are put in Ray's object
  store once, not sent with every task.

Ray is imported only inside the ray executor: importing it takes about half a second
and starting a local one a few, which no other path should pay.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import socket
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

R = TypeVar("R")
EXECUTORS = ("process", "ray")
RAY_INSTALL = "pip install 'olproute[ray]'"
# nothing listens there: ray.init would retry for minutes, so an address is tried first
CONNECT_TIMEOUT_S = 5.0


class ExecutorError(Exception):
    """An executor cannot run here: an unknown name, a Ray address without the ray
    executor, Ray not installed, no Ray cluster at the address."""


class CallFailed(RuntimeError):
    """Call ``index`` raised; its exception is ``__cause__`` (for Ray, with the worker's
    traceback)."""

    def __init__(self, index: int, what: str, error: BaseException) -> None:
        super().__init__(f"{what} failed: {type(error).__name__}: {error}")
        self.index = index


@dataclass(frozen=True, slots=True)
class Executor:
    """Where independent calls run. ``kind``: ``process`` or ``ray``; ``jobs``: worker
    processes (process) or the CPUs of the local Ray (ray without an address);
    ``ray_address``: a Ray cluster (``host:port`` of its head, ``auto``, or
    ``ray://host:port`` with ``ray[client]``) to run on instead of a local Ray."""

    kind: str = "process"
    jobs: int = 2
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise ExecutorError(f"unknown executor {self.kind!r} (known: "
                                f"{', '.join(EXECUTORS)})")
        if self.jobs < 1:
            raise ExecutorError(f"jobs must be >= 1, got {self.jobs}")
        if self.ray_address is not None and self.kind != "ray":
            raise ExecutorError("a Ray address is for the ray executor (--executor ray)")

    def check(self) -> None:
        """ExecutorError unless this executor can start: for ray, the package installed
        and something accepting connections at the address. Cheap: imports nothing."""
        if self.kind != "ray":
            return
        if not ray_installed():
            raise ExecutorError("--executor ray needs the package ray, which is not "
                                f"installed: {RAY_INSTALL}")
        if self.ray_address:
            _probe(self.ray_address)

    @contextmanager
    def session(self) -> Iterator[None]:
        """For ray: connect (or start the local Ray) once for every ``run`` inside, and
        shut down on leaving what this started; for process, nothing."""
        if self.kind != "ray":
            yield
            return
        ray = _import_ray()
        started = False
        if not ray.is_initialized():   # else the caller's Ray: use it, leave it be
            self.check()
            _connect(ray, self.jobs, self.ray_address)
            started = True
        try:
            yield
        finally:
            if started:
                ray.shutdown()

    def run(self, fn: Callable[..., R], calls: Sequence[tuple[Any, ...]],
            on_done: Callable[[int, R], None] | None = None,
            describe: Callable[[int], str] | None = None) -> list[R]:
        """``[fn(*args) for args in calls]``, run by this executor; ``on_done(i, result)``
        as call i finishes; ``describe(i)`` names call i in a CallFailed (default
        ``call i``). ``fn`` and the arguments must pickle (``fn`` a module-level
        function)."""
        done = on_done or _ignore
        what = describe or _call_name
        if self.kind == "ray":
            with self.session():
                return _run_ray(fn, calls, done, what)
        if not calls:
            return []
        if self.jobs == 1:
            return _run_here(fn, calls, done, what)
        return _run_processes(fn, calls, self.jobs, done, what)


def ray_installed() -> bool:
    """Whether ray can be imported (found without importing it)."""
    return importlib.util.find_spec("ray") is not None


def _ignore(index: int, result: Any) -> None:
    pass


def _call_name(index: int) -> str:
    return f"call {index}"


def _probe(address: str) -> None:
    """ExecutorError if ``address`` is ``[ray://]host:port`` and nothing accepts a TCP
    connection there within CONNECT_TIMEOUT_S (``auto`` and others: Ray answers at
    once)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or "://" in host:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ExecutorError(f"no Ray cluster at --ray-address {address}: cannot connect "
                            f"({reason})") from None


# -- process -------------------------------------------------------------------------------
def _run_here(fn: Callable[..., R], calls: Sequence[tuple[Any, ...]],
              on_done: Callable[[int, R], None], what: Callable[[int], str]) -> list[R]:
    results: list[R] = []
    for i, args in enumerate(calls):
        try:
            results.append(fn(*args))
        except Exception as exc:
            raise CallFailed(i, what(i), exc) from exc
        on_done(i, results[-1])
    return results


def _run_processes(fn: Callable[..., R], calls: Sequence[tuple[Any, ...]], jobs: int,
                   on_done: Callable[[int, R], None], what: Callable[[int], str]
                   ) -> list[R]:
    results: dict[int, R] = {}
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(calls)), mp_context=ctx) as pool:
        futures: dict[Future[R], int] = {pool.submit(fn, *args): i
                                         for i, args in enumerate(calls)}
        for fut in as_completed(futures):
            i = futures[fut]
            try:
                results[i] = fut.result()
            except Exception as exc:
                for other in futures:
                    other.cancel()   # the running ones finish; the pool waits for them
                raise CallFailed(i, what(i), exc) from exc
            on_done(i, results[i])
    return [results[i] for i in range(len(calls))]


# -- ray -----------------------------------------------------------------------------------
def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ExecutorError(f"--executor ray needs the package ray ({exc}): "
                            f"{RAY_INSTALL}") from None
    return ray


def _connect(ray: Any, jobs: int, address: str | None) -> None:
    """Connect to the cluster at ``address``, or start a local Ray of ``jobs`` CPUs."""
    try:
        if address:
            ray.init(address=address, logging_level=logging.ERROR)
        else:
            # a local sweep reports nothing off the machine, unless the user asked for it
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(address="local", num_cpus=jobs, include_dashboard=False,
                     logging_level=logging.ERROR, runtime_env=_local_runtime_env())
    except (ConnectionError, ValueError, RuntimeError) as exc:
        where = f"at --ray-address {address}" if address else "locally"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExecutorError(f"cannot start Ray {where}: {first}") from exc


def _local_runtime_env() -> dict[str, Any]:
    """Workers import modules as this process does (olproute from this checkout, not
    whatever else is installed; a test's or a bench's own module): its ``sys.path`` as
    their PYTHONPATH, as spawned processes get their parent's ``sys.path``."""
    paths = dict.fromkeys(p for p in sys.path if p)
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}


def _shared_refs(ray: Any, calls: Sequence[tuple[Any, ...]]) -> dict[int, Any]:
    """{id(arg): object ref} for every argument object that several calls share, put in
    the object store once (scalars are sent as they are)."""
    counts = Counter(id(a) for args in calls for a in args)
    objects = {id(a): a for args in calls for a in args}
    return {k: ray.put(objects[k]) for k, n in counts.items()
            if n > 1 and not isinstance(objects[k], int | float | str | bool | None)}


def _run_ray(fn: Callable[..., R], calls: Sequence[tuple[Any, ...]],
             on_done: Callable[[int, R], None], what: Callable[[int], str]) -> list[R]:
    """The calls as tasks of the Ray this process is connected to."""
    import ray

    task = ray.remote(fn)
    shared = _shared_refs(ray, calls)
    refs = [task.remote(*(shared.get(id(a), a) for a in args)) for args in calls]
    index = {ref: i for i, ref in enumerate(refs)}
    results: dict[int, R] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        i = index[ready[0]]
        try:
            results[i] = ray.get(ready[0])
        except ray.exceptions.RayError as exc:
            for ref in pending:
                ray.cancel(ref)
            # RayTaskError: the call's own exception is its cause
            error = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
            raise CallFailed(i, what(i), error) from exc
        on_done(i, results[i])
    return [results[i] for i in range(len(calls))]
