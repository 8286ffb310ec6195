#!/usr/bin/env bash
# The test suite, from a fresh machine: install, then every tier (unit, integration, fault).
# Extra arguments go to pytest (e.g. -m "not integration" for the fast tier only).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash deploy/local/install.sh
PY=${PYTHON:-python3}
set +e
"$PY" -m pytest -ra --timeout=600 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: treating that as a failure" >&2
  exit 1
fi
exit "$rc"
