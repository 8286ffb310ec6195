"""The gRPC router: validation, admission, routing, stream relay."""
