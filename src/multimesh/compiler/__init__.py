"""The MPMD compiler: pure passes from a traced jaxpr to a plan.

flatten (inline.py) -> label (label.py) -> targets (targets.py) -> place (place.py)
-> fragment (fragment.py) -> plan (plan.py). Sharding rewriting for each fragment's
submesh lives in shardings.py. Each pass takes and returns plain data (ir.py).
"""
