"""The router's edge: where calls come in and protobuf becomes Tandem's own types.

- `server`: the gRPC services (Generation, Admin, health, reflection) over a Router;
- `http`, `openai_body`, `replies`: the OpenAI-compatible HTTP front, the body it reads and
  the replies it shapes (whole or as server-sent events);
- `tools`: function calling, as constraints and as calls parsed out of the text;
- `validation`: a request's checks, and the `Admission` it becomes;
- `convert`: protobuf to and from the router's dataclasses, in one place;
- `auth`, `keys`: API keys and their scopes at the door; `tls`: certificates, both sides.
"""
