"""``POST /admin/reload``: re-read the config and the weight profiles, and swap in a new
router built from them, or answer why not and keep the running one untouched.

Who may: a bearer token, compared as bytes in constant time. Which files: the config
the router started with, and weight profiles (``.yaml``/``.yml``) under the config's
folder, the shipped ``configs/weights/``, ``server.reload_weights_dirs``, or those the
router runs with. Errors give key paths and what is wrong (``load_config(quote=False)``):
never a line of a file (a YAML error gives its line and column), a value a type check
refused or a key the file made up; a few checks name the name they looked up (an unknown
model or policy).
What may change: not what is fixed at start-up (:data:`RESTART_KEYS`, the instances);
such a change is refused by name instead of silently ignored.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
from pathlib import Path

from aiohttp import web

from olproute.config.loader import ConfigError, LoadedConfig, load_config
from olproute.config.profiles import WEIGHTS_DIR, resolve_profile
from olproute.routing.assembly import CalibrationSource, served_predictor
from olproute.routing.router import Router
from olproute.server import proxy
from olproute.server.schema import BadRequest, ReloadBody, validate
from olproute.server.state import STATE, ServerState, log_unpredicted

LOG = logging.getLogger("olproute.server")

# server keys read once, when the router starts (the listening socket, the backends,
# the HTTP sessions, the central buffer's budget, the periods of the background jobs,
# the embedded emulators)
RESTART_KEYS = ("host", "port", "backends", "emulator_time_scale", "emulator_exact_lengths",
                "emulator_stream_interval", "emulator_truth", "emulator_kv_events",
                "request_timeout_s", "connect_timeout_s", "hold_budget_ms", "health_period_s",
                "scrape_period_s", "recalibrate_period_s", "prefill_from_kv_events",
                "running_from_scrape")
PROFILE_SUFFIXES = (".yaml", ".yml")


async def reload(request: web.Request) -> web.Response:
    """Re-read the YAML. An invalid file, a profile the caller may not name, or a change
    that needs a restart keeps the running router and answers 400 naming the key."""
    st = request.app[STATE]
    if not authorized(request.headers.get("Authorization", ""), st.admin_token):
        return proxy.error_response(401, "admin endpoints need 'Authorization: Bearer <token>'"
                                    f" (set {st.loaded.config.server.admin_token_env})",
                                    kind="unauthorized")
    server = st.loaded.config.server
    try:
        data = (await proxy.read_json(request, server.max_body_bytes, server.body_timeout_s)
                if request.can_read_body else {})
        body: ReloadBody = validate(ReloadBody, data)
        weights = (list(st.loaded.weights) if body.weights is None
                   else allowed_profiles(body.weights, st.loaded))
    except BadRequest as exc:
        return web.json_response(exc.as_json(), status=400)
    loop = asyncio.get_running_loop()
    async with st.swap_lock:
        try:
            new = await loop.run_in_executor(None, _load, st.loaded.path, weights)
            refused = unchangeable(st.loaded, new)
            if refused:
                raise ConfigError(st.loaded.path, refused)
            router = await loop.run_in_executor(None, _build_router, st, new)
        except ConfigError as exc:
            key = exc.problems[0][0] if exc.problems else None
            return proxy.error_response(400, str(exc), param=key or None,
                                        kind="invalid_config")
        _swap(st, router)
        st.loaded = new
    if st.holding is not None:
        st.holding.max_held = new.config.admission.max_held
    return web.json_response({"status": "reloaded", "config": str(new.path),
                              "policy": router.policy_name,
                              "weights": [str(w) for w in new.weights]})


async def rebuild_on_engines(st: ServerState) -> None:
    """The backends' engines say they run otherwise than the router was built for
    (``ServerState.engine_specs`` changed): build the router again on what they say (its
    policy's instance limits, BEA's replays, the prices' capacities) and swap it in, as a
    reload does. Its learned prices start again; a failure keeps the running router."""
    loop = asyncio.get_running_loop()
    async with st.swap_lock:
        if not st.rebuild_wanted:
            return
        st.rebuild_wanted = False
        try:
            router = await loop.run_in_executor(None, _build_router, st, st.loaded)
        except ConfigError as exc:
            print(f"olproute: the router could not be built on what the engines say ({exc});"
                  " it keeps modelling the profiles", file=sys.stderr)
            return
        _swap(st, router)
    said = ", ".join(f"{s.name} (blocks of {s.block_size} tokens, {s.num_kv_blocks:,} "
                     "KV blocks)" for s in (st.engine_specs[g] for g in sorted(st.engine_specs)))
    print("olproute: router rebuilt on what the engines say"
          + (f": {said}" if said else ": every engine as its profile")
          + "; its learned prices start again", file=sys.stderr)


def _swap(st: ServerState, router: Router) -> None:
    """Put a newly built router in the running one's place: the ids of requests in flight
    stay unique, the prefix index (what the backends cache) and refitted betas carry over."""
    router.continue_ids(st.router)
    for g, beta in st.recalibrated():
        router.set_beta(g, beta)
    st.router = router


def authorized(header: str, token: str | None) -> bool:
    """Does an Authorization header carry the bearer token? Compared as bytes in
    constant time (a header may hold any bytes; aiohttp decodes them with
    surrogateescape, undone here)."""
    if token is None:
        return False
    given = header.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {token}".encode("utf-8", "surrogateescape"))


def allowed_profiles(given: str | list[str], loaded: LoadedConfig) -> list[Path]:
    """The profile files a reload body names (a path, a list of paths, or the name of a
    shipped profile; ``[]`` drops them), each a ``.yaml``/``.yml`` file, symlinks
    resolved, under an allowed folder or one the router runs with; else BadRequest."""
    roots = allowed_dirs(loaded)
    current = {Path(w).resolve() for w in loaded.weights}
    out = []
    for i, name in enumerate([given] if isinstance(given, str) else given):
        key = "weights" if isinstance(given, str) else f"weights[{i}]"
        try:
            path = resolve_profile(name).resolve()
        except (ConfigError, OSError, RuntimeError):
            raise BadRequest(key, "no such file, and not a shipped weight profile") from None
        inside = any(path.is_relative_to(r) for r in roots)
        if path not in current and (path.suffix not in PROFILE_SUFFIXES or not inside):
            raise BadRequest(key, "not a weight profile the router may read: a .yaml file "
                             f"under {', '.join(str(r) for r in roots)} "
                             "(server.reload_weights_dirs adds folders)")
        out.append(path)
    return out


def allowed_dirs(loaded: LoadedConfig) -> list[Path]:
    """Where a reload may read profiles: the config's folder, the shipped profiles, and
    ``server.reload_weights_dirs`` (relative to the config's folder)."""
    extra = [loaded.resolve(d) for d in loaded.config.server.reload_weights_dirs]
    return list(dict.fromkeys(p.resolve() for p in [loaded.base_dir, WEIGHTS_DIR, *extra]))


def unchangeable(old: LoadedConfig, new: LoadedConfig) -> list[tuple[str, str]]:
    """The changes a reload cannot apply, by key: the instances, and the server keys
    read only at start-up."""
    problems = [(f"server.{k}", "cannot change while serving (restart the router)")
                for k in RESTART_KEYS
                if getattr(new.config.server, k) != getattr(old.config.server, k)]
    if new.specs != old.specs:
        problems.append(("instances", "cannot change while serving (restart the router)"))
    return problems


def _load(path: Path, weights: list[Path]) -> LoadedConfig:
    try:
        return load_config(path, weights, quote=False)
    except ConfigError:
        raise
    except ValueError as exc:  # a check outside the config's own (workloads, profiles)
        raise ConfigError(path, [("", str(exc))]) from None


def _build_router(st: ServerState, new: LoadedConfig) -> Router:
    """The router of a reloaded config, calibrated as the running one, with the running
    predictor unless ``prediction.serve`` or ``prediction.model_dir`` changed (then the
    one they name, loaded now; a folder that does not load is a ConfigError naming the
    key); a failure of the policy (refusing its parameters) is a ConfigError naming the
    policy's keys."""
    old, now = st.loaded.config.prediction, new.config.prediction
    same = (old.serve, old.model_dir) == (now.serve, now.model_dir)
    predictor = st.router.predictor if same else served_predictor(new)
    try:
        calibration = CalibrationSource(new, known=st.router.calibration())
        router = Router(st.modelled(new), calibration, predictor=predictor)
    except Exception as exc:
        router_cfg = new.config.router
        key = (f"router.policy_params.{router_cfg.policy}"
               if router_cfg.policy in router_cfg.policy_params else "router.policy")
        if isinstance(exc, ValueError):
            raise ConfigError(new.path, [(key, str(exc))]) from None
        LOG.warning("reload: building the router failed", exc_info=exc)
        raise ConfigError(new.path, [(key, f"{type(exc).__name__}: {exc}")]) from None
    if not same:
        log_unpredicted(router)
    return router
