"""Records: each request's state and token log in the store, as the router reads and writes
them.

- `store`: the record's type and the store's interface (cluster/state.py is the Redis one);
- `records`: the router's queued, batched writes and its reads.
"""
