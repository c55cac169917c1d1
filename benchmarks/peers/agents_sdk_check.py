"""The OpenAI Agents SDK's own Responses-API model against a running pagedserve server: an agent with a function
tool runs to its tool call (the SDK parses our `function_call` item, calls the Python function, and stops on it), and
an agent without tools answers in text (streamed through the SDK's event stream too). Prints one JSON line.

    python -m venv /tmp/agentsvenv && /tmp/agentsvenv/bin/pip install openai-agents==0.24.0
    pagedserve serve --http-port 8000 &
    /tmp/agentsvenv/bin/python benchmarks/peers/agents_sdk_check.py --base-url http://127.0.0.1:8000

Kept out of the test dependencies: the SDK brings a stack of its own (mcp, griffe, ...); run it by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled)
from openai import AsyncOpenAI

calls: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    calls.append(city)
    return f"Sunny in {city}"


async def main(base_url: str, model_name: str) -> dict:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    model = OpenAIResponsesModel(model=model_name, openai_client=client)
    settings = ModelSettings(temperature=0, max_tokens=64)
    tooled = Agent(name="weather", instructions="Use the tool to answer.", model=model, tools=[get_weather],
                   tool_use_behavior="stop_on_first_tool",
                   model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=64))
    with_tool = await Runner.run(tooled, "What is the weather in Paris?")
    plain = Agent(name="plain", instructions="Answer briefly.", model=model, model_settings=settings)
    text = await Runner.run(plain, "What is the capital of France?")
    streamed = Runner.run_streamed(plain, "What is the capital of France?")
    deltas = []
    async for event in streamed.stream_events():
        if event.type == "raw_response_event" and getattr(event.data, "type", "") == "response.output_text.delta":
            deltas.append(event.data.delta)
    return {"tool_calls": calls, "tool_run_output": with_tool.final_output, "text_output": text.final_output,
            "streamed_output": streamed.final_output, "streamed_deltas_join": "".join(deltas),
            "stream_matches": "".join(deltas) == streamed.final_output == text.final_output}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.base_url, args.model))))
