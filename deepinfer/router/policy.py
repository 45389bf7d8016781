"""Which replica a request goes to. Pure bookkeeping: no I/O, no clock of its own (callers
pass ``now``), so every decision is unit-testable.

What belongs here: the approximate radix tree of the prompts each replica was sent
(``PrefixTree``), the routing key of a request body (``routing_key``), and the policies
(``CacheAwarePolicy``, ``RoundRobinPolicy``). What does not: HTTP, health checks, retries
(app.py).

The tree is *approximate*: it records what the router sent, not what a replica's prefix
cache still holds (the replica may have evicted it, or cached it at a block boundary
only). As in SGLang's router, per replica, the longest prefix of the new prompt it was sent
before is weighed against the replica's load (``CacheAwareConfig`` says how), with a hard
guard when the loads are out of balance.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

# A routing key: text (one element per character) or token ids.
Key = str | tuple[int, ...]


@dataclass(eq=False)
class _Node:
    edge: Key                                   # the elements from the parent to this node
    parent: _Node | None
    children: dict[Any, _Node] = field(default_factory=dict)   # first element of the child's edge -> child
    replicas: dict[str, float] = field(default_factory=dict)   # replica -> last time it was sent this prefix


def _common_length(a: Key, b: Key) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:      # the usual case (a whole edge matches), compared at C speed
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixTree:
    """A radix tree over routing keys; each node remembers which replicas were sent the
    prefix ending at it, and when. One tree serves all replicas (shared prefixes, such as
    a system prompt, are stored once).

    Size: per replica, the number of key elements it owns (the edge lengths of its nodes).
    An ``insert`` that takes a replica over ``max_size_per_replica`` evicts its least recently
    used leaves (nodes it owns none of whose children it owns) until its size is at most
    ``EVICT_TO`` of the limit; a node no replica owns any more leaves the tree.
    """

    # Eviction scans the tree, so it frees some room at once rather than one leaf per insert.
    EVICT_TO = 0.9

    def __init__(self, max_size_per_replica: int) -> None:
        if max_size_per_replica < 1:
            raise ValueError(f"max_size_per_replica must be >= 1, got {max_size_per_replica}")
        self.max_size_per_replica = max_size_per_replica
        self.root = _Node(edge="", parent=None)
        self.sizes: dict[str, int] = {}

    def insert(self, key: Key, replica: str, now: float) -> None:
        """Record that ``replica`` was sent ``key`` at time ``now``."""
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                child = _Node(edge=key[i:], parent=node)
                node.children[key[i]] = child
            else:
                common = _common_length(child.edge, key[i:])
                if common < len(child.edge):
                    child = self._split(child, common)
            if replica not in child.replicas:
                self.sizes[replica] = self.sizes.get(replica, 0) + len(child.edge)
            child.replicas[replica] = now
            node, i = child, i + len(child.edge)
        if self.sizes.get(replica, 0) > self.max_size_per_replica:
            self._evict(replica, int(self.EVICT_TO * self.max_size_per_replica))

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` elements; returns the new upper node, which keeps
        the replicas (and sizes: each replica's total is unchanged)."""
        parent = child.parent
        assert parent is not None
        upper = _Node(edge=child.edge[:at], parent=parent, replicas=dict(child.replicas))
        parent.children[upper.edge[0]] = upper
        child.edge = child.edge[at:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def match(self, key: Key) -> dict[str, int]:
        """For each replica in the tree, the length of the longest prefix of ``key`` it was
        sent (replicas with none are absent)."""
        matched: dict[str, int] = {}
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            common = _common_length(child.edge, key[i:])
            for replica in child.replicas:
                matched[replica] = i + common
            if common < len(child.edge):
                break
            node, i = child, i + common
        return matched

    def remove_replica(self, replica: str) -> None:
        """Forget everything ``replica`` was sent (it restarted with an empty cache, or left)."""
        self._evict(replica, 0)

    def _is_leaf_of(self, node: _Node, replica: str) -> bool:
        return (node is not self.root and replica in node.replicas
                and not any(replica in c.replicas for c in node.children.values()))

    def _evict(self, replica: str, limit: int) -> None:
        leaves: list[tuple[float, int, _Node]] = []
        order = itertools.count()      # ties in time: no comparison of nodes
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if self._is_leaf_of(node, replica):
                leaves.append((node.replicas[replica], next(order), node))
        heapq.heapify(leaves)
        while leaves and self.sizes.get(replica, 0) > limit:
            _, _, node = heapq.heappop(leaves)
            del node.replicas[replica]
            self.sizes[replica] -= len(node.edge)
            parent = node.parent
            assert parent is not None
            if not node.replicas and not node.children:
                del parent.children[node.edge[0]]
            if self._is_leaf_of(parent, replica):
                heapq.heappush(leaves, (parent.replicas[replica], next(order), parent))
        if self.sizes.get(replica) == 0:
            del self.sizes[replica]

    def num_nodes(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count


def routing_key(body: Mapping[str, Any]) -> Key:
    """The prefix the router matches a request by: a completion's prompt (token ids as they
    are, text by character; the first of a batch of prompts), or a chat's messages written
    out in order (role and content, then a separator), so that a conversation's next turn
    extends the key of the turn before. Anything else (a malformed body the backend will
    refuse) gives the empty key, which matches nothing."""
    if "messages" in body:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(f"{m.get('role', '')}\x1f{_content_text(m.get('content'))}\x1e"
                       for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)
    return ""


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


@dataclass(frozen=True)
class CacheAwareConfig:
    """The cache-aware policy's settings.

    A request goes to the candidate with the least estimated work before its first token:
    the key elements that replica was not sent before (to prefill) plus ``load_weight``
    times the mean key length routed so far for each request it has in flight (the work
    queued ahead of it, in the same units, characters or token ids). So a replica that
    holds a conversation's history keeps it while it is not much busier than the others,
    and a prompt no replica has seen goes to the least loaded one.

    - ``balance_abs_threshold`` / ``balance_rel_threshold`` (as SGLang's router names them):
      a hard guard; when the most loaded candidate has more than ``abs`` requests more
      than the least loaded one *and* more than ``rel`` times its load, the request goes to
      the least loaded one whatever its prefix.
    - ``max_tree_size``: key elements (characters or token ids) remembered per replica.
    """

    load_weight: float = 1.0
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 22

    def __post_init__(self) -> None:
        if not self.load_weight >= 0.0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.max_tree_size < 1:
            raise ValueError(f"max_tree_size must be >= 1, got {self.max_tree_size}")


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str              # "affinity" (sent a prefix of it before), "load", "balance" or "round_robin"
    matched: int = 0         # elements of the key the chosen replica was sent before


class RoutingPolicy:
    """Picks a replica for a request among the ``candidates`` (healthy, not yet tried for
    this request; never empty), given each replica's ``loads`` (requests in flight).
    ``record`` is told where the request went (the tree learns it); ``forget`` that a
    replica lost its cache (restarted, died)."""

    name: str

    def choose(self, key: Key, candidates: Sequence[str], loads: Mapping[str, int], now: float) -> Decision:
        raise NotImplementedError

    def record(self, key: Key, replica: str, now: float) -> None:
        pass

    def forget(self, replica: str) -> None:
        pass


class RoundRobinPolicy(RoutingPolicy):
    """Each request to the next candidate in turn, whatever its prompt (the baseline)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, key: Key, candidates: Sequence[str], loads: Mapping[str, int], now: float) -> Decision:
        replica = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(replica, "round_robin")


class CacheAwarePolicy(RoutingPolicy):
    """Prefix affinity balanced against load (``CacheAwareConfig`` says how)."""

    name = "cache-aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self.tree = PrefixTree(self.config.max_tree_size)
        self._keys = self._key_elements = 0       # for the mean key length

    def choose(self, key: Key, candidates: Sequence[str], loads: Mapping[str, int], now: float) -> Decision:
        cfg = self.config
        load = {r: loads.get(r, 0) for r in candidates}
        least = min(candidates, key=lambda r: (load[r], self.tree.sizes.get(r, 0)))
        most = max(load.values())
        if most - load[least] > cfg.balance_abs_threshold and most > cfg.balance_rel_threshold * load[least]:
            return Decision(least, "balance")
        matched = self.tree.match(key)
        per_request = cfg.load_weight * (self._key_elements / self._keys if self._keys else len(key))

        def cost(r: str) -> tuple[float, int, int]:
            # Ties: the less loaded, then the one remembering less (more room for new prefixes).
            return len(key) - matched.get(r, 0) + per_request * load[r], load[r], self.tree.sizes.get(r, 0)

        best = min(candidates, key=cost)
        length = matched.get(best, 0)
        return Decision(best, "affinity" if length else "load", length)

    def record(self, key: Key, replica: str, now: float) -> None:
        if len(key):
            self.tree.insert(key, replica, now)
            self._keys += 1
            self._key_elements += len(key)

    def forget(self, replica: str) -> None:
        self.tree.remove_replica(replica)


POLICIES = ("cache-aware", "round-robin")


def make_policy(name: str, config: CacheAwareConfig | None = None) -> RoutingPolicy:
    if name == "cache-aware":
        return CacheAwarePolicy(config)
    if name == "round-robin":
        if config is not None:
            raise ValueError("round-robin takes no cache-aware settings")
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
