#!/usr/bin/env bash
# The real container test: build the repository's Dockerfile with podman, run the image, and from the host send a
# chat completion (the answer must say "Paris"), read /health and /metrics, run the image's HEALTHCHECK, then
# `podman stop` it and require exit code 0 (a clean drain, not a kill).
#
#   scripts/container_test.sh        # as root: installs podman, debootstrap, runc and curl with apt-get if missing
#
# Everything specific to this machine lives here and enters the build as build arguments, never as Dockerfile
# lines: with no registry to pull from, the base image is a Debian bookworm made with debootstrap from the
# machine's apt mirror (+ python3, python3-venv) and imported with `podman import`; the package proxy re-signs
# TLS, so the host's CA certificates go into the `build-extras` build context (pip trusts them during the build);
# torch's CPU index is unreachable here, so the local CPU torch wheel from pip's find-links goes there too.
# The base image, the build's layers and the compile-cache volume persist, so a rerun is much faster.
#
# Environment: EMBER_CT_PORT (host port, default 18080), EMBER_CT_CACHE (work folder, default
# ~/.cache/ember-container), EMBER_CT_MIRROR (Debian mirror; default: from /etc/apt/sources*).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${EMBER_CT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ember-container}
PORT=${EMBER_CT_PORT:-18080}
BASE=localhost/ember-base:bookworm
IMAGE=localhost/ember:test
NAME=ember-container-test
VOLUME=ember-container-test-cache
TORCH_VERSION=2.13.0
URL=http://127.0.0.1:$PORT
START=$SECONDS

log() { printf '[container_test %4ds] %s\n' "$((SECONDS - START))" "$*"; }
fail() { log "FAIL: $*"; exit 1; }

