"""`python -m config`: validate the settings and print them as KEY=VALUE (used by launch.sh)."""

from config.settings import load_settings

settings = load_settings()
for key, value in settings.model_dump().items():
    print(f"{key.upper()}={value}")
