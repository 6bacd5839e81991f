#!/usr/bin/env bash
# llmctl's container entrypoint: `serve` (the default), `router`, `pull`, or any other llmctl command.
# Flags come from LLMCTL_* environment variables, so that a Deployment sets env rather than args;
# arguments after the mode, then the words of LLMCTL_EXTRA_ARGS, are appended as further flags.
# `exec` puts llmctl in this process's place (PID 1 in a container), so SIGTERM reaches it and
# drains (see docs/deploy.md).
set -euo pipefail

mode="${1:-serve}"
[[ $# -gt 0 ]] && shift

# The API key from a mounted Secret file, so that it is not in the pod spec's env;
# `llmctl serve` and `llmctl router` read LLMCTL_API_KEY.
if [[ -n "${LLMCTL_API_KEY_FILE:-}" ]]; then
  LLMCTL_API_KEY="$(<"$LLMCTL_API_KEY_FILE")"
  export LLMCTL_API_KEY
fi

args=()
flag() {  # flag --name VALUE: pass --name VALUE when VALUE is set
  if [[ -n "$2" ]]; then args+=("$1" "$2"); fi
}

case "$mode" in
  serve)
    args=(serve "${LLMCTL_MODEL:-tiny-random-llama}")
    flag --host "${LLMCTL_HOST:-0.0.0.0}"
    flag --port "${LLMCTL_PORT:-8000}"
    flag --served-model-name "${LLMCTL_SERVED_MODEL_NAME:-}"
    flag --max-queue "${LLMCTL_MAX_QUEUE:-}"
    flag --drain-timeout "${LLMCTL_DRAIN_TIMEOUT:-}"
    flag --dtype "${LLMCTL_DTYPE:-}"
    flag --device "${LLMCTL_DEVICE:-}"
    flag --max-model-len "${LLMCTL_MAX_MODEL_LEN:-}"
    flag --max-num-seqs "${LLMCTL_MAX_NUM_SEQS:-}"
    flag --max-num-batched-tokens "${LLMCTL_MAX_NUM_BATCHED_TOKENS:-}"
    flag --kv-cache-memory "${LLMCTL_KV_CACHE_MEMORY:-}"
    flag --memory-fraction "${LLMCTL_MEMORY_FRACTION:-}"
    flag --threads "${LLMCTL_THREADS:-}"
    flag --log-level "${LLMCTL_LOG_LEVEL:-}"
    ;;
  router)
    # --replica comes from LLMCTL_ROUTER_REPLICAS, --discover from LLMCTL_ROUTER_DISCOVER (llmctl reads both)
    args=(router)
    flag --host "${LLMCTL_HOST:-0.0.0.0}"
    flag --port "${LLMCTL_PORT:-8080}"
    flag --policy "${LLMCTL_ROUTER_POLICY:-}"
    flag --load-factor "${LLMCTL_ROUTER_LOAD_FACTOR:-}"
    flag --log-level "${LLMCTL_LOG_LEVEL:-}"
    ;;
  pull)
    # the init container: fetch the model into the shared cache, unless it is embedded or a directory
    model="${LLMCTL_MODEL:-tiny-random-llama}"
    if [[ "$model" == tiny-random-llama || "$model" == /* || "$model" == .* ]]; then
      echo "llmctl-entrypoint: nothing to pull for $model"
      exit 0
    fi
    args=(pull "$model" --quiet)
    ;;
  *)
    args=("$mode")
    ;;
esac

read -r -a extra <<< "${LLMCTL_EXTRA_ARGS:-}"
exec "${LLMCTL_BIN:-llmctl}" "${args[@]}" "$@" "${extra[@]}"
