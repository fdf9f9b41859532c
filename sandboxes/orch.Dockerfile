# orch:latest — the orch CLI in a container, built on the sandbox image.
#
# Build context is the REPO ROOT:
#   docker build --network host -f sandboxes/orch.Dockerfile -t orch:latest .
# (or `docker-compose build orch`). `--network host` because pip needs PyPI
# at build time and the bridge network is forbidden here. Build
# orch-sandbox:latest first (sandboxes/build.sh).
ARG SANDBOX_IMAGE=orch-sandbox:latest
FROM ${SANDBOX_IMAGE}

USER root
ARG DEBIAN_FRONTEND=noninteractive
# Extra CA certificates (PEM text), for hosts whose egress to PyPI / the model
# API goes through a TLS-intercepting proxy. Example:
#   --build-arg EXTRA_CA_CERTS="$(cat /usr/local/share/ca-certificates/*.crt)"
# Public certificates only — build args are visible in `docker history`.
ARG EXTRA_CA_CERTS=
RUN set -eu; \
    if [ -n "$EXTRA_CA_CERTS" ]; then \
        printf '%s\n' "$EXTRA_CA_CERTS" > /usr/local/share/ca-certificates/orch-extra.crt; \
        update-ca-certificates >/dev/null; \
    fi
# pip (vendored certifi) and httpx/requests (certifi) otherwise ignore the system store.
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
# Debian's python3 is "externally managed" (PEP 668): install into a venv.
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends python3-venv; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/orch

# Only what the wheel needs (keeps .git, caches, etc. out of the layer).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY orchestrator ./orchestrator
COPY agents ./agents
COPY skills ./skills
RUN set -eux; \
    /opt/orch/bin/pip install --no-cache-dir --disable-pip-version-check /src; \
    rm -rf /src; \
    /opt/orch/bin/orch --help >/dev/null

ENV PATH=/opt/orch/bin:$PATH
# Runs as the unprivileged agent user. To drive sandboxes through the host
# engine, mount /var/run/docker.sock AND add the socket's group
# (docker-compose.yml: group_add) — which is root-equivalent on the host.
USER 10001:10001
WORKDIR /workspace
ENTRYPOINT ["orch"]
CMD ["--help"]
