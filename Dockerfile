# The replicator's container image: the release binary on a minimal glibc base, as kube-rs
# operators (kube-rs/controller-rs) ship. The binary is built outside, on the host:
#
#   cargo build --release -p replicator && docker build .      # or: podman build .
#
# The default base is public; e2e/scripts/build-image.sh builds without any registry: it assembles
# an equivalent base from the host's libraries and builds this file with buildah
# (--build-arg BASE=localhost/replicator-base:<hash> --build-arg BINARY=<path>).
# .dockerignore sends only the binary.

# Needs glibc (and libgcc_s): the binary links them dynamically. Runs as nonroot (65532).
ARG BASE=gcr.io/distroless/cc-debian12:nonroot
FROM ${BASE}

# The binary to ship, relative to the build context.
ARG BINARY=target/release/replicator
# Provenance labels; build-image.sh passes the repository's remote and commit when known.
ARG SOURCE=""
ARG REVISION=""

LABEL org.opencontainers.image.title="replicator" \
      org.opencontainers.image.description="Mirrors network objects from Kubernetes cells onto a Karmada hub" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.revision="${REVISION}"

COPY ${BINARY} /replicator

# /metrics (--metrics-bind-address) and /healthz, /readyz (--health-probe-bind-address).
EXPOSE 8080 8081
USER 65532:65532
ENTRYPOINT ["/replicator"]
