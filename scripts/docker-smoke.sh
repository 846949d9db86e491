#!/usr/bin/env bash
# Prove the Dockerfile: build the image with no network, serve it, run one episode in it through
# the remote client (KernelEnv(base_url) and KernelEnv.from_docker_image), fetch the episode's
# notebook, and remove everything made on the way. Then kernels in containers: build the
# kernel image of deploy/gateway/kernel-image/ on top of it, offline too, and run
# tests/test_gateway_docker.py, whose Enterprise Gateway starts each kernel as a container of
# that image on this daemon (DOCKER_SMOKE_GATEWAY=0 leaves this part out; DOCKER_SMOKE_BENCH=1
# also runs benchmarks/bench_gateway_docker.py while the daemon and the images are there).
#
#   scripts/docker-smoke.sh        (or: make docker-smoke)
#
# Exit status: 0 passed; 77 Docker cannot run on this machine (the reason is printed on one line
# starting with "SKIP:"); anything else is a failure.
#
# Docker: a daemon that already answers `docker info` is used as it is. Otherwise, as root, the
# script checks the kernel features an engine needs (namespaces, cgroups, veth pairs) before
# anything slow, installs Debian's docker.io when dockerd is missing, and starts a private
# dockerd whose state, socket and containers live in the work directory (no iptables rules, no
# IP forwarding: containers are reached through their published loopback ports only).
#
# The base image is a minimal Debian made with debootstrap (python3, venv, bubblewrap, tini) and
# `docker import`ed, so no image registry is needed; the wheels come from PyPI outside the build,
# which then runs with --network none.
#
# Environment:
#   DOCKER_SMOKE_BASE_IMAGE  an existing image to build on instead of a debootstrapped Debian
#                            (it must have python3 with venv, bwrap and tini: no network)
#   DOCKER_SMOKE_MIRROR      Debian mirror for debootstrap (default: the host's apt source)
#   DOCKER_SMOKE_SUITE       Debian suite for debootstrap (default: the host's, else bookworm)
#   DOCKER_SMOKE_EXTRAS      kernel-env's extras in the image (default: e2b; the Dockerfile's EXTRAS)
#   DOCKER_SMOKE_KERNELS     other kernels in the image (default: bash,deno; the Dockerfile's
#                            KERNELS: ir needs apt-get, so a network, and the build has none)
#   PYTHON                   a Python with kernel_env and openenv-core (default: .venv/bin/python)
set -euo pipefail
shopt -s inherit_errexit

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLIENT="$ROOT/scripts/docker_smoke_client.py"
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
SKIP_STATUS=77
RUN_ID="kernel-env-smoke-$$"
IMAGE="$RUN_ID:latest"
EXTRAS=${DOCKER_SMOKE_EXTRAS-e2b}
KERNELS=${DOCKER_SMOKE_KERNELS-bash,deno}
KERNEL_IMAGE="$RUN_ID-kernel:latest"   # deploy/gateway/kernel-image/: kernels for EG
LAUNCHERS=""           # Enterprise Gateway's kernel launchers, from its release
BASE=""                # the image to build on
BASE_TAG=""            # the imported base image, when this run made one
FACTS=""               # "3.11 2.36 x86_64": the base image's Python, glibc and machine
WORK=""                # everything on disk this run makes
DAEMON_PID=""          # the private dockerd, when this run started one
MADE_BRIDGE=""         # docker0, when the private dockerd created it
DANGLING_BEFORE=""     # untagged images that existed before the build (shared daemon)

