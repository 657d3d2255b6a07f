"""Tools and user prompts for the forced-tool-call checks: tests/integration/test_tool_calling.py
and benchmarks/bench_tool_calls.py (which adds EMAIL and the last two prompts)."""

from __future__ import annotations


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


WEATHER = _tool("get_weather", "Current weather in a city", {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    ["city"])  # fmt: skip
CALC = _tool("calculate", "Evaluate an arithmetic operation", {
    "a": {"type": "number"}, "b": {"type": "number"},
    "op": {"type": "string", "enum": ["add", "sub", "mul", "div"]}}, ["a", "b", "op"])  # fmt: skip
SEARCH = _tool("search_web", "Search the web", {
    "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
    "sites": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}, ["query"])  # fmt: skip
EVENT = _tool("create_event", "Add an event to the calendar", {
    "title": {"type": "string"}, "all_day": {"type": "boolean"},
    "when": {"type": "object", "properties": {"date": {"type": "string"},
             "hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["date"]}},
    ["title", "when"])  # fmt: skip
EMAIL = _tool("send_email", "Send an email", {
    "to": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "subject": {"type": "string"}, "body": {"type": "string"}}, ["to", "subject"])  # fmt: skip
NO_ARGS = {"type": "function", "function": {"name": "get_time", "description": "The time"}}
PROMPTS = [
    "What's the weather like in Paris today?",
    "Add 17 and 25 for me.",
    "Find recent news about the Mars rover.",
    "Put a dentist appointment on my calendar for March 3rd at 9.",
    "Is it raining in Tokyo? Use fahrenheit.",
    "What time is it?",
    "Multiply 3.5 by 12, then tell me the weather in Oslo.",
    "Email Sam that the meeting moved to Friday.",
    "Weather in Rome and in Madrid, please.",
]


def schemas(tools: list[dict]) -> dict[str, dict]:
    """Each tool's parameters schema by name (a tool without one takes any object)."""
    return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
            for t in tools}  # fmt: skip
