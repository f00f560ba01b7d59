"""`python -m config`: validate the settings and print them as KEY=VALUE (used by launch.sh).

Exits 2 with one `error: ...` line per bad variable.
"""

import sys

from config.settings import Settings, run_with_settings


def show(settings: Settings) -> int:
    for key, value in settings.as_env().items():
        print(f"{key}={value}")
    return 0


sys.exit(run_with_settings(show))
