# The gateway, without Spark (the default target):
#     docker build -t headgate .
#     docker run -p 7878:7878 -p 9464:9464 -v headgate-data:/data headgate
# The pipeline (Spark and a Java runtime; compose.yaml runs both):
#     docker build --target pipeline -t headgate-pipeline .
#
# Versions are constraints.txt's, the ones CI tested.

ARG PYTHON_IMAGE=python:3.11-slim

# The wheel, with the C frame writer built (gcc and zlib's headers stay here).
FROM ${PYTHON_IMAGE} AS wheel
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev zlib1g-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in LICENSE README.md constraints.txt ./
COPY docs/PYPI.md docs/
COPY src src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# What both images share: one unprivileged user, the same uid in both, since
# the pipeline reads the logs the gateway writes on the shared /data volume.
FROM ${PYTHON_IMAGE} AS base
RUN useradd --system --uid 10001 --user-group --home-dir /data --no-create-home headgate \
    && mkdir /data && chown headgate:headgate /data
ENV PYTHONUNBUFFERED=1

FROM base AS pipeline
RUN apt-get update \
    && apt-get install -y --no-install-recommends default-jre-headless \
    && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /wheels /tmp/wheels
COPY constraints.txt /tmp/
RUN pip install --no-cache-dir -c /tmp/constraints.txt "$(ls /tmp/wheels/headgate-*.whl)[spark]" \
    && rm -r /tmp/wheels /tmp/constraints.txt
USER headgate
WORKDIR /data
VOLUME /data
ENTRYPOINT ["headgate", "pipeline"]
CMD ["/etc/headgate/pipeline.toml"]

# The gateway: the last stage, so that a plain `docker build` makes it.
FROM base AS gateway
COPY --from=wheel /wheels /tmp/wheels
COPY constraints.txt /tmp/
# The plain install: no Spark, no Java.
RUN pip install --no-cache-dir -c /tmp/constraints.txt /tmp/wheels/headgate-*.whl \
    && rm -r /tmp/wheels /tmp/constraints.txt
USER headgate
WORKDIR /data
VOLUME /data
# One JSON object per log line, for whatever collects the container's output
# (docker run -e HEADGATE_LOG_FORMAT=text for people reading `docker logs`).
ENV HEADGATE_LOG_FORMAT=json
# 7878: producers and pipelines; 9464: Prometheus metrics (and the health check).
EXPOSE 7878 9464
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:9464/metrics', timeout=4)"]
ENTRYPOINT ["headgate", "serve"]
CMD ["--listen", "0.0.0.0:7878", "--data-dir", "/data", "--metrics", "0.0.0.0:9464"]
