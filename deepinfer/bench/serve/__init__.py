"""``deepinfer bench serve``: an online serving benchmark against a running
OpenAI-compatible server (ours, vLLM, SGLang, ...), with the metric names and
result layout of ``vllm bench serve``.

args.py (options, argparse only) · workload.py (prompts and arrival times) ·
http_client.py (all the HTTP: the aiohttp session, server-sent events, errors) ·
endpoint.py (one streamed completion, timed) · metrics.py (accounting and the
result block) · runner.py (the run).
"""
