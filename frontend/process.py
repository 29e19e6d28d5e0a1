"""run_frontend: the API process's entry point (uvloop, logging, graceful drain on SIGTERM).

One of ``api_servers`` frontends binds its port with SO_REUSEPORT, so the kernel spreads new
connections over all of them; a connection, and every request kept alive on it, stays with the
process that accepted it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from aiohttp import web

from frontend.app import CLIENT, HANDLER, create_app
from frontend.config import FrontendConfig

log = logging.getLogger("nanoserve.frontend")

BIND_FAILED = 2  # a usage error (the port is taken): restarting would only fail again


def run_frontend(*, config: FrontendConfig) -> int:
    """Serve until SIGTERM or SIGINT, then stop admitting (503), drain, and return 0; return
    ``BIND_FAILED`` when the port cannot be bound."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s frontend %(name)s: %(message)s",
    )
    app = create_app(config)  # loads the tokenizer before the port opens
    try:
        import uvloop
    except ImportError:  # uvloop is optional off Linux/macOS
        return asyncio.run(_serve(app, config))
    return uvloop.run(_serve(app, config))


async def _serve(app: web.Application, config: FrontendConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port)
    try:
        await site.start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, exc.strerror or exc)
        await runner.cleanup()
        return BIND_FAILED
    log.info(
        "serving on http://%s:%d (frontend %d of %d; scheduler %s)",
        config.host,
        config.port,
        config.api_server_index + 1,
        config.api_servers,
        config.addresses.frontend,
    )
    await stop.wait()
    await _drain(app, config.drain_timeout)
    await runner.cleanup()
    log.info("stopped")
    return 0


async def _drain(app: web.Application, timeout: float) -> None:
    """Refuse new requests, then wait up to ``timeout`` for in-flight ones to finish."""
    app[HANDLER].draining = True
    client = app[CLIENT]
    deadline = time.monotonic() + timeout
    log.info("draining %d in-flight requests (up to %.0f s)", client.num_in_flight, timeout)
    while client.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if client.num_in_flight:
        log.warning("drain timeout: aborting %d requests", client.num_in_flight)
