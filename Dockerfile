# The ledger service (control plane) only: no torch in this image. Production mode needs the
# Ed25519 key that signs the transparency log (openssl genpkey -algorithm ed25519 -out log.pem):
#   K="-v $PWD/log.pem:/run/secrets/log.pem:ro -e DPLEDGER_SIGNING_KEY_FILE=/run/secrets/log.pem"
#   docker build -t dpledger .
#   docker run --rm $K -v dpledger-data:/data dpledger init          # prints the first admin key once
#   docker run $K -p 8000:8000 -v dpledger-data:/data dpledger       # serves
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DPLEDGER_ENV=production DATABASE_URL=sqlite:////data/dpledger.db

RUN useradd --create-home --uid 10001 dpledger && mkdir /data && chown dpledger /data

# A regular (non-editable) install: the Alembic revisions ship inside the package as
# dpledger.migrations, so nothing of the source tree is needed at run time.
WORKDIR /tmp/dpledger-src
COPY pyproject.toml README.md LICENSE ./
COPY dpledger ./dpledger
COPY service ./service
COPY trainer ./trainer
COPY migrations ./migrations
RUN pip install '.[postgres]' && cd / && rm -rf /tmp/dpledger-src

WORKDIR /data
USER dpledger
VOLUME /data
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"
ENTRYPOINT ["dpledger"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
