# The KV-cache Indexer: kv-indexer-server (the entrypoint), kv-indexer-bridge,
# kv-indexer-router, kv-indexer-ctl, and kv-indexer-sim (a simulated SGLang worker, for
# demos and tests such as deploy/compose/).
#
# Nothing is compiled here: scripts/build_image.sh builds the binaries with cargo, stages them
# in target/image/bin (the only files .dockerignore lets into the context), makes the base
# when its tag is missing (no registry: Debian's packages, debootstrap, docker import) and
# runs `docker build`. By hand, after staging:
#
#   docker build -t kv-indexer .
#   docker run -p 127.0.0.1:50051:50051 kv-indexer
#   docker run --entrypoint kv-indexer-bridge -e KV_INDEXER_WORKER_ID=w0 ... kv-indexer
#
# Configuration is by environment only (every flag has its variable: `--help` of each
# binary). The binaries need only glibc, so the Debian slim base is all there is.
ARG BASE=debian:bookworm-slim
FROM ${BASE}

# A fixed, unprivileged uid and gid, so that a state volume keeps its owner across images.
RUN groupadd --system --gid 10001 kv-indexer \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/kv-indexer \
        --shell /usr/sbin/nologin kv-indexer \
    && mkdir -p /var/lib/kv-indexer \
    && chown kv-indexer:kv-indexer /var/lib/kv-indexer

COPY target/image/bin/ /usr/local/bin/

# The server listens beyond loopback (a container's loopback is its own); metrics and
# GET /state on 9090; the router, when this image runs it, beyond loopback too. The logs have
# no colour codes (NO_COLOR: they go to files, not to a terminal).
#
# The state directory is off by default as in the binary (in memory: a restart starts empty
# and the bridges refill it): set KV_INDEXER_STATE_DIR=/var/lib/kv-indexer and mount a volume
# there (`-v kv-state:/var/lib/kv-indexer`) for an index that survives restarts
# (deploy/compose/ does, for its replicas). Not set here, because an image's variable cannot
# be unset by `docker run`, and an empty one is refused. No VOLUME: it would give every
# container of this image (bridges, router, workers too) an anonymous volume it never uses.
ENV KV_INDEXER_LISTEN_ADDR=0.0.0.0:50051 \
    KV_INDEXER_METRICS_ADDR=0.0.0.0:9090 \
    KV_ROUTER_LISTEN_ADDR=0.0.0.0:30080 \
    RUST_LOG=info \
    NO_COLOR=1
WORKDIR /var/lib/kv-indexer
EXPOSE 50051 9090

USER kv-indexer:kv-indexer

# SIGTERM: stop accepting, drain (KV_INDEXER_DRAIN_TIMEOUT_S, 10 s), a last snapshot, exit.
# Give `docker stop` more than the drain: `docker stop -t 30`, compose stop_grace_period.
STOPSIGNAL SIGTERM

# The server's check. A container running another binary of this image (bridge, router,
# simulated worker) has no server to ask: give it its own check, or `docker run
# --no-healthcheck` (deploy/compose/ sets one per role).
# grpc.health.v1 on the server's own port: SERVING once the state is loaded and, for a
# replica of a fleet, while it is within KV_INDEXER_MAX_LAG_MS of the shared log. (Plaintext:
# with TLS on the listener, give the check's variables, KV_INDEXER_TLS_CA and the like.)
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 \
    CMD kv-indexer-ctl --endpoint "http://127.0.0.1:${KV_INDEXER_LISTEN_ADDR##*:}" --timeout-ms 2000 health

ENTRYPOINT ["kv-indexer-server"]
