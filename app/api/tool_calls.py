"""OpenAI function calling on a model that writes its calls as text: a chat request's tools
checked against its conversation and the model's template, and the reply's text split into
`content` and `tool_calls` by the family's parser (serving/tool_parsers.py, named by the
`engine.tool_parser` setting).

The parser runs over the text of either engine's output, streamed or not, through one code
path: a call goes out once it closes (name first, then its arguments in pieces, one per
parameter), so a streamed reply assembles to exactly the non-streamed one. A block that does
not parse, or names a tool the request did not offer, stays `content` and is counted
(`flywheel_invalid_tool_calls_total`); a block cut off by `max_tokens` stays `content` too
(finish_reason "length").

`tool_choice` "auto" only parses; "required" and a named function are enforced while
sampling: the request carries an xgrammar structural tag (the model family's call syntax with
each tool's JSON Schema) that both engines apply as a token mask. "none" hides the tools from
the prompt and parses nothing.
"""

from __future__ import annotations

import functools
import json
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from app.api.errors import ApiError
from app.api.openai_schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from serving.tool_parsers import FORMATS, CallEvent, CallFormat, CallParser, structural_tag

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


# ---- the request ------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's function calling needs after it is checked."""

    tools: list[dict[str, Any]]  # the OpenAI tool objects the template renders
    schemas: dict[str, dict[str, Any]]  # parameters JSON Schema by tool name
    parallel: bool
    format: CallFormat
    structural_tag: str | None  # the grammar both engines enforce (required / named)

    def parser(self) -> CallParser:
        return CallParser(self.format, self.schemas, self.parallel)


def _check_schema(schema: dict[str, Any], param: str) -> None:
    if schema.get("type", "object") != "object":
        raise ApiError(400, f"{param}: a function's parameters must be a JSON Schema of "
                       "type object", param=param)
    problem = _schema_problem(json.dumps(schema, sort_keys=True))
    if problem is not None:
        raise ApiError(400, f"{param} is not a valid JSON Schema: {problem}", param=param)


@functools.lru_cache(maxsize=1024)
def _schema_problem(schema_json: str) -> str | None:
    """Why a schema (as canonical JSON) is not a valid JSON Schema, or None. Cached: an agent
    sends the same tools every turn, and checking a schema against its metaschema costs about
    a millisecond, as much as several decode steps."""
    schema = json.loads(schema_json)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return str(exc.message)
    return None


def check_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as the template takes it (assistant call arguments decoded), after
    checking that each `tool` message answers an earlier call."""
    called: set[str] = set()
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise ApiError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                           param=f"messages[{i}].tool_calls")
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments or "{}")
                except json.JSONDecodeError:
                    arguments = None
                if not isinstance(arguments, dict):
                    param = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise ApiError(400, f"{param} is not a JSON object", param=param)
                called.add(call.id)
                calls.append({"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": arguments}})
            message["tool_calls"] = calls
        if m.role == "tool":
            if m.tool_call_id is None or m.tool_call_id not in called:
                raise ApiError(400, f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no "
                               "earlier assistant tool call", param=f"messages[{i}].tool_call_id")
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def tool_plan(body: ChatCompletionRequest, parser: str) -> ToolPlan | None:
    """Check `body`'s tools and tool_choice; None when nothing is to be parsed (no tools, or
    tool_choice "none")."""
    if body.tool_choice is not None and not body.tools:
        raise ApiError(400, "tool_choice is only allowed when tools are given",
                       param="tool_choice")
    if not body.tools or body.tool_choice == "none":
        return None
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(body.tools):
        name = tool.function.name
        if name in schemas:
            raise ApiError(400, f"tools[{i}]: a second tool named {name!r}",
                           param=f"tools[{i}].function.name")
        schema = tool.function.parameters
        if schema is not None:
            _check_schema(schema, f"tools[{i}].function.parameters")
        schemas[name] = schema if schema is not None else _EMPTY_PARAMETERS
    asked = body.tool_choice or "auto"
    choice = asked.function.name if isinstance(asked, NamedToolChoice) else str(asked)
    if isinstance(asked, NamedToolChoice) and choice not in schemas:
        raise ApiError(400, f"tool_choice names {choice!r}, which is not among the tools",
                       param="tool_choice.function.name")
    tools = [_openai_tool(t, schemas[t.function.name]) for t in body.tools]
    call_format = FORMATS[parser]
    try:
        tag = None if choice == "auto" else structural_tag(
            call_format.xgrammar_model, json.dumps(tools), choice, body.parallel_tool_calls)
    except ValueError as exc:
        raise ApiError(400, f"tools: {exc}", param="tools") from None
    return ToolPlan(tools=tools, schemas=schemas, parallel=body.parallel_tool_calls,
                    format=call_format, structural_tag=tag)


def _openai_tool(tool: Tool, schema: dict[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name, "parameters": schema}
    if tool.function.description:
        function["description"] = tool.function.description
    return {"type": "function", "function": function}


_RENDERS_TOOLS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows tools to the model at all."""
    if tokenizer not in _RENDERS_TOOLS:
        _RENDERS_TOOLS[tokenizer] = _renders_tools(tokenizer)
    return _RENDERS_TOOLS[tokenizer]


def _renders_tools(tokenizer: Any) -> bool:
    probe = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "probe_tool_name",
                                              "parameters": _EMPTY_PARAMETERS}}
    try:
        text = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False)
    except Exception:
        return False
    return "probe_tool_name" in str(text)


def content_of(parser: CallParser) -> str | None:
    """A reply's `content` beside its calls: None when only calls were said."""
    text = parser.content.strip() if parser.calls else parser.content
    return text or (None if parser.calls else "")


def tool_call_dicts(events: Iterable[CallEvent]) -> list[dict[str, Any]]:
    return [{"id": e.id, "type": "function", "function": {
        "name": e.call.name, "arguments": "".join(e.call.argument_pieces())}} for e in events]
