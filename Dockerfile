# One image for every iop service (gateway, scheduler, worker, simulator); compose.yaml
# chooses the command. Build: docker build -t iop:local .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY gateway ./gateway
COPY scheduler ./scheduler
COPY workers ./workers
COPY iop ./iop
RUN pip install . && useradd --system --no-create-home iop

USER iop
EXPOSE 8080 9100
CMD ["iop", "--help"]
