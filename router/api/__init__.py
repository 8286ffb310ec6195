"""Generated protobuf and gRPC modules for proto/tandem.proto.

They are committed, and tests/unit/test_proto_sync.py fails if regenerating changes them:
    python -m router.api.generate
"""