say() { printf '[docker-smoke] %s\n' "$*" >&2; }
skip() { printf 'SKIP: %s\n' "$*" >&2; exit "$SKIP_STATUS"; }
die() { printf 'FAILED: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# -- can Docker run here? -------------------------------------------------------------------

daemon_answers() {
    command -v docker >/dev/null 2>&1 && timeout 15 docker info >/dev/null 2>&1
}

# Why an engine cannot run on this machine, or nothing when it might. Cheap: no installs.
engine_impossible() {
    if [ "$(id -u)" != 0 ]; then
        echo "no Docker daemon answers and starting one needs root (running as uid $(id -u))"
        return
    fi
    local out
    if ! out=$(unshare --mount --uts --ipc --net --pid --fork true 2>&1); then
        echo "this machine cannot create Linux namespaces (unshare: ${out##*: })"
        return
    fi
    if ! cgroup_writable; then
        echo "no writable cgroup hierarchy at /sys/fs/cgroup (containers need one)"
        return
    fi
    if command -v ip >/dev/null 2>&1 &&
        ! out=$(unshare --net sh -c 'ip link add smoke0 type veth peer name smoke1' 2>&1); then
        echo "the kernel cannot create veth pairs for container networking (${out})"
        return
    fi
    if ! command -v dockerd >/dev/null 2>&1 && ! command -v apt-get >/dev/null 2>&1; then
        echo "dockerd is not installed and there is no apt-get to install docker.io"
    fi
}

cgroup_writable() {
    local dir probe
    if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        dir=/sys/fs/cgroup                      # cgroup v2
    else
        dir=/sys/fs/cgroup/memory               # cgroup v1
    fi
    probe="$dir/kernel-env-smoke-probe-$$"
    mkdir "$probe" 2>/dev/null && rmdir "$probe"
}

install_packages() {
    local missing=()
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return
    say "installing ${missing[*]} (apt-get)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >"$WORK/apt.log" 2>&1 || { tail -5 "$WORK/apt.log" >&2; die "apt-get"; }
}

# Overlay mounts are what dockerd's default storage driver needs; vfs works everywhere.
storage_driver() {
    local d="$WORK/overlay-probe"
    mkdir -p "$d/lower" "$d/upper" "$d/work" "$d/merged"
    if unshare --mount sh -c "mount -t overlay overlay \
            -o lowerdir=$d/lower,upperdir=$d/upper,workdir=$d/work $d/merged" 2>/dev/null; then
        echo overlay2
    else
        echo vfs
    fi
    rm -rf "$d"
}

start_private_daemon() {
    local dir="$WORK/docker" driver
    mkdir -p "$dir"
    driver=$(storage_driver)
    ip link show docker0 >/dev/null 2>&1 || MADE_BRIDGE=docker0
    say "starting a private dockerd (storage driver $driver)"
    dockerd --data-root "$dir/data" --exec-root "$dir/exec" --pidfile "$dir/dockerd.pid" \
        --host "unix://$dir/docker.sock" --storage-driver "$driver" \
        --iptables=false --ip6tables=false --ip-masq=false --ip-forward=false \
        >"$dir/dockerd.log" 2>&1 &
    DAEMON_PID=$!
    export DOCKER_HOST="unix://$dir/docker.sock"
    local i
    for i in $(seq 1 60); do
        daemon_answers && return
        kill -0 "$DAEMON_PID" 2>/dev/null || break
        sleep 0.5
    done
    skip "dockerd does not start here: $(daemon_error "$dir/dockerd.log")"
}

daemon_error() {
    local line
    line=$(grep -E 'level=(fatal|error)' "$1" | tail -n 1 | sed -E 's/.*msg="([^"]*)".*/\1/')
    echo "${line:-$(tail -n 1 "$1")}"
}

ensure_docker() {
    if daemon_answers; then
        say "using the Docker daemon that answers (${DOCKER_HOST:-default socket})"
        return
    fi
    local reason
    reason=$(engine_impossible)
    [ -z "$reason" ] || skip "$reason"
    command -v dockerd >/dev/null 2>&1 || install_packages docker.io
    start_private_daemon
}

# -- the base image -------------------------------------------------------------------------

host_mirror() {
    local uri
    uri=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
        grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -n 1 || true)
    uri=${uri%% }
    echo "${uri:-http://deb.debian.org/debian}"
}

