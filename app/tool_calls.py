"""OpenAI function calling on a model that writes its calls as text: checking a request's
tools against its conversation, the grammar that enforces `tool_choice`, and the parser that
turns the model's text back into `tool_calls`.

A model calls a tool by writing a `<tool_call>...</tool_call>` block in its turn; what sits
inside depends on the model family, named by the `engine.tool_parser` setting:

- `qwen3_coder` (the default model's): XML, each argument raw text between tags, never
  JSON-escaped (`<function=NAME>` then `<parameter=P>` blocks; see trainer/init_model.py);
- `hermes` (Qwen2.5/Qwen3, Hermes, many fine-tunes): `{"name": ..., "arguments": {...}}`.

The parser runs over the text of either engine's output, streamed or not, through one code
path (`CallParser`): text outside blocks is `content`; a block goes out as one call once it
closes (name first, then its arguments in pieces, one per parameter), so a streamed reply
assembles to exactly the non-streamed one. A block that does not parse, or names a tool the
request did not offer, stays `content` and is counted as an invalid call. A block cut off by
`max_tokens` stays `content` too (finish_reason "length").

`tool_choice` "auto" only parses; "required" and a named function are enforced while
sampling: the request carries an xgrammar structural tag (the model family's call syntax with
each tool's JSON Schema) that both engines apply as a token mask. "none" hides the tools from
the prompt and parses nothing.
"""

from __future__ import annotations

import json
import re
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, Protocol

import jsonschema

from app.errors import ApiError
from app.openai_schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ParserName = Literal["qwen3_coder", "hermes"]
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]

    def argument_pieces(self) -> list[str]:
        """The arguments as a JSON object in pieces, one per parameter, that join to
        `json.dumps(arguments)`: what a stream sends, in order."""
        items = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                 for k, v in self.arguments.items()]
        if not items:
            return ["{}"]
        return ["{" + items[0], *(", " + item for item in items[1:]), "}"]


class CallFormat(Protocol):
    """One family's call syntax inside `<tool_call>...</tool_call>`."""

    xgrammar_model: str  # the key of xgrammar's structural tag for this family

    def parse(self, block: str, tools: dict[str, dict[str, Any]]) -> ParsedCall | str:
        """The call in `block` (between the tags), or why it is not one."""
        ...


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """A raw XML argument as its schema types it: strings stay raw, the rest is JSON."""
    types = schema.get("type", "string")
    types = types if isinstance(types, list) else [types]
    if "string" in types and len(types) == 1:
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        if "string" in types or not schema:
            return value
        raise ValueError(f"not JSON of type {'/'.join(types)}") from None


class QwenXml:
    """Qwen3-Coder: `<function=NAME>` then `<parameter=P>\\nraw value\\n</parameter>` blocks.
    One whitespace character on each side of a value belongs to the syntax (the template
    writes a newline there; the grammar allows any one)."""

    xgrammar_model = "qwen_3_coder"
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*)</function>\s*", re.DOTALL)
    _PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>[ \n\r\t]?(.*?)[ \n\r\t]?</parameter>",
                            re.DOTALL)

    def parse(self, block: str, tools: dict[str, dict[str, Any]]) -> ParsedCall | str:
        function = self._FUNCTION.fullmatch(block)
        if function is None:
            return "no <function=NAME>...</function> block"
        name, body = function.group(1), function.group(2)
        if name not in tools:
            return f"unknown tool {name!r}"
        properties = tools[name].get("properties", {})
        arguments: dict[str, Any] = {}
        position = 0
        while (parameter := self._PARAMETER.match(body, position)) is not None:
            key, raw = parameter.group(1), parameter.group(2)
            if key in arguments:
                return f"parameter {key!r} given twice"
            try:
                arguments[key] = _typed(raw, properties.get(key, {}))
            except ValueError as exc:
                return f"parameter {key!r}: {exc}"
            position = parameter.end()
        if body[position:].strip():
            return "text between parameters"
        return ParsedCall(name, arguments)


class Hermes:
    """Hermes / Qwen3: a JSON object `{"name": ..., "arguments": {...}}`."""

    xgrammar_model = "qwen_3"

    def parse(self, block: str, tools: dict[str, dict[str, Any]]) -> ParsedCall | str:
        try:
            call = json.loads(block)
        except json.JSONDecodeError as exc:
            return f"not JSON: {exc.msg}"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return "not an object with a name"
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some fine-tunes encode them twice
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return "arguments are not a JSON object"
        if not isinstance(arguments, dict):
            return "arguments are not a JSON object"
        if call["name"] not in tools:
            return f"unknown tool {call['name']!r}"
        return ParsedCall(call["name"], arguments)


FORMATS: dict[str, CallFormat] = {"qwen3_coder": QwenXml(), "hermes": Hermes()}


# ---- the request ------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's function calling needs after it is checked."""

    tools: list[dict[str, Any]]  # the OpenAI tool objects the template renders
    schemas: dict[str, dict[str, Any]]  # parameters JSON Schema by tool name
    choice: str  # "auto", "required" or the named function
    parallel: bool
    format: CallFormat
    structural_tag: str | None  # the grammar both engines enforce (required / named)


