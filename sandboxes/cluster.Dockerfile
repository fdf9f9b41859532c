# Images of the `cluster` profile of docker-compose.yml (see docs/SCALING.md).
#
#   node:      orch with its `ray` and `postgres` extras, git and bubblewrap: a Ray head or
#              worker node that runs orch's worktree and container runs
#   postgres:  a Postgres 15 server for the shared run store
#
# Build context is the REPO ROOT, on the local Debian base (no registry needed):
#   sandboxes/build-base.sh     # orch-base:bookworm, once
#   docker-compose --profile cluster build
ARG BASE=orch-base:bookworm

FROM ${BASE} AS node
ARG DEBIAN_FRONTEND=noninteractive
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends python3 python3-venv git bubblewrap ca-certificates; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/orch
WORKDIR /src
COPY pyproject.toml README.md ./
COPY orchestrator ./orchestrator
COPY agents ./agents
COPY skills ./skills
RUN set -eux; \
    /opt/orch/bin/pip install --no-cache-dir --disable-pip-version-check '/src[ray,postgres]'; \
    rm -rf /src; \
    /opt/orch/bin/orch --help >/dev/null
ENV PATH=/opt/orch/bin:$PATH RAY_USAGE_STATS_ENABLED=0
# Ray nodes run as an unprivileged user; the runs they execute are sandboxed as on any host.
RUN useradd --create-home --uid 10002 orch
USER orch
WORKDIR /home/orch

FROM ${BASE} AS postgres
ARG DEBIAN_FRONTEND=noninteractive
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends postgresql-15; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/*
USER postgres
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/orch
# First start: a cluster whose `orch` role (password from ORCH_PG_PASSWORD) owns database
# `orch`; then the server, on the address given (127.0.0.1 by default).
CMD ["sh", "-c", "set -eu; \
  if [ ! -s \"$PGDATA/PG_VERSION\" ]; then \
    printf '%s\\n' \"${ORCH_PG_PASSWORD:?set ORCH_PG_PASSWORD}\" > /tmp/pw; \
    initdb -U postgres --auth=scram-sha-256 --pwfile=/tmp/pw -D \"$PGDATA\" >/dev/null; \
    rm /tmp/pw; \
    pg_ctl -D \"$PGDATA\" -o \"-c listen_addresses=''\" -w start >/dev/null; \
    psql -q -U postgres -c \"CREATE ROLE orch LOGIN PASSWORD '$ORCH_PG_PASSWORD'\" \
         -c 'CREATE DATABASE orch OWNER orch' postgres; \
    pg_ctl -D \"$PGDATA\" -m fast -w stop >/dev/null; \
  fi; \
  exec postgres -D \"$PGDATA\" -c listen_addresses=\"${ORCH_PG_LISTEN:-127.0.0.1}\""]