host_suite() {
    local id="" codename=""
    if [ -r /etc/os-release ]; then
        id=$(. /etc/os-release && echo "${ID:-}")
        codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    fi
    if [ "$id" = debian ] && [ -n "$codename" ]; then echo "$codename"; else echo bookworm; fi
}

# Sets BASE.
make_base_image() {
    if [ -n "${DOCKER_SMOKE_BASE_IMAGE:-}" ]; then
        BASE=$DOCKER_SMOKE_BASE_IMAGE
        return
    fi
    local suite mirror start tarball
    suite=${DOCKER_SMOKE_SUITE:-$(host_suite)}
    mirror=${DOCKER_SMOKE_MIRROR:-$(host_mirror)}
    start=$(now)
    tarball=$(base_tarball "$suite" "$mirror")
    BASE_TAG="$RUN_ID-base:latest"
    docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        "$tarball" "$BASE_TAG" >/dev/null
    say "base image $BASE_TAG in $(since "$start") s"
    BASE=$BASE_TAG
}

# The debootstrapped Debian as a tarball, kept in the user's cache for a week (like pip's own
# cache: a fresh machine makes it; DOCKER_SMOKE_FRESH_BASE=1 makes it again). Prints its path.
base_tarball() {
    local suite=$1 mirror=$2 packages="python3,python3-venv,bubblewrap,tini" cache key rootfs
    cache="${XDG_CACHE_HOME:-$HOME/.cache}/kernel-env/docker-smoke"
    key=$(printf '%s %s %s' "$suite" "$mirror" "$packages" | sha256sum | cut -c1-12)
    local tarball="$cache/debian-$suite-$key.tar"
    if [ -z "${DOCKER_SMOKE_FRESH_BASE:-}" ] && [ -n "$(find "$tarball" -mtime -7 2>/dev/null)" ]; then
        say "debootstrapped $suite from the cache ($tarball)" >&2
        echo "$tarball"
        return
    fi
    command -v debootstrap >/dev/null 2>&1 || install_packages debootstrap >&2
    mkdir -p "$cache"
    rootfs="$WORK/rootfs"
    say "debootstrap $suite from $mirror" >&2
    debootstrap --variant=minbase --include="$packages" \
        "$suite" "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 ||
        { tail -5 "$WORK/debootstrap.log" >&2; die "debootstrap"; }
    rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
    tar --numeric-owner -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
    echo "$tarball"
}

# Sets FACTS; the first container of the run, so it also proves containers start here.
base_facts() {
    local code='import platform, sys
print("%d.%d" % sys.version_info[:2], platform.libc_ver()[1], platform.machine())'
    if ! FACTS=$(docker run --rm --network none "$BASE" python3 -c "$code" 2>&1); then
        case "$FACTS" in
            *"OCI runtime"*) skip "containers cannot start here: ${FACTS##*: }" ;;
            *) die "the base image does not run python3: $FACTS" ;;
        esac
    fi
}

# -- the build ------------------------------------------------------------------------------

# Every wheel the offline build needs, for the base image's Python and platform.
fetch_wheels() {
    local pyver=$1 glibc=$2 arch=$3 dest=$4
    "$PYTHON" - "$ROOT/pyproject.toml" "$EXTRAS" "$KERNELS" >"$WORK/requirements.txt" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)
needed = project["project"]["dependencies"] + project["build-system"]["requires"]
extras = set(filter(None, sys.argv[2].split(",")))
if {"bash", "deno"} & set(sys.argv[3].split(",")):
    extras.add("kernels")  # as the Dockerfile adds it
for extra in sorted(extras):
    needed += project["project"]["optional-dependencies"][extra]
print("\n".join(needed))
EOF
    download_wheels "$pyver" "$glibc" "$arch" "$dest" -r "$WORK/requirements.txt"
}

