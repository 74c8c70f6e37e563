# The stepstream image: the wheel built from this repository, installed on
# python:3.11-slim, run as an unprivileged user; plus the examples, so the Helm chart's
# defaults (workers.workflows: examples.order) run as they are. Your own image starts
# FROM this one and copies its workflow modules to /app (docs/operations.md).
#
#   docker build -t ghcr.io/stepstream/stepstream:0.1.0 .

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY stepstream/ stepstream/
COPY engine/ engine/
COPY consumers/ consumers/
COPY producers/ producers/
COPY ops/ ops/
COPY schemas/ schemas/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app
RUN groupadd --gid 10001 stepstream \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /data \
        --shell /usr/sbin/nologin stepstream \
    && mkdir -p /data /app \
    && chown 10001:10001 /data
COPY --from=build /dist/ /wheels/
RUN pip install --no-cache-dir /wheels/stepstream-*.whl && rm -rf /wheels
COPY examples/ /app/examples/
WORKDIR /app
USER 10001:10001
EXPOSE 8233
ENTRYPOINT ["stepstream"]
CMD ["--help"]
