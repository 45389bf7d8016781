"""Command-line options of ``deepinfer bench serve`` (argparse only, so the CLI builds its
parser without importing the benchmark). Names and defaults follow ``vllm bench serve``
where it has the option."""

from __future__ import annotations

import argparse
import json

# vLLM's per-request client timeout (its aiohttp session's total).
DEFAULT_REQUEST_TIMEOUT_S = 6 * 60 * 60


def add_serve_args(p: argparse.ArgumentParser) -> None:
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default=None,
                        help="server URL, e.g. http://10.0.0.2:8000 (default: http://HOST:PORT)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions, or /v1/chat/completions (text prompts as one user message)")
    server.add_argument("--model", default=None,
                        help="model name sent with each request (default: the first of the server's /v1/models)")
    server.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    server.add_argument("--header", nargs="+", default=None, metavar="KEY=VALUE",
                        help="extra HTTP headers for every request")
    server.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="seconds a request may take before it counts as failed")

    data = p.add_argument_group("prompts")
    data.add_argument("--dataset-name", choices=["random", "multiturn"], default="random",
                      help="random: random token ids (with --random-range-ratio 0, every request has the "
                           "same input and output length); multiturn: chat conversations sharing a system "
                           "prompt, each turn's prompt the history so far (--multiturn-*; the request count is "
                           "conversations x turns, --num-prompts is not used)")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths are drawn from [L (1 - r), L (1 + r)]; r in [0, 1)")
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="random tokens every prompt starts with (before its --random-input-len tokens)")
    data.add_argument("--tokenize-prompt", action=argparse.BooleanOptionalAction, default=None,
                      help="send prompts as token-id lists, whose lengths are exact (default on "
                           "/v1/completions); --no-tokenize-prompt sends text, as chat completions must")
    data.add_argument("--tokenizer", default=None,
                      help="tokenizer directory (with tokenizer.json) for the prompts and for counting output "
                           "tokens a server does not report (default: the model path the server reports, "
                           "when it is a local directory; the embedded model's for our server on it)")

    multi = p.add_argument_group("multi-turn chat (--dataset-name multiturn, on /v1/chat/completions)")
    multi.add_argument("--multiturn-conversations", type=int, default=8,
                       help="conversations; each sends its next turn when its answer is complete")
    multi.add_argument("--multiturn-turns", type=int, default=4, help="questions per conversation")
    multi.add_argument("--multiturn-system-len", type=int, default=256,
                       help="tokens of the system prompt every conversation shares")
    multi.add_argument("--multiturn-question-len", type=int, default=32,
                       help="tokens of each question (answers: --random-output-len)")

    routing = p.add_argument_group("replicas behind the router (the benchmark starts them)")
    routing.add_argument("--router", choices=["cache-aware", "round-robin"], default=None,
                         help="start --replicas deepinfer serve replicas and a deepinfer router with this policy "
                              "in front of them on this host, and benchmark through it (--base-url, --host and "
                              "--port are not used)")
    routing.add_argument("--replicas", type=int, default=2, help="replicas behind --router")
    routing.add_argument("--serve-args", default="",
                         help="arguments of each replica's deepinfer serve, one string, e.g. "
                              "'--device cpu --max-num-seqs 16'")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests per second, arrivals a Poisson process (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="shape of the gamma-distributed gaps between arrivals: 1 Poisson, < 1 burstier, "
                           "> 1 more even")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="most requests in flight at once; later arrivals wait on the client")
    load.add_argument("--num-warmups", type=int, default=0,
                      help="untimed requests (the first prompt) before the run")

    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                          help="send ignore_eos and min_tokens so every request generates the tokens asked for "
                               "(default on, as vLLM does for random prompts)")
    sampling.add_argument("--temperature", type=float, default=None,
                          help="default: the server's (vLLM no longer sends 0 either)")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--extra-body", type=json.loads, default=None,
                          help='JSON merged into every request body, e.g. \'{"seed": 0}\'')

    report = p.add_argument_group("results")
    report.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                        help="comma-separated, of ttft, tpot, itl, e2el (vLLM's default leaves out e2el)")
    report.add_argument("--metric-percentiles", default="99",
                        help='comma-separated percentiles, e.g. "50,90,99"')
    report.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs for goodput, e.g. ttft:100 tpot:50 e2el:1000 (ms): requests meeting all count")
    report.add_argument("--save-result", action="store_true", help="write the results as JSON")
    report.add_argument("--save-detailed", action="store_true",
                        help="write the results with the per-request lists (lengths, TTFTs, ITLs, send times, "
                             "texts, errors); implies --save-result")
    report.add_argument("--result-dir", default=None, help="folder of the result file (default: .)")
    report.add_argument("--result-filename", default=None,
                        help="default: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json")
    report.add_argument("--label", default=None, help="result label (default: openai or openai-chat)")
    report.add_argument("--metadata", nargs="+", default=None, metavar="KEY=VALUE",
                        help="extra fields of the result JSON")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
