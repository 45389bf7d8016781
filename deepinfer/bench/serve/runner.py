"""``deepinfer bench serve``: build the workload, send it at the asked rate and
concurrency, account for what came back, print vLLM's result block and save its JSON.

The run's duration is from the first send to the last response; warm-up requests
come before it. The model name is the server's first (``GET /v1/models``) unless
``--model`` names one, and the tokenizer the model path that listing reports
(its ``root``, as vLLM and our server report it), unless ``--tokenizer`` names one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import shlex
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tqdm import tqdm

from deepinfer.bench.serve import conversations, endpoint, http_client, metrics, workload
from deepinfer.bench.serve.endpoint import RequestResult
from deepinfer.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import aiohttp


def _key_values(items: Sequence[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE items, got {item!r}")
        out[key.strip()] = value.strip()
    return out


# Options whose values stay out of the command recorded in the results.
_SECRET_OPTIONS = ("--api-key", "--header")


def _redacted(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    secret = False
    for arg in argv:
        if arg.startswith("--"):
            name, eq, _ = arg.partition("=")
            secret = name in _SECRET_OPTIONS
            out.append(f"{name}=***" if secret and eq else arg)
        else:
            out.append("***" if secret else arg)
    return out


async def _listed_models(session: aiohttp.ClientSession, base_url: str,
                         headers: dict[str, str]) -> list[dict[str, Any]]:
    """The server's ``GET /v1/models`` entries (id, root, ...)."""
    url = f"{base_url}/v1/models"
    try:
        async with session.get(url, headers=headers) as resp:
            body = await resp.read()
            status = resp.status
    except http_client.request_errors() as exc:
        raise ValueError(f"no answer from {url} ({http_client.describe(exc)}): is the server up at "
                         "--base-url/--host/--port?") from exc
    if status != 200:
        raise ValueError(f"GET {url} answered {status}: {body[:300].decode('utf-8', 'replace')}")
    models = json.loads(body).get("data") or []
    if not models:
        raise ValueError(f"{url} lists no model; pass --model and --tokenizer")
    return models


def _resolve_tokenizer(arg: str | None, root: str | None) -> str:
    if arg is not None:
        return arg
    if root and (Path(root) / "tokenizer.json").is_file():
        return root
    raise ValueError(f"--tokenizer: the server's model path {root!r} is not a local directory with a "
                     "tokenizer.json; pass --tokenizer DIR (the served model's tokenizer)")


async def _run(args: argparse.Namespace, base_url: str, url: str, headers: dict[str, str]) -> dict[str, Any]:
    """The run, through one HTTP session (and its connection pool), warm-ups included."""
    async with http_client.session(args.request_timeout) as session:
        return await _run_in(session, args, base_url, url, headers)


async def _run_in(session: aiohttp.ClientSession, args: argparse.Namespace, base_url: str, url: str,
                  headers: dict[str, str]) -> dict[str, Any]:
    kind = endpoint.endpoint_type(args.endpoint)
    tokenize_prompt = (kind == endpoint.COMPLETIONS) if args.tokenize_prompt is None else args.tokenize_prompt
    if tokenize_prompt and kind == endpoint.CHAT:
        raise ValueError("--tokenize-prompt: chat completions take text; use --no-tokenize-prompt or "
                         "--endpoint /v1/completions")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0 s, got {args.request_timeout}")
    percentile_metrics = metrics.parse_percentile_metrics(args.percentile_metrics)
    percentiles = metrics.parse_percentiles(args.metric_percentiles)
    goodput = metrics.parse_goodput(args.goodput)
    metadata = _key_values(args.metadata, "--metadata")

    model, root = args.model, None
    if model is None or args.tokenizer is None:
        listed = await _listed_models(session, base_url, headers)
        entry = next((m for m in listed if m.get("id") == model), None if model else listed[0])
        model = model or listed[0]["id"]
        root = entry.get("root") if entry else None
    tokenizer_path = _resolve_tokenizer(args.tokenizer, root)
    tokenizer = Tokenizer(tokenizer_path)
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                  ("top_k", args.top_k)) if v is not None}
    extra_body = sampling | (args.extra_body or {})
    multiturn: dict[str, Any] = {}
    if args.dataset_name == "multiturn":
        if kind != endpoint.CHAT:
            raise ValueError("--dataset-name multiturn sends conversations: use --endpoint /v1/chat/completions")
        results, turns, t0, duration = await _send_conversations(session, args, url, headers, model, tokenizer,
                                                                  tokenizer_path, extra_body)
        multiturn = {"multiturn_conversations": args.multiturn_conversations,
                     "multiturn_turns": args.multiturn_turns, "multiturn_system_len": args.multiturn_system_len,
                     "multiturn_question_len": args.multiturn_question_len} | metrics.multiturn_metrics(results, turns)
    else:
        offsets = workload.arrival_times(args.num_prompts, args.request_rate, args.burstiness, args.seed)
        results, t0, duration = await _send_random(session, args, url, headers, model, kind, tokenizer,
                                                   tokenizer_path, tokenize_prompt, extra_body, offsets)

    for r in results:
        if r.success and r.output_tokens is None:
            r.output_tokens = len(tokenizer.encode(r.generated_text, add_special_tokens=False))
    failed = [r.error for r in results if not r.success]
    if failed:
        print(f"{len(failed)} requests failed; the first {min(len(failed), 10)} errors:", file=sys.stderr)
        for error in failed[:10]:
            print(f"  {error}", file=sys.stderr)
    summary = metrics.compute_metrics(results, duration, percentile_metrics=percentile_metrics,
                                      percentiles=percentiles, goodput=goodput)
    print(metrics.format_result(summary, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                                percentile_metrics=percentile_metrics, percentiles=percentiles))
    if multiturn:
        print(metrics.format_multiturn(multiturn))
    num_prompts = args.multiturn_conversations * args.multiturn_turns if multiturn else args.num_prompts
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": kind,
        "backend": kind,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": tokenizer_path,
        "num_prompts": num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "endpoint": args.endpoint,
        "dataset_name": args.dataset_name,
        "tokenize_prompt": tokenize_prompt,
        "ignore_eos": args.ignore_eos,
        "goodput_slos_ms": goodput or None,
        "command": " ".join(["deepinfer", *_redacted(getattr(args, "argv", []))]),
    } | metadata | summary | multiturn
    if args.save_detailed:
        result |= metrics.per_request(results, t0)
    return result


