"""Where a training step's samples come from: the RolloutSource protocol (base.py), inline sampling (inline.py),
asynchronous engine replicas (replicas.py, with scheduler.py, service.py, pool.py, worker.py), and the types the
loop and an engine worker exchange (types.py)."""
