"""Requests, each driven to its end across attempts and replays.

- `core`: the Router, which owns the table of requests it drives;
- `driver`: one request's attempts (reserve, prefill, follow, replay); `shared_start`: the
  shared first attempt of an n > 1 request's choices;
- `driving`: the narrow interfaces a driver sees of the rest of the router;
- `stream`: one request's ordered, exactly-once stream of chunks;
- `resume`: following a request from its stream or its logged tokens.
"""
