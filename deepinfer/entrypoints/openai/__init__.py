"""The OpenAI-compatible server (``deepinfer serve``); see api_server.py."""