def _check_schema(schema: dict[str, Any], param: str) -> None:
    if schema.get("type", "object") != "object":
        raise ApiError(400, f"{param}: a function's parameters must be a JSON Schema of "
                       "type object", param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ApiError(400, f"{param} is not a valid JSON Schema: {exc.message}",
                       param=param) from None


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
    if isinstance(asked, NamedToolChoice):
        if asked.function.name not in schemas:
            raise ApiError(400, f"tool_choice names {asked.function.name!r}, which is not "
                           "among the tools", param="tool_choice.function.name")
    choice = asked.function.name if isinstance(asked, NamedToolChoice) else str(asked)
    tools = [_openai_tool(t, schemas[t.function.name]) for t in body.tools]
    call_format = FORMATS[parser]
    tag = None if choice == "auto" else structural_tag(
        call_format.xgrammar_model, json.dumps(tools), choice, body.parallel_tool_calls)
    return ToolPlan(tools=tools, schemas=schemas, choice=choice,
                    parallel=body.parallel_tool_calls, format=call_format, structural_tag=tag)


def _openai_tool(tool: Tool, schema: dict[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name, "parameters": schema}
    if tool.function.description:
        function["description"] = tool.function.description
    return {"type": "function", "function": function}


# whitespace the grammar allows between a call's syntax elements, beyond the template's own
# newlines: unbounded, an untrained model can spend its whole budget on it
_WHITESPACE = 1


@lru_cache(maxsize=256)  # an agent sends the same tools on every turn
def structural_tag(model: str, tools_json: str, choice: str, parallel: bool) -> str:
    """xgrammar's structural tag (JSON) for the family's call syntax, each call's arguments
    typed by its schema: one call of the named function, or (`required`) one or more calls
    (one when not `parallel`) and nothing else, as the family's template asks ("no suffix")."""
    import xgrammar
    from xgrammar.structural_tag import StructuralTag, TagsWithSeparatorFormat

    tools = json.loads(tools_json)
    try:
        if choice != "required":
            tag = xgrammar.get_model_structural_tag(
                model, tools=tools, reasoning="disabled", max_whitespace_cnt=_WHITESPACE,
                tool_choice={"type": "function", "function": {"name": choice}})
        else:  # the family's call tags, as the builtin's auto-mode triggers them, text-free
            calls = xgrammar.get_model_structural_tag(
                model, tools=tools, tool_choice="auto", reasoning="disabled",
                max_whitespace_cnt=_WHITESPACE).format
            tag = StructuralTag(format=TagsWithSeparatorFormat(
                tags=calls.tags, separator="\n", at_least_one=True,  # type: ignore[union-attr]
                stop_after_first=not parallel))
    except Exception as exc:  # a schema xgrammar cannot turn into a grammar
        raise ApiError(400, f"tools: cannot enforce tool_choice on these schemas: {exc}",
                       param="tools") from None
    return str(tag.model_dump_json())


# ---- the reply ---------------------------------------------------------------------------
@dataclass
class CallEvent:
    """A complete call, as the stream sends it."""

    index: int
    id: str
    call: ParsedCall


@dataclass
class CallParser:
    """Splits one choice's text, fed as it is sampled, into content and calls."""

    plan: ToolPlan
    calls: list[CallEvent] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)  # why each rejected block was rejected
    content: str = ""
    _pending: str = ""  # text not yet known to be content or a call

    def feed(self, text: str) -> list[str | CallEvent]:
        """Content pieces and the calls that `text` completed, in order."""
        self._pending += text
        out: list[str | CallEvent] = []
        while self._pending:
            start = self._pending.find(OPEN)
            if start < 0:  # hold back a tail that may begin a block
                keep = _partial_suffix(self._pending, OPEN)
                out += self._content(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            out += self._content(self._pending[:start])
            self._pending = self._pending[start:]
            end = self._pending.find(CLOSE)
            if end < 0:
                break
            block, self._pending = self._pending[: end + len(CLOSE)], \
                self._pending[end + len(CLOSE):]
            out += self._block(block)
        return out

    def finish(self) -> list[str | CallEvent]:
        """The rest of the text: an unclosed block is content (and an invalid call)."""
        rest, self._pending = self._pending, ""
        if rest.startswith(OPEN):
            self.invalid.append("the call was not closed")
        return self._content(rest)

    def _content(self, text: str) -> list[str | CallEvent]:
        if not text:
            return []
        self.content += text
        return [text]

    def _block(self, block: str) -> list[str | CallEvent]:
        if self.calls and not self.plan.parallel:  # one call only: the rest is text
            return self._content(block)
        parsed = self.plan.format.parse(block[len(OPEN): -len(CLOSE)], self.plan.schemas)
        if isinstance(parsed, str):
            self.invalid.append(parsed)
            return self._content(block)
        event = CallEvent(index=len(self.calls), id=f"call_{uuid.uuid4().hex[:24]}",
                          call=parsed)
        self.calls.append(event)
        return [event]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_reply(plan: ToolPlan, text: str) -> CallParser:
    parser = CallParser(plan)
    parser.feed(text)
    parser.finish()
    return parser


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
