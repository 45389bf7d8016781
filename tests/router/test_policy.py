"""The router's policy, without HTTP: the prefix tree's matches and eviction, routing keys,
cache-aware choices (affinity, new prefixes, load balance) and round-robin."""

from __future__ import annotations

import random

import pytest

from deepinfer.router.policy import (CacheAwareConfig, CacheAwarePolicy, PrefixTree, RoundRobinPolicy, make_policy,
                                     routing_key)


def brute_match(sent: dict[str, list], key) -> dict[str, int]:
    """The longest common prefix of ``key`` with anything each replica was sent."""
    out = {}
    for replica, keys in sent.items():
        best = 0
        for k in keys:
            n = 0
            while n < min(len(k), len(key)) and k[n] == key[n]:
                n += 1
            best = max(best, n)
        if best:
            out[replica] = best
    return out


@pytest.mark.parametrize("as_text", [True, False])
def test_tree_match_equals_brute_force(as_text):
    rng = random.Random(0)
    tree = PrefixTree(max_size_per_replica=10**9)
    sent: dict[str, list] = {}
    alphabet = "abc" if as_text else [1, 2, 3]

    def make(n):
        items = [rng.choice(alphabet) for _ in range(n)]
        return "".join(items) if as_text else tuple(items)

    for step in range(300):
        key = make(rng.randint(1, 12))
        replica = f"r{rng.randint(0, 2)}"
        tree.insert(key, replica, now=float(step))
        sent.setdefault(replica, []).append(key)
        probe = make(rng.randint(0, 14))
        assert tree.match(probe) == brute_match(sent, probe)
    # Sizes count each replica's distinct prefix elements: the nodes of its keys' trie.
    for replica, keys in sent.items():
        prefixes = {k[:i] for k in keys for i in range(1, len(k) + 1)}
        assert tree.sizes[replica] == len(prefixes)


def test_tree_split_keeps_owners():
    tree = PrefixTree(100)
    tree.insert("hello world", "a", 0.0)
    tree.insert("hello there", "b", 1.0)
    assert tree.match("hello world!") == {"a": 11, "b": 6}
    assert tree.match("help") == {"a": 3, "b": 3}
    assert tree.match("xyz") == {}
    assert tree.sizes == {"a": 11, "b": 11}


def test_eviction_drops_least_recently_used_leaves():
    tree = PrefixTree(max_size_per_replica=20)          # over 20: evicted down to 18
    tree.insert("system:AAAA", "a", 0.0)                # 11
    tree.insert("system:BBBB", "a", 1.0)                # 15
    tree.insert("system:BBBB", "a", 2.0)                # a use refreshes a branch
    tree.insert("system:CCCCCC", "a", 3.0)              # 21 > 20: AAAA, the oldest leaf, goes -> 17
    assert tree.sizes["a"] == 17
    assert tree.match("system:AAAA") == {"a": 7}
    assert tree.match("system:BBBB") == {"a": 11} and tree.match("system:CCCCCC") == {"a": 13}
    # Another replica's copy of a shared node is untouched by a's eviction.
    tree.insert("system:BBBB", "b", 4.0)
    tree.insert("zzzzzzzzzz", "a", 5.0)                 # 27: BBBB (4), CCCCCC (6) go -> 17
    assert tree.sizes["a"] == 17 and tree.sizes["b"] == 11
    assert tree.match("system:BBBB") == {"a": 7, "b": 11}
    assert tree.match("system:CCCCCC") == {"a": 7, "b": 7}
    # Interior nodes go once their last leaf has: a's "system:" is now its oldest leaf.
    tree.insert("yyyyyyyyyy", "a", 6.0)                 # 27: "system:" (7), then zzz (10) -> 10
    assert tree.sizes["a"] == 10 and tree.match("system:BBBB") == {"b": 11}
    assert tree.match("zzzzzzzzzz") == {} and tree.match("yyyyyyyyyy") == {"a": 10}


def test_remove_replica_forgets_it_and_frees_nodes():
    tree = PrefixTree(100)
    tree.insert("abcdef", "a", 0.0)
    tree.insert("abcxyz", "b", 1.0)
    tree.remove_replica("a")
    assert tree.match("abcdef") == {"b": 3}
    assert "a" not in tree.sizes
    tree.remove_replica("b")
    assert tree.num_nodes() == 0 and tree.sizes == {}


