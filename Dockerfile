FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir -e ".[train]" \
    && useradd --create-home --uid 10001 featurestore && mkdir -p /data && chown featurestore /data
ENV FEATURESTORE_DATA_DIR=/data
USER featurestore
