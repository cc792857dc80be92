"""The tool-call parsers (serving/tool_parsers.py) on model text: content and calls apart, the same
result whatever pieces the text arrives in, and broken or unknown calls kept as content."""

from __future__ import annotations

import json

import pytest

from app.api.openai_schemas import ChatCompletionRequest
from app.api.tool_calls import ToolPlan, tool_plan
from serving.tool_parsers import CallEvent, parse_text

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"},
                                           "line": {"type": "integer"}}}


def plan(parser: str = "qwen3_coder", parallel: bool = True) -> ToolPlan:
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": parallel,
        "tools": [{"type": "function", "function": {"name": "read", "parameters": SCHEMA}},
                  {"type": "function", "function": {"name": "finish"}}]})
    p = tool_plan(body, parser)
    assert p is not None
    return p


XML = ("Let me look.\n<tool_call>\n<function=read>\n<parameter=path>\nsrc/a b.py\n</parameter>\n"
       "<parameter=line>\n12\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
       "<function=finish>\n</function>\n</tool_call>")
HERMES = ('Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "src/a b.py", '
          '"line": 12}}\n</tool_call>\n<tool_call>\n{"name": "finish", "arguments": {}}\n'
          "</tool_call>")


@pytest.mark.parametrize("parser, text", [("qwen3_coder", XML), ("hermes", HERMES)])
def test_calls_and_content_in_any_pieces(parser: str, text: str) -> None:
    whole = parse_text(plan(parser).parser(), text)
    assert [(e.call.name, e.call.arguments) for e in whole.calls] == [
        ("read", {"path": "src/a b.py", "line": 12}), ("finish", {})]
    assert whole.content.strip() == "Let me look." and not whole.invalid
    for cut in range(1, len(text)):  # every split point, as a stream delivers it
        streamed = plan(parser).parser()
        events = streamed.feed(text[:cut]) + streamed.feed(text[cut:]) + streamed.finish()
        calls = [e for e in events if isinstance(e, CallEvent)]
        assert [(e.call.name, e.call.arguments) for e in calls] == [
            (e.call.name, e.call.arguments) for e in whole.calls]
        assert "".join(e for e in events if isinstance(e, str)) == whole.content


def test_argument_pieces_join_to_the_arguments() -> None:
    call = parse_text(plan().parser(), XML).calls[0].call
    assert json.loads("".join(call.argument_pieces())) == call.arguments
    assert len(call.argument_pieces()) == 3


@pytest.mark.parametrize("block, why", [
    ("<tool_call>\n<function=write>\n</function>\n</tool_call>", "unknown tool 'write'"),
    ("<tool_call>\n<function=read>\n<parameter=line>\ntwelve\n</parameter>\n</function>\n"
     "</tool_call>", "parameter 'line': not JSON of type integer"),
    ("<tool_call>\nread src/a.py\n</tool_call>", "no <function=NAME>...</function> block"),
    ("<tool_call>\n<function=read>\n<parameter=path>\na\n</parameter>\n", "the call was not "
                                                                          "closed"),
])
def test_broken_calls_stay_content_and_say_why(block: str, why: str) -> None:
    reply = parse_text(plan().parser(), "ok " + block)
    assert reply.calls == [] and reply.content == "ok " + block
    assert reply.invalid == [why]


def test_one_call_when_parallel_calls_are_off() -> None:
    reply = parse_text(plan(parallel=False).parser(), XML)
    assert [e.call.name for e in reply.calls] == ["read"]
    assert reply.content.endswith("</tool_call>") and not reply.invalid
