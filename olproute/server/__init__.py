"""The routing server: an aiohttp application on uvloop in front of serving backends
(``olproute serve``). ``init_app`` builds it; ``run_server`` serves it."""

from olproute.server.app import init_app, run_server

__all__ = ["init_app", "run_server"]
