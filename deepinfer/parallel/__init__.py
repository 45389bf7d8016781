"""Parallelism across devices: the process groups a model is built under (groups.py), the
tensor-parallel layers (tensor.py), the multi-process executor that runs one worker per rank
(executor.py) and the expert placement of expert parallelism's load balancer (eplb.py)."""
