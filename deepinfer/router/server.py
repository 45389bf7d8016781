"""``deepinfer router`` and ``deepinfer serve --replicas N``: command-line options (argparse
only, so the CLI builds its parser without importing the router) and running them."""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

from deepinfer.router.policy import POLICIES, CacheAwareConfig

logger = logging.getLogger(__name__)


def add_policy_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The routing options; ``prefix`` ("router-" on ``serve``) keeps them apart from engine flags."""
    defaults = CacheAwareConfig()
    g = p.add_argument_group("routing")
    g.add_argument(f"--{prefix}policy", choices=POLICIES, default="cache-aware",
                   help="cache-aware: prefix affinity (an approximate radix tree of the prompts each replica "
                        "was sent) weighed against load; round-robin: one replica after the other")
    g.add_argument(f"--{prefix}load-weight", type=float, default=defaults.load_weight,
                   help="cache-aware: the work one request in flight counts for, in mean prompts (0: the cache "
                        "alone decides)")
    g.add_argument(f"--{prefix}balance-abs-threshold", type=int, default=defaults.balance_abs_threshold,
                   help="cache-aware: ignore affinity when the busiest replica has more than this many requests "
                        "in flight above the least busy one ...")
    g.add_argument(f"--{prefix}balance-rel-threshold", type=float, default=defaults.balance_rel_threshold,
                   help="... and more than this many times its load")
    g.add_argument(f"--{prefix}max-tree-size", type=int, default=defaults.max_tree_size,
                   help="cache-aware: prompt characters (or token ids) remembered per replica, least recently "
                        "used forgotten first")
    g.add_argument(f"--{prefix}max-retries", type=int, default=2,
                   help="times a request a replica failed is sent to another")
    g.add_argument(f"--{prefix}health-interval", type=float, default=5.0,
                   help="seconds between health checks of each replica")


def router_config(args: argparse.Namespace, backends: Sequence[str], prefix: str = "",
                  prefill: Sequence[str] = (), prefill_timeout_s: float = 600.0, prefill_min_len: int = 0,
                  kv_transfer: str = "inline"):
    """The :class:`RouterConfig` of the options ``add_policy_args`` added; ``prefill``: the
    prefill instances of prefill/decode disaggregation (``backends`` are then the decode ones)."""
    from deepinfer.router.app import RouterConfig

    def get(name: str):
        return getattr(args, (prefix + name).replace("-", "_"))

    cache_aware = CacheAwareConfig(load_weight=get("load-weight"),
                                   balance_abs_threshold=get("balance-abs-threshold"),
                                   balance_rel_threshold=get("balance-rel-threshold"),
                                   max_tree_size=get("max-tree-size"))
    return RouterConfig(backends=tuple(backends), policy=get("policy"), cache_aware=cache_aware,
                        max_retries=get("max-retries"), health_interval_s=get("health-interval"),
                        prefill=tuple(prefill), prefill_timeout_s=prefill_timeout_s,
                        prefill_min_len=prefill_min_len, kv_transfer=kv_transfer)


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", nargs="+", action="extend", default=[], metavar="URL",
                   help="replica URLs, e.g. http://10.0.0.2:8000 (repeatable)")
    pd = p.add_argument_group("prefill/decode disaggregation (instead of --backend)")
    pd.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                    help="prefill instances (deepinfer serve --role prefill): they compute each request's prompt "
                         "and the router moves its KV blocks to the decode instance over HTTP")
    pd.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                    help="decode instances (deepinfer serve --role decode --kv-offload-gib G)")
    pd.add_argument("--prefill-timeout", type=float, default=600.0,
                    help="seconds a prefill instance has to answer a request's KV blocks before it counts as "
                         "failed")
    pd.add_argument("--prefill-min-len", type=int, default=0,
                    help="prompts shorter than this (characters; token ids for token-id prompts) go straight to the "
                         "decode instance, which computes them itself (default 0: every prompt is prefilled)")
    pd.add_argument("--kv-transfer", choices=("inline", "shared"), default="inline",
                    help="how KV blocks move from prefill to decode instances: inline (in the HTTP bodies; any "
                         "hosts) or shared (prefill and decode instances on this host: a buffer they share, CUDA "
                         "IPC between GPUs or shared memory on the CPU; only its handle goes over HTTP)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_policy_args(p)


def _serve_app(app, host: str, port: int, log_level: str) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level.lower())


def run_router(args: argparse.Namespace) -> int:
    """``deepinfer router``: route to the ``--backend`` replicas until interrupted."""
    from deepinfer.router.app import build_router_app

    if args.prefill or args.decode:
        if args.backend:
            raise ValueError("--backend with --prefill/--decode: give replicas, or prefill and decode instances")
        if not (args.prefill and args.decode):
            raise ValueError("prefill/decode disaggregation needs both --prefill URL ... and --decode URL ...")
        app = build_router_app(router_config(args, args.decode, prefill=args.prefill,
                                             prefill_timeout_s=args.prefill_timeout,
                                             prefill_min_len=args.prefill_min_len,
                                             kv_transfer=args.kv_transfer))
        logger.warning("routing (%s) prefills over %s and decodes over %s on http://%s:%d", args.policy,
                       ", ".join(args.prefill), ", ".join(args.decode), args.host, args.port)
    else:
        app = build_router_app(router_config(args, args.backend))
        logger.warning("routing (%s) over %s on http://%s:%d", args.policy, ", ".join(args.backend), args.host,
                       args.port)
    _serve_app(app, args.host, args.port, args.log_level)
    return 0


def run_replicas(args: argparse.Namespace) -> int:
    """``deepinfer serve --replicas N``: N replicas of this ``serve`` command on free local
    ports, and the router on ``--host:--port`` in front of them, until interrupted."""
    from deepinfer.router import replicas
    from deepinfer.router.app import build_router_app

    # Checked before the replicas take minutes to load.
    router_config(args, ["http://127.0.0.1"], prefix="router_")
    with replicas.replicas(args.replicas, args.argv) as children:
        urls = [c.url for c in children]
        app = build_router_app(router_config(args, urls, prefix="router_"))
        logger.warning("%d replicas (%s) behind the router (%s) on http://%s:%d", len(urls), ", ".join(urls),
                       args.router_policy, args.host, args.port)
        _serve_app(app, args.host, args.port, args.log_level)
    return 0
