"""The OpenAI surface: wire types (protocol.py) and one adapter per endpoint family."""
