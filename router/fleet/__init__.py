"""The fleet: the workers a router sees and the calls that place requests on them.

- `directory`: the workers of both pools as the pool manager reports them;
- `routing`: which worker gets a request (free KV, load, prefix affinity);
- `fleet`: the calls to workers, their health and their events.
"""
