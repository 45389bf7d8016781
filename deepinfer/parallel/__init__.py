"""Parallelism across devices: the process groups a model is built under (groups.py), the
tensor-parallel layers (tensor.py), the multi-process executor that runs one worker per rank
(executor.py), expert parallelism's dispatch/combine and sharded MoE placement (expert.py), the
load balancer's placement algorithm (eplb.py) and its runtime that moves experts while serving
(balancer.py)."""