# download_wheels PYVER GLIBC ARCH DEST REQUIREMENT...: binary wheels for that Python.
download_wheels() {
    local pyver=$1 glibc=$2 arch=$3 dest=$4 minor platforms=()
    shift 4
    for minor in $(seq 5 "${glibc#2.}"); do
        platforms+=(--platform "manylinux_2_${minor}_${arch}")
    done
    platforms+=(--platform "manylinux2014_$arch" --platform "manylinux2010_$arch"
        --platform "manylinux1_$arch")
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$dest" \
        --only-binary=:all: --python-version "$pyver" --implementation cp \
        --abi "cp${pyver/./}" "${platforms[@]}" "$@" \
        2>"$WORK/pip.log" || { tail -20 "$WORK/pip.log" >&2; die "pip download"; }
}

make_context() {
    local ctx="$WORK/context"
    mkdir -p "$ctx/wheels"
    tar -C "$ROOT" --exclude=__pycache__ -c Dockerfile .dockerignore pyproject.toml README.md \
        kernel_env scripts/install_kernelspecs.py | tar -C "$ctx" -x
    echo "$ctx"
}

build_image() {
    local ctx start
    base_facts
    say "base image: Python, glibc, machine = $FACTS"
    ctx=$(make_context)
    start=$(now)
    # shellcheck disable=SC2086  # three words, on purpose
    fetch_wheels $FACTS "$ctx/wheels"
    say "$(find "$ctx/wheels" -name '*.whl' | wc -l) wheels in $(since "$start") s"
    DANGLING_BEFORE=$(docker images --quiet --filter dangling=true | sort)
    start=$(now)
    docker build --network none --force-rm --build-arg "BASE_IMAGE=$BASE" \
        --build-arg "EXTRAS=$EXTRAS" --build-arg "KERNELS=$KERNELS" --tag "$IMAGE" \
        "$ctx" >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; die "docker build"; }
    say "image $IMAGE built offline in $(since "$start") s"
}

# -- running it -----------------------------------------------------------------------------

# Starts a container of the image; prints its base URL. Extra arguments go to `docker run`.
start_container() {
    local name=$1 cid port
    shift
    cid=$(docker run --detach --name "$name" --label "$RUN_ID=1" \
        --publish 127.0.0.1::8000 "$@" "$IMAGE")
    port=$(docker port "$cid" 8000/tcp | head -n 1)
    echo "http://127.0.0.1:${port##*:}"
}

# Docker's own HEALTHCHECK: its first probe runs one interval (10 s) after the start.
wait_docker_healthy() {
    local name=$1 start=$2 status i
    for i in $(seq 1 120); do
        status=$(docker inspect --format '{{.State.Health.Status}}' "$name")
        if [ "$status" = healthy ]; then
            say "Docker reports the container healthy $(since "$start") s after docker run"
            return
        fi
        sleep 0.5
    done
    die "Docker's HEALTHCHECK never reported healthy (last: $status)"
}

check_no_secret_in_logs() {
    local name=$1 token=$2
    if docker logs "$name" 2>&1 | grep -qF "$token"; then
        die "the server's token appears in the container's log"
    fi
}

