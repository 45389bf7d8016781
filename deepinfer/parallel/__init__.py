"""Parallelism across devices. For now only the expert placement of expert parallelism's load
balancer (eplb.py); the process groups, dispatch/combine and sharded layers are not built yet."""
