"""Four client libraries nobody here wrote (issue 43), pinned in the `clients` extra, on the
embedded model with a tool-capable template: openai (`parse()`, tools cut by max_tokens,
streamed and not), instructor in TOOLS and JSON_SCHEMA modes, langchain-openai `bind_tools`
(required, named) and `with_structured_output`, litellm tools. Every call returns a valid object
or a clear 400, and no tool-call markup reaches `content`.

The whole matrix runs against `serve --local` (the shared smollm2 server, conftest.py); behind
`up --serve` (a fleet of 2 agents, its own) the API layer is the same code, so only what the
fleet path changes runs there too: a response_format grammar (openai `parse()`) and a tool
grammar (a named call equal to `serve --local`'s) decoded by the verifier agent, and a streamed
answer cut by max_tokens. Every call of the module to one backend goes at once (`local_calls`,
`fleet_calls`): one batch on the server (slow: smollm2 on the CPU), the longest answer's
iterations instead of each test's batch one after another; each test reads its own calls'
outcome (an assertion that failed in the call's thread fails that test)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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
from serve_testkit import API_KEY, SMOLLM2_START_S, TOOLS_TEMPLATE, Server, stop_server
from verify_table import keep_verify_table

pytestmark = pytest.mark.slow
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
           "--no-pin", "--serve", "--chat-template", str(TOOLS_TEMPLATE), "--port", "0",
           "--api-key", API_KEY]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    deadline, seen = time.monotonic() + SMOLLM2_START_S, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        m = re.search(r"on (http://[\d.]+:\d+)/v1", line)
        if m:
            assert "verifier agent" in line, line  # served by the fleet, not in-process
            return Server(m.group(1), proc, "smollm2", API_KEY, line.strip())
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"up --serve did not start: {''.join(seen)[-2000:]}")


def _down(home: Path) -> None:
    subprocess.run([sys.executable, "-m", "macfleet", "down"], capture_output=True, timeout=60,
                   env={**os.environ, "MACFLEET_HOME": str(home)})


@pytest.fixture(scope="module")
def fleet(verify_table, tmp_path_factory):
    """`up --serve`: this module's own (no other module's tests need a smollm2 fleet's API)."""
    home = tmp_path_factory.mktemp("fleet")
    try:
        s = _up_serve(home)
        try:
            yield s
        finally:
            stop_server(s)
    finally:
        _down(home)


def _openai(s: Server):
    import openai

    return openai.OpenAI(base_url=s.v1, api_key=s.key, max_retries=0, timeout=SMOLLM2_START_S)


def _clean(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), text


# -- the checks: each a function of the backend, called at once by the fixtures below ---------
def parse_and_bad_strict_schema(s: Server) -> None:
    import openai

    c = _openai(s)
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


def required_call_cut_by_max_tokens(s: Server, stream: bool) -> None:
    c = _openai(s)
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


def instructor_both_modes(s: Server) -> None:
    """Both modes at once (were a parametrized test each)."""
    import instructor

    def extract(mode: str) -> User:
        ic = instructor.from_openai(_openai(s), mode=getattr(instructor.Mode, mode))
        return ic.chat.completions.create(model="smollm2", response_model=User, max_tokens=100,
                                          max_retries=0, temperature=0,
                                          messages=[{"role": "user", "content": USER_Q}])

    with cf.ThreadPoolExecutor(2) as ex:
        users = list(ex.map(extract, ("TOOLS", "JSON_SCHEMA")))
    for user in users:
        assert isinstance(user, User) and user.age == 34, users


def langchain_tools_and_structured_output(s: Server) -> None:
    import langchain_openai
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    llm = langchain_openai.ChatOpenAI(model="smollm2", base_url=s.v1, api_key=s.key,
                                      max_tokens=40, temperature=0, max_retries=0)
    with cf.ThreadPoolExecutor(3) as ex:
        calls = [ex.submit(llm.bind_tools([get_weather], tool_choice=choice).invoke, WEATHER_Q)
                 for choice in ("required", "get_weather")]
        user = ex.submit(llm.with_structured_output(User).invoke, USER_Q)
        for f in calls:
            msg = f.result()
            _clean(msg.content)
            assert [t["name"] for t in msg.tool_calls] == ["get_weather"], msg
            assert isinstance(msg.tool_calls[0]["args"].get("city"), str)
        assert isinstance(user.result(), User)


def litellm_tools(s: Server) -> None:
    import litellm

    r = litellm.completion(model="openai/smollm2", api_base=s.v1, api_key=s.key,
                           messages=[{"role": "user", "content": WEATHER_Q}], tools=[WEATHER],
                           tool_choice="required", max_tokens=40, temperature=0)
    msg = r.choices[0].message
    _clean(msg.content)
    assert [t.function.name for t in msg.tool_calls] == ["get_weather"]


