"""The socket protocol shared by api.py and rank 0 of server.py."""
