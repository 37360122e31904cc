# The controller image: odyssey-controller, the odyssey CLI and odyssey-plan on Debian 12, no
# libtorch. It is made from the package `cpack` writes (docs/build.md, "Install and package"),
# the same tarball CI unpacks and runs (tests/package/package_test.py):
#
#   (cd build && cpack -G TGZ)                      # odyssey-<version>-linux-x86_64-odyssey.tar.gz
#   docker build -f deploy/docker/controller.Dockerfile -t odyssey-controller:0.1.0 build
#
# The build context is the folder holding the tarball (build/, where cpack writes it).
ARG ODYSSEY_PACKAGE=odyssey-0.1.0-linux-x86_64

# Stage 1: unpack the package and keep only the torch-free part.
FROM debian:12.8-slim AS unpack
ARG ODYSSEY_PACKAGE
COPY ${ODYSSEY_PACKAGE}-odyssey.tar.gz /tmp/
RUN mkdir -p /opt/odyssey \
 && tar -C /opt/odyssey -xzf /tmp/${ODYSSEY_PACKAGE}-odyssey.tar.gz \
 && rm -f /opt/odyssey/bin/odyssey-worker /opt/odyssey/bin/odyssey-train /opt/odyssey/bin/odyssey-bench

# Stage 2: the runtime. The Debian 12 libraries the three binaries load (the package test checks
# this list against them), curl for the health check.
FROM debian:12.8-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates curl \
      libabsl20220623 libc-ares2 libgrpc++1.51 libgrpc29 libprotobuf32 libre2-9 libssl3 \
      libsqlite3-0 libspdlog1.10 libfmt9 libyaml-cpp0.7 libprometheus-cpp-core1.0 libcpp-httplib0.11 \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/odyssey --create-home odyssey
COPY --from=unpack /opt/odyssey /opt/odyssey
ENV PATH=/opt/odyssey/bin:$PATH
USER 10001:10001
WORKDIR /var/lib/odyssey
# gRPC (JobService, TrainingService, PlannerService, grpc.health.v1) and Prometheus /metrics.
EXPOSE 50051 9464
# The same endpoint as the Kubernetes liveness probe (deploy/kubernetes/controller.yaml): the
# metrics port's /healthz, plain HTTP even when the gRPC port speaks TLS.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD curl -fsS http://127.0.0.1:9464/healthz || exit 1
ENTRYPOINT ["odyssey-controller"]
CMD ["--listen=0.0.0.0:50051", "--metrics-listen=0.0.0.0:9464", "--state-dir=/var/lib/odyssey"]
