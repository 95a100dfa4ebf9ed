# One image for every iop service (gateway, scheduler, worker, simulator); compose.yaml
# chooses the command. Build: docker build -t iop:local .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# The dependencies first, from pyproject.toml alone: a change to the code rebuilds the
# layers below in seconds instead of installing every dependency again.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt \
    && useradd --system --no-create-home iop
COPY README.md ./
COPY common ./common
COPY gateway ./gateway
COPY scheduler ./scheduler
COPY workers ./workers
COPY iop ./iop
RUN pip install --no-deps . && rm -rf build *.egg-info
COPY docker/http-ok /usr/local/bin/http-ok

USER iop
EXPOSE 8080 9100
CMD ["iop", "--help"]
