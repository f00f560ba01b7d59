"""Entry of the API process: settings, logging (role "api"), uvicorn on API_HOST:API_PORT.

It holds no model and never imports mlx; it talks to rank 0 over SOCKET_PATH and keeps
answering (503 with a reason) while the ranks are down.
"""

from __future__ import annotations

import sys

import uvicorn

from config.logging_setup import setup_logging
from config.settings import Settings, run_with_settings
from gateway.app import create_app


def serve(settings: Settings) -> int:
    log = setup_logging(settings.log_level, "api")
    app = create_app(settings)
    log.info(
        "api listening on http://%s:%d (rank 0 socket %s, auth %s)",
        settings.api_host,
        settings.api_port,
        settings.socket_path,
        "on" if settings.api_key else "off",
    )
    uvicorn.run(
        app,
        host=settings.api_host,
        port=settings.api_port,
        log_config=None,
        access_log=False,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_with_settings(serve))
