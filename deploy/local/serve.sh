#!/usr/bin/env bash
# Serves the default model (SmolLM2-135M-Instruct) from a fresh machine: install, then
# `tandem up` (local Ray, embedded Redis, one prefill and one decode worker, the router on
# 127.0.0.1:50051, and its OpenAI-compatible HTTP front on 127.0.0.1:8000). Arguments go to
# `tandem up`, e.g. --prefill 2 --decode 2 --dtype bfloat16. Stop with Ctrl-C or SIGTERM.
# Then, from another shell:
#   tandem generate --address 127.0.0.1:50051 "Write a haiku about bees."
#   tandem status --address 127.0.0.1:50051
#   curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
#     -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'
set -euo pipefail
cd "$(dirname "$0")/../.."
bash deploy/local/install.sh
exec tandem up --config deploy/local/cluster.yaml "$@"
