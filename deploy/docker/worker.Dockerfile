# The worker image: odyssey-worker (and odyssey-train, odyssey-bench) with libtorch and the CUDA
# libraries it loads, on Debian 12. Made from the two tarballs `cpack` writes
# (docs/build.md, "Install and package"): `odyssey` (binaries) and `torch` (lib/odyssey:
# libtorch's libraries; on the CUDA build also cuDNN, cuBLAS, NCCL, ... from the torch wheel's
# nvidia packages, so no CUDA base image is needed; the GPU driver comes from the host through
# the NVIDIA container toolkit, which the NVIDIA_* variables below ask for).
#
#   GPU: on a GPU host, scripts/gpu/build.sh, then (cd build-gpu && cpack -G TGZ):
#     docker build -f deploy/docker/worker.Dockerfile -t odyssey-worker:0.1.0 build-gpu
#   CPU (the cpu-demo overlay; the tarballs CI runs):
#     docker build -f deploy/docker/worker.Dockerfile \
#       --build-arg ODYSSEY_PACKAGE=odyssey-0.1.0-linux-x86_64 -t odyssey-worker:0.1.0-cpu build
ARG ODYSSEY_PACKAGE=odyssey-0.1.0-linux-x86_64-cuda

# Stage 1: unpack both tarballs into one folder.
FROM debian:12.8-slim AS unpack
ARG ODYSSEY_PACKAGE
COPY ${ODYSSEY_PACKAGE}-odyssey.tar.gz ${ODYSSEY_PACKAGE}-torch.tar.gz /tmp/
RUN mkdir -p /opt/odyssey \
 && tar -C /opt/odyssey -xzf /tmp/${ODYSSEY_PACKAGE}-odyssey.tar.gz \
 && tar -C /opt/odyssey -xzf /tmp/${ODYSSEY_PACKAGE}-torch.tar.gz

# Stage 2: the runtime. The Debian 12 libraries the binaries load (the package test checks this
# list against them), bible-kjv for the `kjv` dataset, curl for the health check.
FROM debian:12.8-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates curl bible-kjv \
      libabsl20220623 libc-ares2 libgrpc++1.51 libgrpc29 libprotobuf32 libre2-9 libssl3 \
      libsqlite3-0 libspdlog1.10 libfmt9 libyaml-cpp0.7 libprometheus-cpp-core1.0 libcpp-httplib0.11 \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/odyssey --create-home odyssey
COPY --from=unpack /opt/odyssey /opt/odyssey
ENV PATH=/opt/odyssey/bin:$PATH \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /var/lib/odyssey
# Prometheus /metrics (the worker serves no gRPC: it dials the controller).
EXPOSE 9465
# The same endpoint as the Kubernetes liveness probe (deploy/kubernetes/workers.yaml).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD curl -fsS http://127.0.0.1:9465/healthz || exit 1
ENTRYPOINT ["odyssey-worker"]
CMD ["--controller=odyssey-controller:50051", "--metrics-listen=0.0.0.0:9465", "--device=auto"]