async def _send_random(session: aiohttp.ClientSession, args: argparse.Namespace, url: str, headers: dict[str, str],
                       model: str, kind: str, tokenizer: Tokenizer, tokenizer_path: str, tokenize_prompt: bool,
                       extra_body: dict[str, Any], offsets: Any) -> tuple[list[RequestResult], float, float]:
    """The random workload at its arrival times; the results, the start and the duration."""
    # A text prompt on /v1/completions gets the tokenizer's special tokens (BOS) from the server.
    added = len(tokenizer.encode("", add_special_tokens=True)) if kind == endpoint.COMPLETIONS else 0
    requests = workload.sample_random(
        tokenizer, num_prompts=args.num_prompts, input_len=args.random_input_len,
        output_len=args.random_output_len, range_ratio=args.random_range_ratio,
        prefix_len=args.random_prefix_len, seed=args.seed, as_text=not tokenize_prompt,
        added_special_tokens=0 if tokenize_prompt else added)
    payloads = [endpoint.build_payload(kind, model, r, ignore_eos=args.ignore_eos, extra_body=extra_body)
                for r in requests]

    lens = [r.prompt_len for r in requests]
    print(f"Model: {model}; tokenizer: {tokenizer_path}; {kind} at {url}; prompts as "
          f"{'token ids' if tokenize_prompt else 'text'}, {min(lens)}-{max(lens)} tokens")
    if args.num_warmups:
        print(f"Warming up with {args.num_warmups} requests...")
        warm = await asyncio.gather(*[endpoint.send(session, url, payloads[0], headers, requests[0].prompt_len)
                                      for _ in range(args.num_warmups)])
        failed = [r.error for r in warm if not r.success]
        if failed:
            print(f"warning: {len(failed)} of {args.num_warmups} warm-up requests failed: {failed[0]}",
                  file=sys.stderr)
    distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({distribution})")
    print(f"Maximum request concurrency: {args.max_concurrency}")

    pbar = None if args.disable_tqdm else tqdm(total=len(requests))
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()

    async def one(i: int) -> RequestResult:
        async with limit:
            result = await endpoint.send(session, url, payloads[i], headers, requests[i].prompt_len)
        if pbar is not None:
            pbar.update(1)
        return result

    # The workload is built; keep the collector's pauses out of the timed run.
    gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    tasks = []
    for i, offset in enumerate(offsets.tolist()):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    gc.unfreeze()
    if pbar is not None:
        pbar.close()
    return list(results), t0, duration