# The documented `docker run`: no extra privileges, so no user namespaces and no bubblewrap;
# the server runs as the container's root, each kernel as a uid of its own. The kernel must
# find neither the token nor the LLM key in any process environment, nor reach the other
# episode's kernel (docker_smoke_client.py's probe).
smoke_default_container() {
    local name="$RUN_ID-main" token key url start healthy user stopping code
    # E2B's SDK checks a key's shape (e2b_ and hex): the token has it, for the E2B check.
    token=$("$PYTHON" -c 'import secrets; print("e2b_" + secrets.token_hex(20))')
    key=$("$PYTHON" -c 'import secrets; print("sk-" + secrets.token_hex(16))')
    start=$(now)
    url=$(KERNEL_ENV_TOKEN=$token KERNEL_ENV_LLM_API_KEY=$key start_container "$name" \
        --env KERNEL_ENV_TOKEN --env KERNEL_ENV_LLM_API_KEY --env KERNEL_ENV_POOL_SIZE=1)
    healthy=$("$PYTHON" "$CLIENT" health "$url" --timeout 90 --since "$start") ||
        { docker logs "$name" >&2; die "no /health"; }
    say "serving at $url: /health answered ${healthy} s after docker run started"
    KERNEL_ENV_TOKEN=$token SMOKE_LLM_KEY=$key "$PYTHON" "$CLIENT" episode "$url" >&2 ||
        { docker logs "$name" >&2; die "episode through KernelEnv(base_url)"; }
    if [ -n "$KERNELS" ]; then
        KERNEL_ENV_TOKEN=$token "$PYTHON" "$CLIENT" languages "$url" "$KERNELS" >&2 ||
            { docker logs "$name" >&2; die "episodes in $KERNELS"; }
    fi
    if [[ ",$EXTRAS," == *,e2b,* ]]; then
        KERNEL_ENV_TOKEN=$token "$PYTHON" "$CLIENT" e2b "$url" >&2 ||
            { docker logs "$name" >&2; die "a sandbox through E2B's SDK"; }
    fi
    wait_docker_healthy "$name" "$start"
    user=$(docker exec "$name" id)
    check_no_secret_in_logs "$name" "$token"
    check_no_secret_in_logs "$name" "$key"
    say "image facts: size $(image_size) MB; user: $user"
    sandbox_note "$name"
    stopping=$(now)
    docker stop --time 20 "$name" >/dev/null
    code=$(docker inspect --format '{{.State.ExitCode}}' "$name")
    say "docker stop: exit code $code after $(since "$stopping") s"
    [ "$code" = 0 ] || { docker logs "$name" 2>&1 | tail -20 >&2; die "unclean stop (exit $code)"; }
}

image_size() {
    docker image inspect --format '{{.Size}}' "$IMAGE" | awk '{ printf "%.0f", $1 / 1e6 }'
}

sandbox_note() {
    if docker logs "$1" 2>&1 | grep -q "NOT sandboxed"; then
        say "default container: kernels unsandboxed, each as its own uid ($(docker logs "$1" \
            2>&1 | grep -m1 'NOT sandboxed' | sed -E 's/.*sandboxed: //' | cut -c1-160))"
    else
        say "default container: kernels sandboxed"
    fi
}

# The sandbox inside a container, with the settings deploy/README.md documents, in the locked-
# down shape of deploy/kubernetes (the unprivileged user, read-only root, no capabilities, no
# privilege escalation), with the secrets as files.
smoke_sandboxed_container() {
    local name="$RUN_ID-sandbox" token key url secrets
    token=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(16))')
    key=$("$PYTHON" -c 'import secrets; print("sk-" + secrets.token_hex(16))')
    secrets="$WORK/secrets"
    mkdir -p "$secrets"
    printf '%s\n' "$token" >"$secrets/token"
    printf '%s\n' "$key" >"$secrets/key"
    chown -R 10001:10001 "$secrets"
    chmod 0400 "$secrets/token" "$secrets/key"
    url=$(start_container "$name" --user 10001:10001 \
        --volume "$secrets:/run/secrets/kernel-env:ro" \
        --env KERNEL_ENV_TOKEN_FILE=/run/secrets/kernel-env/token \
        --env KERNEL_ENV_LLM_API_KEY_FILE=/run/secrets/kernel-env/key \
        --env KERNEL_ENV_SANDBOX=bwrap --env KERNEL_ENV_POOL_SIZE=1 \
        --read-only --tmpfs /tmp --tmpfs /home/kernelenv:uid=10001,gid=10001 \
        --cap-drop ALL --security-opt no-new-privileges \
        --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
        --security-opt systempaths=unconfined)
    "$PYTHON" "$CLIENT" health "$url" --timeout 90 >/dev/null ||
        { docker logs "$name" >&2; die "no /health with KERNEL_ENV_SANDBOX=bwrap"; }
    KERNEL_ENV_TOKEN=$token SMOKE_LLM_KEY=$key "$PYTHON" "$CLIENT" episode "$url" \
        --sandboxed >&2 || { docker logs "$name" >&2; die "sandboxed episode in the container"; }
    check_no_secret_in_logs "$name" "$token"
    check_no_secret_in_logs "$name" "$key"
    docker rm --force "$name" >/dev/null
}

