"""Emulated vLLM-like serving instances over HTTP, timed in real time by the simulator's
ground-truth batch-time model (for ``olproute emulate``, the router's embedded default
and the tests).

- ``engine``: ``EmulatedInstance``, the real-time engine loop around a ``SimEngine``.
- ``lengths``: ``OutputLengths``, where each request stops (its prompt's truth, or a
  seeded draw from a trace's output lengths; capped at ``max_tokens``), computable
  offline with the same result.
- ``protocol``: the OpenAI-compatible request validation and response/chunk formats.
- ``metrics``: Prometheus metrics under vLLM's names, one registry per instance.
- ``kv_blocks``: vLLM's names of a prompt's blocks and the book that turns the core's
  prefix-cache log into vLLM's KV events; ``kv_publisher``: those events on ZMQ (PUB and
  the replay ROUTER), as vLLM's ``--kv-events-config`` publishes them.
- ``app``: the aiohttp app factory ``init_app`` and ``start_emulators`` / ``emulators``.
"""

from olproute.emulator.app import (
    INSTANCE_HEADER,
    RunningEmulator,
    emulation_config,
    emulators,
    ground_truth_timers,
    init_app,
    serve_emulators,
    start_emulators,
    stop_emulators,
)
from olproute.emulator.engine import BATCH_COLUMNS, EmulatedInstance, EmulatedRequest
from olproute.emulator.lengths import OutputLengths, body_prompt_key, output_lengths, prompt_key

__all__ = ["BATCH_COLUMNS", "INSTANCE_HEADER", "EmulatedInstance", "EmulatedRequest",
           "OutputLengths", "RunningEmulator", "body_prompt_key", "emulation_config",
           "emulators", "ground_truth_timers", "init_app", "output_lengths", "prompt_key",
           "serve_emulators", "start_emulators", "stop_emulators"]
