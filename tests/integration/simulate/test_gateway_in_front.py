"""Two simulated replicas behind deepserve's gateway: requests stream through it, and the replicas' vLLM series
(each with the load it was told to report) come through /metrics/engines, as the gateway's routing will read them."""

from __future__ import annotations

import httpx
import openai

from deepserve.bench.server_metrics import parse_metrics
from deepserve.engines.config import EngineConfig
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.server import running_gateway
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.server import running_simulator
from deepserve.simulate.setup import resolve

MODEL = "cognitivecomputations/DeepSeek-V3-0324-AWQ"


async def test_the_gateway_streams_from_simulated_replicas_and_shows_their_metrics() -> None:
    config = SimulateConfig(gpu="h100", time_scale=0.02)
    deployment = resolve(EngineConfig(model=MODEL), config)
    async with running_simulator(deployment, config) as quiet, running_simulator(deployment, config) as busy:
        assert busy.app is not None
        busy.app.controls.metric_overrides["vllm:num_requests_waiting"] = 12
        gateway = GatewayConfig.model_validate(
            {"upstream": [quiet.base_url, busy.base_url], "port": 0, "health_check_interval_s": 0.2}
        )
        async with running_gateway(gateway) as (_, url):
            api = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
            for _ in range(4):
                stream = await api.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
                chunks = [chunk async for chunk in stream]
                assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
            async with httpx.AsyncClient() as http:
                models = (await http.get(url + "/models")).json()["data"]
                text = (await http.get(url.removesuffix("/v1") + "/metrics/engines")).text
        assert models[0]["id"] == MODEL and models[0]["max_model_len"] == deployment.max_model_len
        assert f'vllm:num_requests_waiting{{replica="{busy.base_url}",engine="0",model_name="{MODEL}"}} 12.0' in text
        assert parse_metrics(text)["vllm:num_requests_waiting"] == 12  # summed over the replicas
        assert quiet.app is not None
        assert quiet.app.stats.completed + busy.app.stats.completed == 4