smoke_from_docker_image() {
    "$PYTHON" "$CLIENT" from-image "$IMAGE" >&2 || die "episode through from_docker_image"
}

# -- kernels in containers, through Enterprise Gateway --------------------------------------

# Enterprise Gateway's kernel launchers: etc/kernel-launchers/ of its source distribution on
# PyPI, in the version tests/gateway.py runs, kept in the user's cache like the base. Sets
# LAUNCHERS to the directory that holds their bootstrap/, python/ and docker/.
eg_launchers() {
    local version cache sdist
    version=$(sed -n 's/^EG_VERSION = "\(.*\)"$/\1/p' "$ROOT/tests/gateway.py")
    [ -n "$version" ] || die "no EG_VERSION in tests/gateway.py"
    cache="${XDG_CACHE_HOME:-$HOME/.cache}/kernel-env/eg-launchers"
    LAUNCHERS="$cache/$version"
    if [ -f "$LAUNCHERS/.complete" ]; then
        say "Enterprise Gateway $version's kernel launchers from the cache ($LAUNCHERS)"
        return
    fi
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary :all: --dest "$WORK/eg-sdist" "jupyter_enterprise_gateway==$version" \
        2>"$WORK/pip-eg.log" || { tail -20 "$WORK/pip-eg.log" >&2; die "pip download EG"; }
    sdist=$(find "$WORK/eg-sdist" -name '*.tar.gz' | head -n 1)
    rm -rf "$LAUNCHERS" && mkdir -p "$LAUNCHERS"
    tar -xzf "$sdist" -C "$LAUNCHERS" --strip-components=3 --wildcards \
        '*/etc/kernel-launchers/bootstrap/*' '*/etc/kernel-launchers/python/*' \
        '*/etc/kernel-launchers/docker/*' || die "no kernel launchers in $sdist"
    touch "$LAUNCHERS/.complete"
    say "Enterprise Gateway $version's kernel launchers from its source distribution"
}

# The kernel image of deploy/gateway/kernel-image/, on top of the image just built, offline.
build_kernel_image() {
    local ctx="$WORK/kernel-context" start
    eg_launchers
    mkdir -p "$ctx/wheels" "$ctx/launchers/kernel-launchers/python"
    cp "$ROOT/deploy/gateway/kernel-image/Dockerfile" \
        "$ROOT/deploy/gateway/kernel-image/ipython_kernel_config.py" "$ctx/"
    cp "$LAUNCHERS/bootstrap/bootstrap-kernel.sh" "$ctx/launchers/"
    cp -r "$LAUNCHERS/python/scripts" "$ctx/launchers/kernel-launchers/python/"
    # shellcheck disable=SC2086  # three words, on purpose
    download_wheels $FACTS "$ctx/wheels" pycryptodomex
    start=$(now)
    docker build --network none --force-rm --build-arg "KERNEL_ENV_IMAGE=$IMAGE" \
        --tag "$KERNEL_IMAGE" "$ctx" >"$WORK/kernel-build.log" 2>&1 ||
        { tail -30 "$WORK/kernel-build.log" >&2; die "docker build (kernel image)"; }
    say "kernel image $KERNEL_IMAGE built offline in $(since "$start") s"
}

