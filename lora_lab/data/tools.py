"""Tool schemas and tool calls in the one form chat templates and servers use (OpenAI's).

A tool is `{"type": "function", "function": {"name", "description", "parameters"}}`: the form
LLaMA-Factory, ms-swift and OpenAI-style servers (vLLM, SGLang) put into the template, so the
model trains on the system prompt it is served with. Bare schemas (`{"name", "description",
"parameters"}`, as in LLaMA-Factory's glaive_toolcall demos, or Qwen-Agent's `name_for_model`
form) are wrapped unchanged, as ms-swift wraps them; a JSON string is parsed; anything else is an
error for that row.
"""

from __future__ import annotations

from ..errors import DataError
from .readers import Bad, kind_of, parse_json_text


def normalise_tools(value, field: str = "tools") -> list | None:
    """The row's tools as a list of OpenAI function tools, or None when it has none."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        value = parse_json_text(value)
        if isinstance(value, Bad):
            raise DataError(
                f"field `{field}` is text but not JSON: {value.reason}. It must be a "
                f"list of tool schemas (or that list as a JSON string)"
            )
    if isinstance(value, dict):
        raise DataError(f"field `{field}` must be a list of tools; got one object. Put it in a list: [{{...}}]")
    if not isinstance(value, list):
        raise DataError(f"field `{field}` must be a list of tools; got {kind_of(value)}")
    return [wrap_tool(tool, index) for index, tool in enumerate(value, start=1)] or None


def wrap_tool(tool, index: int) -> dict:
    """One tool in the function form; a bare schema gets the wrapper."""
    if not isinstance(tool, dict):
        raise DataError(f"tool {index}: expected an object (a function schema), got {kind_of(tool)}")
    kind = tool.get("type", "function")
    if kind != "function":
        raise DataError(f"tool {index}: type {kind!r}; only function tools are supported")
    if "function" in tool:
        function = tool["function"]
        wrapped = tool
    else:  # a bare schema, or the flat {"type": "function", "name": ...} form
        function = {k: v for k, v in tool.items() if k != "type"}
        wrapped = {"type": "function", "function": function}
    # Qwen-Agent style tools name themselves `name_for_model`; ms-swift wraps them unchanged
    name = function.get("name", function.get("name_for_model")) if isinstance(function, dict) else None
    if not isinstance(name, str) or not name.strip():
        raise DataError(f"tool {index}: needs a function `name` (text)")
    if "parameters" in function and not isinstance(function["parameters"], dict):
        raise DataError(
            f"tool {index} `{name}`: `parameters` must be a JSON schema object, got {kind_of(function['parameters'])}"
        )
    return wrapped


def normalise_tool_calls(value, where: str) -> list:
    """A message's `tool_calls` (a list of calls, each `{"name", "arguments"}` or wrapped)."""
    if not isinstance(value, list):
        raise DataError(f"{where}: `tool_calls` must be a list of calls; got {kind_of(value)}")
    return [tool_call(call, f"{where}, tool call {i}") for i, call in enumerate(value, start=1)]


def tool_call(call, where: str) -> dict:
    """One call as `{"type": "function", "function": {"name", "arguments": {...}}}`."""
    if not isinstance(call, dict):
        raise DataError(f"{where}: expected an object with `name` and `arguments`, got {kind_of(call)}")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError(f"{where}: a tool call needs a function `name` (text)")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        parsed = parse_json_text(arguments) if arguments.strip() else {}
        if isinstance(parsed, Bad):
            raise DataError(f"{where} `{function['name']}`: arguments are not JSON ({parsed.reason})")
        arguments = parsed
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise DataError(f"{where} `{function['name']}`: arguments must be a JSON object, got {kind_of(arguments)}")
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def calls_from_json_text(value, where: str) -> list:
    """The calls in a JSON string: one call object or a list of them (sharegpt `function_call`,
    ms-swift `tool_call` messages)."""
    if not isinstance(value, str):
        raise DataError(f"{where}: the call must be a JSON string, got {kind_of(value)}")
    parsed = parse_json_text(value)
    if isinstance(parsed, Bad):
        raise DataError(f"{where}: the call is not JSON ({parsed.reason})")
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not calls:
        raise DataError(f"{where}: the call list is empty")
    return [tool_call(call, where) for call in calls]
