# The kernel-env server image: `kernel-env serve` on port 8000, with bubblewrap for the
# sandboxed kernel backend.
#
#   docker build -t kernel-env .
#   docker run --rm -p 127.0.0.1:8000:8000 -e KERNEL_ENV_TOKEN=... kernel-env
#
# Who runs what: by default the server runs as the container's root, and every kernel as an
# unprivileged uid of its own (KERNEL_ENV_KERNEL_UIDS; Docker's default capabilities include
# SETUID/SETGID). A plain `docker run` allows no user namespaces, so kernels run without
# bubblewrap (KERNEL_ENV_SANDBOX=auto): their own uid is what keeps them from the server's
# environment, its token and key, and from each other. `--user 10001` runs the server as the
# unprivileged `kernelenv` user instead (the shape of deploy/kubernetes): then pass secrets as
# files (KERNEL_ENV_TOKEN_FILE, KERNEL_ENV_LLM_API_KEY_FILE), and allow user namespaces for
# the sandbox (deploy/README.md), since kernels then share the server's uid.
#
# Two stages: `build` turns this source tree into a wheel and installs that wheel (and nothing
# else of the tree) into a virtualenv at /opt/kernel-env, without pip; `runtime` is the base
# image plus that virtualenv, bubblewrap and tini. The runtime image has no source tree, no
# build tools and no downloaded wheels.
#
# Offline builds: put every wheel the build needs in a `wheels/` directory of the build context
# (the dependencies of kernel-env and of its build backend, hatchling); pip then installs with
# `--no-index --find-links wheels/` and the build needs no network. A base image that already
# has `bwrap` and `tini` needs no apt-get either (scripts/docker-smoke.sh builds it that way).
#
# Settings: every `kernel-env serve` flag reads KERNEL_ENV_<NAME> (KERNEL_ENV_POOL_SIZE,
# KERNEL_ENV_SANDBOX, KERNEL_ENV_GATEWAY_URL, ...); KERNEL_ENV_TOKEN and KERNEL_ENV_LLM_API_KEY
# come from the environment only. See deploy/README.md for the sandbox's container settings.

# Any Debian-like image with python3 (3.11+) and its venv module.
ARG BASE_IMAGE=python:3.12-slim
# Kernels besides python3 that episodes may name (reset's kernel_name), comma-separated:
# bash and deno come from PyPI (the kernels extra), ir from the base image's Debian packages
# (r-base-core, r-cran-irkernel: that needs apt-get, so a network, at build time).
ARG KERNELS=""

FROM ${BASE_IMAGE} AS build
# kernel-env's extras to install, comma-separated: e2b serves E2B's sandbox protocol beside
# OpenEnv's (docs/e2b.md); empty for none.
ARG EXTRAS=e2b
ARG KERNELS
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# What gets here is what .dockerignore lets through: pyproject.toml, README.md, kernel_env/
# and wheels/ (optional), and two small files of deploy/gateway/.
COPY . /src
RUN set -eu; \
    if ls /src/wheels/*.whl >/dev/null 2>&1; then \
        index="--no-index --find-links /src/wheels"; \
    else \
        index=""; \
    fi; \
    python3 -m venv /opt/build; \
    case ",$KERNELS," in *,bash,*|*,deno,*) EXTRAS="${EXTRAS:+$EXTRAS,}kernels";; esac; \
    extras=${EXTRAS:+[$EXTRAS]}; \
    /opt/build/bin/pip wheel $index --wheel-dir /dist "/src$extras"; \
    python3 -m venv --without-pip /opt/kernel-env; \
    /opt/build/bin/pip --python /opt/kernel-env/bin/python install \
        --no-index --find-links /dist "kernel-env$extras"; \
    /opt/kernel-env/bin/kernel-env --help >/dev/null

FROM ${BASE_IMAGE} AS runtime
# bubblewrap: the kernels' sandbox. tini: PID 1, forwards SIGTERM (graceful drain) and reaps
# orphaned processes. Installed only when the base image lacks them.
RUN set -eu; \
    missing=""; \
    command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"; \
    command -v tini >/dev/null 2>&1 || missing="$missing tini"; \
    command -v prlimit >/dev/null 2>&1 || missing="$missing util-linux"; \
    if [ -n "$missing" ]; then \
        apt-get update; \
        apt-get install -y --no-install-recommends $missing; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin kernelenv

COPY --from=build /opt/kernel-env /opt/kernel-env
# The other kernels' kernelspecs, registered in /opt/kernel-env (make kernels does the same).
ARG KERNELS
COPY scripts/install_kernelspecs.py /opt/kernel-env/share/kernel-env/
RUN set -eu; \
    case ",$KERNELS," in \
        *,ir,*) apt-get update; \
            apt-get install -y --no-install-recommends r-base-core r-cran-irkernel; \
            rm -rf /var/lib/apt/lists/*;; \
    esac; \
    if [ -n "$KERNELS" ]; then \
        /opt/kernel-env/bin/python /opt/kernel-env/share/kernel-env/install_kernelspecs.py; \
    fi

ENV PATH=/opt/kernel-env/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/kernelenv \
    KERNEL_ENV_SANDBOX=auto \
    KERNEL_ENV_KERNELS=python3${KERNELS:+,$KERNELS}

LABEL org.opencontainers.image.title="kernel-env" \
      org.opencontainers.image.description="OpenEnv REPL environment whose episodes run in real IPython kernels" \
      org.opencontainers.image.licenses="BSD-3-Clause"

# Root, so that each kernel gets a uid of its own (see the top of this file); Kubernetes'
# manifests run it as 10001 (runAsUser) with secrets as files.
USER 0:0
WORKDIR /home/kernelenv
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["tini", "-e", "143", "--"]
CMD ["kernel-env", "serve", "--host", "0.0.0.0", "--port", "8000"]
