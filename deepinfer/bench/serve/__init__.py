"""``deepinfer bench serve``: an online serving benchmark against a running
OpenAI-compatible server (ours, vLLM, SGLang, ...), with the metric names and
result layout of ``vllm bench serve``.

args.py (options, argparse only) · workload.py (prompts, conversations and arrival times) ·
conversations.py (the multi-turn workload's turns, each sent when the last is answered) ·
http_client.py (all the HTTP: the aiohttp session, server-sent events, errors) ·
endpoint.py (one streamed completion, timed) · metrics.py (accounting and the
result block) · runner.py (the run).
"""