# tests/test_gateway_docker.py against this daemon and the kernel image; its facts (lines
# starting "[gateway-docker]") go to the log.
smoke_gateway_docker_kernels() {
    local start log="$WORK/gateway-docker.log" summary
    build_kernel_image
    start=$(now)
    (cd "$ROOT" && KERNEL_ENV_TEST_EG_KERNEL_IMAGE=$KERNEL_IMAGE \
        KERNEL_ENV_TEST_EG_LAUNCHERS=$LAUNCHERS \
        "$PYTHON" -m pytest -q -s -p no:cacheprovider tests/test_gateway_docker.py) \
        >"$log" 2>&1 || { tail -80 "$log" >&2; die "kernels in containers through EG"; }
    summary=$(grep -E '^[0-9]+ passed' "$log" | tail -n 1 || true)
    case "$summary" in
        *skipped* | "") tail -40 "$log" >&2; die "tests/test_gateway_docker.py did not run" ;;
    esac
    grep -E '^\[gateway-docker\]' "$log" >&2 || true
    say "Enterprise Gateway, kernels in containers: $summary ($(since "$start") s)"
    if [ -n "${DOCKER_SMOKE_BENCH:-}" ]; then
        KERNEL_ENV_TEST_EG_KERNEL_IMAGE=$KERNEL_IMAGE KERNEL_ENV_TEST_EG_LAUNCHERS=$LAUNCHERS \
            "$PYTHON" "$ROOT/benchmarks/bench_gateway_docker.py" >&2 || die "the benchmark"
    fi
}

# -- cleanup --------------------------------------------------------------------------------

cleanup() {
    local status=$?
    set +e
    if [ -n "$WORK" ] && daemon_answers; then
        docker ps --all --quiet --filter "label=$RUN_ID" | xargs -r docker rm --force >/dev/null
        docker ps --all --quiet --filter "ancestor=$IMAGE" | xargs -r docker rm --force >/dev/null
        docker ps --all --quiet --filter "ancestor=$KERNEL_IMAGE" |
            xargs -r docker rm --force >/dev/null
        docker image rm --force "$KERNEL_IMAGE" "$IMAGE" $BASE_TAG >/dev/null 2>&1
        comm -13 <(echo "$DANGLING_BEFORE") \
            <(docker images --quiet --filter dangling=true | sort) |
            xargs -r docker image rm --force >/dev/null 2>&1
    fi
    stop_private_daemon
    if [ -n "$WORK" ]; then
        grep -F " $WORK/" /proc/mounts | awk '{ print $2 }' | sort -r | xargs -r -n 1 umount -l
        rm -rf "$WORK"
    fi
    exit "$status"
}

stop_private_daemon() {
    [ -n "$DAEMON_PID" ] || return 0
    kill -TERM "$DAEMON_PID" 2>/dev/null
    local i
    for i in $(seq 1 40); do
        kill -0 "$DAEMON_PID" 2>/dev/null || break
        sleep 0.5
    done
    kill -KILL "$DAEMON_PID" 2>/dev/null
    wait "$DAEMON_PID" 2>/dev/null
    [ -z "$MADE_BRIDGE" ] || ip link delete "$MADE_BRIDGE" 2>/dev/null
    DAEMON_PID=""
}

main() {
    local start
    start=$(now)
    WORK=$(mktemp -d /tmp/kes.XXXXXX)   # short: dockerd's sockets live under it
    trap cleanup EXIT
    trap 'exit 130' INT TERM
    ensure_docker
    say "Docker usable after $(since "$start") s"
    make_base_image
    build_image
    smoke_default_container
    smoke_sandboxed_container
    smoke_from_docker_image
    [ "${DOCKER_SMOKE_GATEWAY:-1}" = 0 ] || smoke_gateway_docker_kernels
    say "passed in $(since "$start") s"
}

main "$@"
