#!/usr/bin/env bash
# Serves the default model (SmolLM2-135M-Instruct) from a fresh machine: install, then run.
# Today this is the in-process engine (`tandem generate --offline`); arguments are passed on,
# e.g.  bash deploy/local/serve.sh "Write a haiku about bees."
#       bash deploy/local/serve.sh --requests benchmarks/workloads/offline_default.jsonl --json
set -euo pipefail
cd "$(dirname "$0")/../.."
bash deploy/local/install.sh
if [ "$#" = 0 ]; then set -- "Introduce yourself in two sentences."; fi
exec tandem generate --offline --dtype bfloat16 "$@"
