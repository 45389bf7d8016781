"""Cache-aware routing across data-parallel replicas of ``deepinfer serve``.

policy.py (which replica a request goes to: the approximate radix tree of what each
replica holds, load balance; pure, no I/O) · app.py (the HTTP proxy: OpenAI routes passed
through, health checks, retries, its own /metrics) · replicas.py (starting N ``deepinfer
serve`` processes, for ``deepinfer serve --replicas N`` and the serving benchmark).
"""