install_tools() {
  local missing=() tool
  for tool in podman debootstrap runc curl; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  ((${#missing[@]} == 0)) && return
  [[ $(id -u) == 0 ]] || fail "${missing[*]} missing, and installing them needs root"
  log "installing ${missing[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
}

# The machine's Debian mirror: the URIs of the deb822 stanza whose Suites include plain "bookworm", else the
# URL of a one-line "deb URL bookworm ..." source.
debian_mirror() {
  local f uri
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    uri=$(awk 'BEGIN{RS=""} /Suites:[^\n]*bookworm( |\n|$)/ && /Types:[^\n]*deb( |\n|$)/ {
                 for (i = 1; i <= NF; i++) if ($i == "URIs:") { print $(i+1); exit } }' "$f")
    [[ -n $uri ]] && { echo "$uri"; return; }
  done
  awk '$1 == "deb" { sub(/\[[^]]*\] */, ""); if ($3 == "bookworm") { print $2; exit } }' \
    /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n1
}

make_base_image() {
  podman image exists "$BASE" && return
  local mirror=${EMBER_CT_MIRROR:-$(debian_mirror)}
  [[ -n $mirror ]] || fail "no Debian bookworm mirror in /etc/apt/sources*; set EMBER_CT_MIRROR"
  log "making $BASE: debootstrap --variant=minbase bookworm from $mirror"
  rm -rf "$CACHE/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$CACHE/rootfs" "$mirror" \
    >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log"; fail "debootstrap"; }
  tar -C "$CACHE/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$CACHE/rootfs"
}

host_pip() {
  local pip
  for pip in "$REPO/.venv/bin/pip" "$(command -v pip3 || true)" "$(command -v pip || true)"; do
    [[ -n $pip && -x $pip ]] && { "$pip" "$@"; return; }
  done
  python3 -m pip "$@"
}

# build-extras: the host's extra CA certificates, and the local CPU torch wheel if pip's find-links have one.
# Prints the build arguments that go with them, one word per line.
prepare_build_extras() {
  local extras=$CACHE/build-extras dir wheel index
  rm -rf "$extras" && mkdir -p "$extras/ca-certificates" "$extras/wheels"
  cp /usr/local/share/ca-certificates/*.crt "$extras/ca-certificates/" 2>/dev/null || true
  for dir in ${PIP_FIND_LINKS:-} $(host_pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p"); do
    for wheel in "$dir"/torch-"$TORCH_VERSION"+cpu-cp311-*.whl; do
      [[ -f $wheel ]] && { cp -l "$wheel" "$extras/wheels/" 2>/dev/null || cp "$wheel" "$extras/wheels/"; }
    done
  done
  printf '%s\n' --build-context "build-extras=$extras"
  index=${PIP_INDEX_URL:-$(host_pip config get global.index-url 2>/dev/null || true)}
  [[ $index == http* ]] || index=""  # a file:// index on the host is of no use inside the build
  [[ -n $index ]] && printf '%s\n' --build-arg "PIP_INDEX_URL=$index"
  # With the CPU wheel at hand, torch's own dependencies come from the general index.
  if compgen -G "$extras/wheels/torch-*.whl" >/dev/null; then
    printf '%s\n' --build-arg "TORCH_INDEX_URL=${index:-https://pypi.org/simple}"
  fi
  return 0
}

json_field() { python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"; }

on_exit() {
  local rc=$?
  if ((rc != 0)) && podman container exists "$NAME" 2>/dev/null; then
    log "container log (last 60 lines):"; podman logs --tail 60 "$NAME" 2>&1 | sed 's/^/    /'
  fi
  podman rm -f "$NAME" >/dev/null 2>>"$CACHE/podman.log" || true
  log "$( ((rc == 0)) && echo PASS || echo FAILED) in $((SECONDS - START)) s"
}

main() {
  trap on_exit EXIT
  install_tools
  mkdir -p "$CACHE"
  printf '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n[engine]\nruntime = "runc"\n' \
    >"$CACHE/containers.conf"
  export CONTAINERS_CONF=$CACHE/containers.conf
  make_base_image

  local -a build_args
  mapfile -t build_args < <(prepare_build_extras)
  log "podman build --format docker --build-arg BASE_IMAGE=$BASE ${build_args[*]} -t $IMAGE ."
  # --format docker: the OCI image format has no HEALTHCHECK; Docker's own builder needs no such flag.
  podman build --format docker --build-arg BASE_IMAGE="$BASE" "${build_args[@]}" -t "$IMAGE" "$REPO" \
    >"$CACHE/build.log" 2>&1 || { tail -40 "$CACHE/build.log"; fail "podman build (log: $CACHE/build.log)"; }
  podman image prune -f >/dev/null  # the previous builds' images; the layers this build reuses stay cached
  log "built $IMAGE"

  podman rm -f "$NAME" >/dev/null 2>>"$CACHE/podman.log" || true
  # --health-interval disable: podman runs periodic healthchecks through systemd timers, and there is no systemd
  # here; the image's HEALTHCHECK is run once by hand below instead.
  local -a run=(podman run -d --health-interval disable --name "$NAME" -p "127.0.0.1:$PORT:8000"
                 -v "$VOLUME:/var/cache/ember" "$IMAGE" --config configs/tiny-test.toml)
  log "${run[*]}"
  "${run[@]}" >/dev/null 2>>"$CACHE/podman.log"
  local t0=$SECONDS code state
  # Poll from outside: the container's /health is the only readiness signal there is.
  while true; do
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$URL/health" || true)
    [[ $code == 200 ]] && break
    state=$(podman inspect -f '{{.State.Status}} (exit code {{.State.ExitCode}}) {{.State.Error}}' "$NAME")
    [[ $state == running* ]] || fail "the container is $state before /health was 200"
    ((SECONDS - t0 < 900)) || fail "no /health 200 within 900 s"
    sleep 1
  done
  log "/health 200 after $((SECONDS - t0)) s"
  podman logs "$NAME" 2>&1 | grep -E "ember\.(runner|compile|server)" | sed 's/^/    /'

  [[ $(podman exec "$NAME" id -un) == ember ]] || fail "the server does not run as the ember user"
  podman healthcheck run "$NAME" >/dev/null || fail "the image's HEALTHCHECK says unhealthy"

  # The README's first request: the bare question is a near-tie between "The" and "L" (French) on int8 numerics.
  local model answer
  model=$(curl -sf "$URL/v1/models" | json_field 'd["data"][0]["id"]')
  answer=$(curl -sf "$URL/v1/chat/completions" -H 'content-type: application/json' \
    -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France? Answer in one sentence.\"}], \"max_tokens\": 24, \"temperature\": 0}" \
    | json_field 'd["choices"][0]["message"]["content"]')
  log "chat completion from $model: $answer"
  [[ $answer == *Paris* ]] || fail "the answer does not say Paris"

  [[ $(curl -sf "$URL/health" | json_field 'd["status"]') == ok ]] || fail "/health is not ok"
  local metrics
  metrics=$(curl -sf "$URL/metrics")
  grep -Eq '^ember:generation_tokens_total [1-9]' <<<"$metrics" || fail "/metrics counts no generated tokens"
  grep -Eq '^ember:request_success_total\{finish_reason="(stop|length)"\} 1\.0' <<<"$metrics" \
    || fail "/metrics counts no finished request"
  log "/health ok; /metrics: $(grep -E '^ember:(generation_tokens_total|kv_pool_total_slots) ' <<<"$metrics" | tr '\n' ' ')"

  # The server answered while its buckets compile in the background; the restart below needs them all saved.
  t0=$SECONDS
  until [[ $(curl -s --max-time 5 "$URL/get_server_info" | python3 -c \
      'import json, sys; i = json.load(sys.stdin); print(i["compiled_buckets"] == i["decode_buckets"])') == True ]]; do
    ((SECONDS - t0 < 900)) || fail "the background compile did not finish within 900 s"
    sleep 2
  done
  log "every decode bucket compiled after $((SECONDS - t0)) s more"

  podman stop "$NAME" >/dev/null 2>>"$CACHE/podman.log"  # SIGTERM, then SIGKILL after 10 s, as docker stop
  code=$(podman inspect -f '{{.State.ExitCode}}' "$NAME")
  [[ $code == 0 ]] || fail "podman stop: exit code $code, not 0"
  log "podman stop: exit code 0"

  # A restart on the same cache volume must serve without compiling: the prepared model and every bucket's saved
  # decode step are loaded (on every ISA tier that has a packed bf16 linear kernel: AVX2 and up).
  podman rm -f "$NAME" >/dev/null 2>>"$CACHE/podman.log"
  "${run[@]}" >/dev/null 2>>"$CACHE/podman.log"
  t0=$SECONDS
  until [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$URL/health" || true) == 200 ]]; do
    [[ $(podman inspect -f '{{.State.Status}}' "$NAME") == running ]] || fail "the restarted container stopped"
    ((SECONDS - t0 < 600)) || fail "no /health 200 within 600 s after the restart"
    sleep 1
  done
  local restart_log
  restart_log=$(podman logs "$NAME" 2>&1)
  grep -E "ember\.(runner|compile|server)" <<<"$restart_log" | sed 's/^/    /'
  if grep -q "linears packed" <<<"$restart_log"; then
    grep -q "from the prepared copy" <<<"$restart_log" || fail "the restart parsed the checkpoint again"
    [[ $(grep -c "ready in .* (loaded " <<<"$restart_log") == 2 ]] || fail "the restart compiled a decode bucket"
  fi
  log "restart: /health 200 after $((SECONDS - t0)) s"
  podman stop "$NAME" >/dev/null 2>>"$CACHE/podman.log"
  [[ $(podman inspect -f '{{.State.ExitCode}}' "$NAME") == 0 ]] || fail "second podman stop: exit code not 0"
}

main "$@"
