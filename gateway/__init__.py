"""The OpenAI-compatible FastAPI app in front of rank 0 (never imports mlx); the app is made
by gateway/app.py `create_app`."""
