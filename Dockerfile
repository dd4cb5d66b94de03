# The ledger service (control plane) only: no torch in this image.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    DATABASE_URL=sqlite:////data/dpledger.db

RUN useradd --create-home --uid 10001 dpledger && mkdir /data && chown dpledger /data
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY trainer ./trainer
COPY dpledger ./dpledger
COPY migrations ./migrations
# Editable, so that migrations/ stays beside the package where `dpledger serve` finds it.
RUN pip install -e '.[postgres]'

USER dpledger
VOLUME /data
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"
ENTRYPOINT ["dpledger", "serve", "--host", "0.0.0.0", "--port", "8000"]
