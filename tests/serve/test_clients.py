"""Four client libraries nobody here wrote (issue 43), pinned in the `clients` extra, against
`serve --local` and `up --serve` on the embedded model with a tool-capable template: openai
(`parse()`, tools cut by max_tokens, streamed and not), instructor in TOOLS and JSON_SCHEMA
modes, langchain-openai `bind_tools` (required, named) and `with_structured_output`, litellm
tools. Every call returns a valid object or a clear 400, and no tool-call markup reaches
`content`. One server per backend, few calls, small max_tokens (slow: it loads the model)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

# the extra is what CI installs (.ci/setup). Each test imports its library: importing all four
# here would cost every collecting process seconds (litellm alone ~3 s), the fast lane included,
# which deselects this slow module only after collecting it.
for _name in ("instructor", "langchain_openai", "litellm", "openai"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"the 'clients' extra is not installed (no {_name}): pip install -e "
                    "'.[clients]'", allow_module_level=True)
from pydantic import BaseModel
from serve_testkit import Server, start_server, stop_server

pytestmark = pytest.mark.slow
TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
KEY = "clients-key"
START_S = 300.0
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name":')
WEATHER_Q = "What is the weather in Paris?"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
USER_Q = "John Smith is 34 years old. Extract the user."


class User(BaseModel):
    name: str
    age: int


def _up_serve(home: Path) -> Server:
    """`macfleet up --serve` with serve's options (a fleet of 2 agents), its API's banner read."""
    env = {**os.environ, "MACFLEET_HOME": str(home)}
    cmd = [sys.executable, "-m", "macfleet", "up", "--model", "smollm2", "--agents", "2",
           "--no-pin", "--serve", "--chat-template", str(TEMPLATE), "--port", "0",
           "--api-key", KEY]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    deadline, seen = time.monotonic() + START_S, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        m = re.search(r"on (http://[\d.]+:\d+)/v1", line)
        if m:
            assert "verifier agent" in line, line  # served by the fleet, not in-process
            return Server(m.group(1), proc, "smollm2", KEY, line.strip())
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"up --serve did not start: {''.join(seen)[-2000:]}")


def _down(home: Path) -> None:
    subprocess.run([sys.executable, "-m", "macfleet", "down"], capture_output=True, timeout=60,
                   env={**os.environ, "MACFLEET_HOME": str(home)})


@pytest.fixture(scope="module", params=["serve --local", "up --serve"])
def server(request, tmp_path_factory):
    mp = pytest.MonkeyPatch()  # LITELLM_LOCAL_MODEL_COST_MAP: tests/conftest.py
    if request.param == "serve --local":
        import serve_testkit

        mp.setattr(serve_testkit, "START_TIMEOUT_S", START_S)
        s = start_server("--chat-template", str(TEMPLATE), model="smollm2", key=KEY)
        try:
            yield s
        finally:
            stop_server(s)
            mp.undo()
        return
    home = tmp_path_factory.mktemp("fleet")
    try:
        s = _up_serve(home)
        try:
            yield s
        finally:
            stop_server(s)
    finally:
        _down(home)
        mp.undo()


def _openai(s: Server):
    import openai

    return openai.OpenAI(base_url=s.v1, api_key=KEY, max_retries=0, timeout=START_S)


def _clean(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), text


def test_openai_parse_returns_the_model_and_a_bad_strict_schema_is_a_clear_400(server):
    import openai

    c = _openai(server)
    r = c.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": USER_Q}],
                                 response_format=User, max_tokens=40, temperature=0)
    assert isinstance(r.choices[0].message.parsed, User), r
    open_schema = {"type": "object", "additionalProperties": True,
                   "properties": {"name": {"type": "string"}}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "u", "strict": True, "schema": open_schema}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert "additionalProperties" in e.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_required_call_cut_by_max_tokens_is_length_without_markup(server, stream):
    c = _openai(server)
    kw = dict(model="smollm2", messages=[{"role": "user", "content": WEATHER_Q}],
              tools=[WEATHER], tool_choice="required", max_tokens=8, temperature=0)
    if not stream:
        ch = c.chat.completions.create(**kw).choices[0]
        content, calls, finish = ch.message.content, ch.message.tool_calls, ch.finish_reason
    else:
        chunks = [x.choices[0] for x in c.chat.completions.create(**kw, stream=True)
                  if x.choices]
        content = "".join(x.delta.content or "" for x in chunks)
        calls = [t for x in chunks for t in (x.delta.tool_calls or [])]
        finish = chunks[-1].finish_reason
    _clean(content)
    assert not calls and finish == "length"


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_the_model(server, mode):
    import instructor

    ic = instructor.from_openai(_openai(server), mode=getattr(instructor.Mode, mode))
    user = ic.chat.completions.create(model="smollm2", response_model=User, max_tokens=100,
                                      max_retries=0, temperature=0,
                                      messages=[{"role": "user", "content": USER_Q}])
    assert isinstance(user, User) and user.age == 34


def test_langchain_bind_tools_required_and_named_and_structured_output(server):
    import langchain_openai
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    llm = langchain_openai.ChatOpenAI(model="smollm2", base_url=server.v1, api_key=KEY,
                                      max_tokens=40, temperature=0, max_retries=0)
    for choice in ("required", "get_weather"):
        msg = llm.bind_tools([get_weather], tool_choice=choice).invoke(WEATHER_Q)
        _clean(msg.content)
        assert [t["name"] for t in msg.tool_calls] == ["get_weather"], msg
        assert isinstance(msg.tool_calls[0]["args"].get("city"), str)
    user = llm.with_structured_output(User).invoke(USER_Q)
    assert isinstance(user, User)


def test_litellm_tools(server):
    import litellm

    r = litellm.completion(model="openai/smollm2", api_base=server.v1, api_key=KEY,
                           messages=[{"role": "user", "content": WEATHER_Q}], tools=[WEATHER],
                           tool_choice="required", max_tokens=40, temperature=0)
    msg = r.choices[0].message
    _clean(msg.content)
    assert [t.function.name for t in msg.tool_calls] == ["get_weather"]


@pytest.fixture(scope="module")
def named_call_reference():
    """The named call constrained plain decoding gives in this process: computed once for
    both backends (it was decoded again for each)."""
    from test_tool_grammar import NAMED, plain_tool_calls

    return plain_tool_calls(NAMED, parallel_tool_calls=False)[1]


def test_a_named_tool_call_is_the_one_constrained_plain_decoding_gives(server,
                                                                       named_call_reference):
    """Tool grammars travel as any grammar does (protocol 4's grammar fields): behind
    `up --serve` the fleet's verifier agent masks its batch rows. A named call through either
    backend is the one constrained plain decoding of the same request gives in this process
    (greedy), with schema-valid arguments. Was test_tool_grammar.py's
    test_enforced_tool_calls_through_a_fleet_equal_serve_local, which started a fleet of its own
    and two servers for it (74 s); `serve --local` equals the same reference there."""
    from test_tool_grammar import NAMED, QUESTION, TOOLS, _valid

    r = _openai(server).chat.completions.create(
        model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
        parallel_tool_calls=False, temperature=0, max_tokens=80).choices[0]
    got = [(x.function.name, x.function.arguments) for x in r.message.tool_calls or []]
    assert r.finish_reason == "tool_calls" and len(got) == 1, r
    _valid(got, ("get_time",))
    assert got == named_call_reference
