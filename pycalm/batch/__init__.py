"""Serving many sequences at once: the device-independent bookkeeping of continuous batching.

  blocks.py     BlockManager: the paged KV cache's pool of blocks, a block table per sequence in
                the layout pycalm.kernels.attention reads paged, and the prefix cache (full,
                computed blocks keyed by a chain hash, shared by reference count, evicted least
                recently used).
  scheduler.py  Scheduler: requests wait in arrival order; each step's Plan advances every running
                sequence one token and spends the rest of a token budget on prompt chunks,
                admitting a request when its blocks fit and preempting the newest sequence when
                blocks run out.

The scheduler owns a BlockManager and asks it for blocks; neither calls an engine. An engine runs
a Plan (its rows, positions and block tables, as arrays) as one pass, writing keys and values to
the pool rows the tables name, and hands the sampled tokens back to Scheduler.finish_step. Pure
Python and NumPy: the package sits beside pycalm.cpu, below the engines and the server.
"""
