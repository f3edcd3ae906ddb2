# deepserve's own image, for the gateway of rendered deployments (`deepserve deploy render`): the engine runs in its
# official image (vllm/vllm-openai), the gateway in this one. No engine and no GPU libraries in here.
#   docker build -t deepserve:0.1.0 .
# It runs as root so that a state directory bind-mounted from the host (compose's ./deepserve-home, where
# `deepserve keys create` wrote the keys) is readable whoever owns it on the host.
FROM python:3.12-slim
WORKDIR /opt/deepserve
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir .
ENV DEEPSERVE_HOME=/var/lib/deepserve
EXPOSE 8000
ENTRYPOINT ["python", "-m", "deepserve.cli.main"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "8000"]