async def _send_conversations(session: aiohttp.ClientSession, args: argparse.Namespace, url: str,
                              headers: dict[str, str], model: str, tokenizer: Tokenizer, tokenizer_path: str,
                              extra_body: dict[str, Any]) -> tuple[list[RequestResult], list[int], float, float]:
    """The multi-turn workload, conversations starting at the arrival times; the results, their
    turns, the start and the duration."""
    work = workload.sample_multiturn(
        tokenizer, conversations=args.multiturn_conversations, turns=args.multiturn_turns,
        system_len=args.multiturn_system_len, question_len=args.multiturn_question_len,
        output_len=args.random_output_len, seed=args.seed)
    offsets = workload.arrival_times(args.multiturn_conversations, args.request_rate, args.burstiness, args.seed)
    print(f"Model: {model}; tokenizer: {tokenizer_path}; multi-turn chat at "
          f"{url}: {args.multiturn_conversations} conversations x {args.multiturn_turns} turns, system prompt "
          f"{args.multiturn_system_len} tokens, questions {args.multiturn_question_len}, answers "
          f"{args.random_output_len}")
    if args.num_warmups:
        print(f"Warming up with {args.num_warmups} requests...")
        other = workload.sample_multiturn(tokenizer, conversations=1, turns=1, system_len=0,
                                          question_len=args.multiturn_question_len,
                                          output_len=args.random_output_len, seed=args.seed + 1)
        payload = endpoint.build_chat_payload(model, [{"role": "user", "content": other.questions[0][0]}],
                                              args.random_output_len, ignore_eos=args.ignore_eos,
                                              extra_body=extra_body)
        warm = await asyncio.gather(*[endpoint.send(session, url, payload, headers, 0)
                                      for _ in range(args.num_warmups)])
        failed = [r.error for r in warm if not r.success]
        if failed:
            print(f"warning: {len(failed)} of {args.num_warmups} warm-up requests failed: {failed[0]}",
                  file=sys.stderr)
    print(f"Conversation arrival rate: {args.request_rate}")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    pbar = None if args.disable_tqdm else tqdm(total=args.multiturn_conversations * args.multiturn_turns)
    gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    results, turns = await conversations.run_conversations(
        session, url, headers, model, work, offsets.tolist(), ignore_eos=args.ignore_eos, extra_body=extra_body,
        max_concurrency=args.max_concurrency, on_result=None if pbar is None else lambda: pbar.update(1))
    duration = time.perf_counter() - t0
    gc.unfreeze()
    if pbar is not None:
        pbar.close()
    return results, turns, t0, duration


def _result_path(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    name = args.result_filename
    if name is None:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        model = str(result["model_id"]).rstrip("/").split("/")[-1]
        name = (f"{args.label or result['backend']}-{args.request_rate}qps{concurrency}-{model}-"
                f"{result['date']}.json")
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _run_routed(args: argparse.Namespace, headers: dict[str, str]) -> dict[str, Any]:
    """The run through a router (``--router``) over ``--replicas`` fresh replicas that this
    function starts and stops; their output goes to a log file. The result adds the policy, the
    replica count and the router's requests per replica and affinity hits."""
    from deepinfer.router import replicas

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    log_path = Path(tempfile.gettempdir()) / f"deepinfer-bench-replicas-{os.getpid()}.log"
    print(f"Starting {args.replicas} replicas (deepinfer serve {args.serve_args}) and a {args.router} router; "
          f"their log: {log_path}")
    serve_argv = ["serve", *shlex.split(args.serve_args)]
    with open(log_path, "w") as log, replicas.deployment(args.replicas, serve_argv, args.router, log=log) as urls:
        router_url, backend_urls = urls
        result = asyncio.run(_run(args, router_url, router_url + "/" + args.endpoint.lstrip("/"), headers))
        per_backend = replicas.router_requests(router_url)
    result |= {"router_policy": args.router, "replicas": args.replicas, "serve_args": args.serve_args,
               "requests_per_replica": [per_backend["requests"].get(u, 0) for u in backend_urls],
               "router_affinity_hits": per_backend["affinity_hits"]}
    print(f"Router: {args.router} over {args.replicas} replicas; requests per replica "
          f"{result['requests_per_replica']}; affinity hits {result['router_affinity_hits']:g}")
    return result


def run_serve(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when at least one request completed, 1 when none did, 2 when
    aiohttp (the ``bench`` extra) is missing."""
    try:
        http_client.aiohttp_module()
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    headers = _key_values(args.header, "--header")
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    if args.router is None:
        base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
        result = asyncio.run(_run(args, base_url, base_url + "/" + args.endpoint.lstrip("/"), headers))
    else:
        result = _run_routed(args, headers)
    if args.save_result or args.save_detailed:
        path = _result_path(args, result)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"Results written to {path}")
    if result["completed"] == 0:
        print("error: no request completed (see the errors above)", file=sys.stderr)
        return 1
    return 0