@contextlib.contextmanager
def _at_once(calls: dict[str, Callable[[], object]]) -> Iterator[dict[str, cf.Future]]:
    """Every call started at once, one thread each (one batch on the server: each test's
    calls one after another were the module's minutes); the futures by name. The client
    libraries are imported here first: two threads importing one module for the first time
    race (one saw openai's httpx2 partly initialized in a fresh clone's run)."""
    for lib in ("httpx2", "openai", "instructor", "langchain_openai", "litellm"):
        if importlib.util.find_spec(lib) is not None:
            importlib.import_module(lib)
    with cf.ThreadPoolExecutor(len(calls)) as ex:
        yield {name: ex.submit(fn) for name, fn in calls.items()}


@pytest.fixture(scope="module")
def verify_table():
    """smollm2's verify(L) table measured once, in this process, before either backend starts,
    and kept in the run's cache: the `serve --local` server and the fleet's verifier agent read
    it instead of measuring their own (tests/verify_table.py)."""
    from macfleet.engine.models import embedded_model_path

    if embedded_model_path() is None:
        pytest.skip("the embedded smollm2 is not installed")
    keep_verify_table("smollm2", load=False)


@pytest.fixture(scope="module")
def local_calls(verify_table, smollm2_server) -> Iterator[dict[str, cf.Future]]:
    """Every `serve --local` check of the module, at once."""
    s = smollm2_server
    with _at_once({"parse": lambda: parse_and_bad_strict_schema(s),
                   "cut": lambda: required_call_cut_by_max_tokens(s, False),
                   "cut streamed": lambda: required_call_cut_by_max_tokens(s, True),
                   "instructor": lambda: instructor_both_modes(s),
                   "langchain": lambda: langchain_tools_and_structured_output(s),
                   "litellm": lambda: litellm_tools(s)}) as futures:
        yield futures


@pytest.fixture(scope="module")
def fleet_calls(smollm2_server, fleet) -> Iterator[dict[str, cf.Future]]:
    """Every `up --serve` check of the module, at once (the named call: both backends)."""
    from test_tool_grammar import NAMED, _ask

    with _at_once({"parse": lambda: parse_and_bad_strict_schema(fleet),
                   "cut streamed": lambda: required_call_cut_by_max_tokens(fleet, True),
                   "named local": lambda: _ask(_openai(smollm2_server), NAMED),
                   "named fleet": lambda: _ask(_openai(fleet), NAMED)}) as futures:
        yield futures


def test_openai_parse_returns_the_model_and_a_bad_strict_schema_is_a_clear_400(local_calls):
    local_calls["parse"].result()


# behind the fleet streamed only: a whole answer is the same stream, collected by the API layer
@pytest.mark.parametrize("stream", [False, True])
def test_openai_required_call_cut_by_max_tokens_is_length_without_markup(local_calls, stream):
    local_calls["cut streamed" if stream else "cut"].result()


def test_instructor_returns_the_model_in_tools_and_json_schema_modes(local_calls):
    local_calls["instructor"].result()


def test_langchain_bind_tools_required_and_named_and_structured_output(local_calls):
    local_calls["langchain"].result()


def test_litellm_tools(local_calls):
    local_calls["litellm"].result()


def test_through_the_fleet_openai_parse_and_a_bad_strict_schema(fleet_calls):
    fleet_calls["parse"].result()


def test_through_the_fleet_a_streamed_required_call_cut_by_max_tokens(fleet_calls):
    fleet_calls["cut streamed"].result()


def test_a_named_tool_call_through_the_fleet_is_the_one_serve_local_gives(fleet_calls):
    """Tool grammars travel as any grammar does (protocol 4's grammar fields): behind
    `up --serve` the fleet's verifier agent masks its batch rows. A named call through the
    fleet is the one `serve --local` gives for the same request (greedy), with schema-valid
    arguments; and that one is constrained plain decoding's in-process (test_tool_grammar.py's
    test_enforced_greedy_calls_equal_constrained_plain_decoding_and_bad_combos_beside asks the
    same request: its `_ask`). Was a reference decoded in this process too (a third smollm2
    load, 54 s of this module's set-up on a loaded box), and before that test_tool_grammar.py's
    test_enforced_tool_calls_through_a_fleet_equal_serve_local, with a fleet of its own."""
    from test_tool_grammar import _valid

    local, through = fleet_calls["named local"].result(), fleet_calls["named fleet"].result()
    finish, got = through
    assert finish == "tool_calls" and len(got) == 1, through
    _valid(got, ("get_time",))
    assert through == local