def test_routing_keys():
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]}
    longer = {"messages": chat["messages"] + [{"role": "assistant", "content": "A1"},
                                              {"role": "user", "content": [{"type": "text", "text": "Q2"}]}]}
    k1, k2 = routing_key(chat), routing_key(longer)
    assert k2.startswith(k1) and len(k2) > len(k1)
    assert routing_key({"prompt": "hello"}) == "hello"
    assert routing_key({"prompt": [5, 6, 7]}) == (5, 6, 7)
    assert routing_key({"prompt": ["first", "second"]}) == "first"
    assert routing_key({"prompt": [[1, 2], [3]]}) == (1, 2)
    assert routing_key({"prompt": 3}) == "" and routing_key({"messages": "x"}) == ""


def test_same_prefix_goes_to_the_same_replica():
    policy = CacheAwarePolicy()
    replicas = ["r0", "r1", "r2"]
    loads = {r: 0 for r in replicas}
    homes = {}
    for conv in range(6):
        key = f"system prompt shared by all|conversation {conv} turn 0"
        d = policy.choose(key, replicas, loads, now=conv)
        policy.record(key, d.replica, now=conv)
        loads[d.replica] += 1          # each conversation stays open
        homes[conv] = d.replica
    # New conversations share only the system prompt: they spread over the replicas.
    assert sorted(homes.values()) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    for conv in range(6):
        key = f"system prompt shared by all|conversation {conv} turn 0|answer|turn 1"
        d = policy.choose(key, replicas, loads, now=10 + conv)
        assert (d.replica, d.reason) == (homes[conv], "affinity")
        assert d.matched == len(f"system prompt shared by all|conversation {conv} turn 0")


def test_unseen_prompt_goes_to_the_least_loaded():
    policy = CacheAwarePolicy()
    policy.record("aaaaaaaaaa", "r0", 0.0)
    d = policy.choose("bbbbbbbbbb", ["r0", "r1"], {"r0": 3, "r1": 1}, now=1.0)
    assert (d.replica, d.reason) == ("r1", "load")
    # Equal loads: the replica remembering less (more room) gets the new prefix.
    d = policy.choose("bbbbbbbbbb", ["r0", "r1"], {"r0": 0, "r1": 0}, now=1.0)
    assert d.replica == "r1"


def test_affinity_weighed_against_load():
    # Mean key length routed so far: 40; load_weight 1: each request in flight costs 40.
    policy = CacheAwarePolicy(CacheAwareConfig(load_weight=1.0))
    history = "h" * 40
    policy.record(history, "r0", 0.0)
    key = history + "next question"             # 53 elements, 40 of them sent to r0
    # r0: 13 to prefill + 40 per request in flight; r1: 53 + 40 per request.
    assert policy.choose(key, ["r0", "r1"], {"r0": 1, "r1": 0}, 1.0).replica == "r1"     # 53 = 53: less loaded
    d = policy.choose(key, ["r0", "r1"], {"r0": 1, "r1": 1}, 1.0)
    assert (d.replica, d.reason, d.matched) == ("r0", "affinity", 40)
    assert policy.choose(key, ["r0", "r1"], {"r0": 2, "r1": 0}, 1.0).replica == "r1"     # 93 > 53
    # load_weight 0: the cache alone decides.
    policy = CacheAwarePolicy(CacheAwareConfig(load_weight=0.0))
    policy.record(history, "r0", 0.0)
    assert policy.choose(key, ["r0", "r1"], {"r0": 9, "r1": 0}, 1.0).replica == "r0"


def test_load_balance_guard_overrides_affinity():
    policy = CacheAwarePolicy(CacheAwareConfig(load_weight=0.0, balance_abs_threshold=4, balance_rel_threshold=2.0))
    policy.record("shared prefix of a hot conversation", "r0", 0.0)
    key = "shared prefix of a hot conversation, next turn"
    # Mildly uneven: affinity holds.
    assert policy.choose(key, ["r0", "r1"], {"r0": 4, "r1": 1}, 1.0).replica == "r0"
    # More than 4 above and more than twice the least: balance wins.
    d = policy.choose(key, ["r0", "r1"], {"r0": 9, "r1": 2}, 1.0)
    assert (d.replica, d.reason) == ("r1", "balance")
    # Only candidates count: r0 excluded (unhealthy or tried) leaves r1 even with affinity to r0.
    assert policy.choose(key, ["r1"], {"r0": 0, "r1": 5}, 1.0).replica == "r1"


def test_round_robin_cycles_over_candidates():
    policy = make_policy("round-robin")
    assert isinstance(policy, RoundRobinPolicy)
    picks = [policy.choose("same", ["a", "b", "c"], {}, 0.0).replica for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="load_weight"):
        CacheAwareConfig(load_weight=-1.0)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        CacheAwareConfig(balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
    with pytest.raises(ValueError, match="max_size_per_replica"):
        PrefixTree(0)
