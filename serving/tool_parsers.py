"""Function calls in a model's text: each model family's syntax inside
`<tool_call>...</tool_call>`, the parser that splits a generation into content and calls, and
the xgrammar structural tag that makes a generation a call.

The family is named by a parser setting (`engine.tool_parser` for the API, the harness's own
for the bootstrap):

- `qwen3_coder` (the default model's): XML, each argument raw text between tags, never
  JSON-escaped (`<function=NAME>` then `<parameter=P>` blocks; see trainer/init_model.py);
- `hermes` (Qwen2.5/Qwen3, Hermes, many fine-tunes): `{"name": ..., "arguments": {...}}`.

`CallParser` runs over text as it arrives, streamed or not, through one code path: text
outside blocks is content; a block becomes one call once it closes, so a stream assembles to
exactly what the whole text parses to. A block that does not parse, or names a tool that was
not offered, stays content and is recorded as invalid (with why); so does a block never closed
(cut by max_tokens).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

OPEN, CLOSE = "<tool_call>", "</tool_call>"


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

    def render(self, call: ParsedCall) -> str:
        """`call` as the family's chat template writes it, tags included."""
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

    def render(self, call: ParsedCall) -> str:
        parameters = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
            "\n</parameter>\n" for k, v in call.arguments.items())
        return f"{OPEN}\n<function={call.name}>\n{parameters}</function>\n{CLOSE}"


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

    def render(self, call: ParsedCall) -> str:
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        return f"{OPEN}\n{body}\n{CLOSE}"


FORMATS: dict[str, CallFormat] = {"qwen3_coder": QwenXml(), "hermes": Hermes()}


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
        raise ValueError(f"cannot enforce tool_choice on these schemas: {exc}") from None
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
    """Splits one generation's text, fed as it is sampled, into content and calls of the
    offered tools (`schemas`: parameters JSON Schema by tool name)."""

    format: CallFormat
    schemas: dict[str, dict[str, Any]]
    parallel: bool = True
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
        if self.calls and not self.parallel:  # one call only: the rest is text
            return self._content(block)
        parsed = self.format.parse(block[len(OPEN): -len(CLOSE)], self.schemas)
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


def parse_text(parser: CallParser, text: str) -> CallParser:
    """`parser` fed the whole of `text`: its calls, content and invalid blocks."""
    parser.feed(text)
    parser.finish()
    return parser
