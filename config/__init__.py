"""Settings shared by every process: one pydantic model read from the environment and .env.

The names live where they are defined: config/settings.py (Settings, SettingsError,
load_settings, run_with_settings) and config/logging_setup.py; import them from there.
"""
