#!/usr/bin/env bash
# Everything the tests need, built side by side: .venv (scripts/setup.sh) and the real-SGLang
# environment .venv-sglang (scripts/setup_sglang.sh). They share nothing but tonpolicy's editable-install
# metadata in the source tree, which each writes under a lock. Each one's lines are prefixed with its
# name; a failure of either fails this script, after both have finished.
set -uo pipefail
cd "$(dirname "$0")/.."
prefixed() {  # a background subshell: its status is the script's (pipefail), not sed's
  local name=$1
  shift
  "$@" 2>&1 | sed -u "s/^/[$name] /"
}
prefixed setup bash scripts/setup.sh &
main=$!
prefixed setup_sglang bash scripts/setup_sglang.sh &
sglang=$!
status=0
wait "$main" || { echo "scripts/setup.sh failed (see the [setup] lines)" >&2; status=1; }
wait "$sglang" || { echo "scripts/setup_sglang.sh failed (see the [setup_sglang] lines)" >&2; status=1; }
exit "$status"
