"""The OpenAI-compatible FastAPI app in front of rank 0 (never imports mlx)."""

from gateway.app import create_app

__all__ = ["create_app"]
