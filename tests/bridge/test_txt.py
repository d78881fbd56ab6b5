"""TXT codec: round trips, the 255-byte entry limit, and records we must refuse."""

from __future__ import annotations

import pytest
from zeroconf import ServiceInfo

from bridge.card import PROTOCOL_VERSION, SERVICE_TYPE, AgentCard
from bridge.txt import (
    EXTRA_TRUNCATED,
    TXT_ENTRY_MAX,
    TxtProtocolError,
    TxtRecordError,
    card_from_txt,
    card_to_txt,
    pick_address,
    server_name,
    txt_bytes,
)


def make_card(**overrides: object) -> AgentCard:
    fields: dict[str, object] = dict(
        node_id="3f2a9c0d41b7",
        name="studio-1",
        fleet_id="fleet-abc123",
        host="127.0.0.1",
        router_port=5555,
        pub_port=5556,
        roles=("proposer", "verifier"),
        chip="Apple M2 Ultra",
        mem_total=192 * 2**30,
        mem_free=150 * 2**30,
        models=("mlx-community/Qwen2.5-7B-Instruct-4bit", "smollm2-135m"),
        proposers=("ngram", "draft"),
    )
    fields.update(overrides)
    return AgentCard(**fields)  # type: ignore[arg-type]


def entries(props: dict[str, str]) -> list[bytes]:
    return [f"{k}={v}".encode() for k, v in props.items()]


def test_round_trip() -> None:
    card = make_card(extra=(("os", "macOS 15.1"),))
    assert card_from_txt(txt_bytes(card_to_txt(card)), address=card.host) == card


def test_round_trip_empty_lists_and_defaults() -> None:
    card = make_card(roles=(), models=(), proposers=(), chip="", name="", mem_total=0, mem_free=0)
    assert card_from_txt(txt_bytes(card_to_txt(card)), address="10.0.0.7") == \
        make_card(roles=(), models=(), proposers=(), chip="", name="", mem_total=0, mem_free=0,
                  host="10.0.0.7")


def test_round_trip_through_zeroconf_encoding() -> None:
    """What the browser sees is what zeroconf packed and unpacked, not our dict."""
    card = make_card(name="Mac Studio — bureau")
    info = ServiceInfo(SERVICE_TYPE, f"x.{SERVICE_TYPE}", port=card.router_port,
                       properties=card_to_txt(card), parsed_addresses=[card.host])
    # Build a second info from the packed TXT bytes, as a browser does from the wire.
    parsed = ServiceInfo(SERVICE_TYPE, f"x.{SERVICE_TYPE}", properties=info.text)
    assert card_from_txt(parsed.properties, address="127.0.0.1") == card


def test_address_comes_from_the_resolver_not_the_card() -> None:
    card = make_card(host="0.0.0.0")
    assert card_from_txt(txt_bytes(card_to_txt(card)), address="192.0.2.9").host == "192.0.2.9"


def test_no_secret_and_no_host_in_txt() -> None:
    props = card_to_txt(make_card())
    assert "127.0.0.1" not in props.values()
    with pytest.raises(ValueError, match="secret"):
        card_to_txt(make_card(extra=(("fleet_key", "hunter2"),)))


def test_long_lists_drop_whole_items_and_say_so() -> None:
    models = tuple(f"mlx-community/some-very-long-model-name-{i:02d}-4bit" for i in range(20))
    card = make_card(models=models, name="n" * 400, chip="é" * 300)
    props = card_to_txt(card)
    assert all(len(e) <= TXT_ENTRY_MAX for e in entries(props))
    back = card_from_txt(txt_bytes(props), address="127.0.0.1")
    assert 0 < len(back.models) < len(models)
    assert back.models == models[: len(back.models)]  # a prefix of whole items
    assert dict(back.extra)[EXTRA_TRUNCATED] == "models"
    assert back.name == "n" * len(back.name) and card.name.startswith(back.name)
    assert set(back.chip) == {"é"}  # cut on a character boundary
    # Re-encoding recomputes the marker instead of forwarding it as an extra.
    assert "x-" + EXTRA_TRUNCATED not in card_to_txt(back)


def test_identity_too_long_is_refused_not_cut() -> None:
    with pytest.raises(ValueError, match="never truncated"):
        card_to_txt(make_card(node_id="n" * 300))


def test_list_item_with_comma_is_refused() -> None:
    with pytest.raises(ValueError, match="comma"):
        card_to_txt(make_card(models=("a,b",)))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.pop(b"node"), "'node' is missing"),
        (lambda p: p.update({b"fleet": None}), "'fleet' has no value"),
        (lambda p: p.update({b"router": b"http"}), "not a non-negative integer"),
        (lambda p: p.update({b"pub": b"70000"}), "outside"),
        (lambda p: p.update({b"router": b"0"}), "outside"),
        (lambda p: p.update({b"mem": b"-5"}), "not a non-negative integer"),
        (lambda p: p.update({b"name": b"\xff\xfe"}), "not UTF-8"),
        (lambda p: p.update({b"\xff": b"1"}), "not UTF-8"),
        (lambda p: p.update({b"node": b""}), "must not be empty"),
        (lambda p: p.clear(), "'proto' is missing"),
    ],
)
def test_garbled_records_are_refused(mutate, message: str) -> None:
    props = txt_bytes(card_to_txt(make_card()))
    mutate(props)
    with pytest.raises(TxtRecordError, match=message):
        card_from_txt(props, address="127.0.0.1")


def test_other_protocol_is_a_distinct_error() -> None:
    props = txt_bytes(card_to_txt(make_card()))
    props[b"proto"] = str(PROTOCOL_VERSION + 1).encode()
    with pytest.raises(TxtProtocolError, match="protocol") as info:
        card_from_txt(props, address="127.0.0.1")
    assert info.value.protocol == PROTOCOL_VERSION + 1
    assert isinstance(info.value, ValueError)


def test_missing_address_is_refused() -> None:
    with pytest.raises(TxtRecordError, match="address"):
        card_from_txt(txt_bytes(card_to_txt(make_card())), address="")


def test_unknown_keys_are_ignored() -> None:
    props = txt_bytes(card_to_txt(make_card()))
    props[b"future_field"] = b"whatever"
    props[b"flag"] = None
    assert card_from_txt(props, address="127.0.0.1") == make_card()


def test_pick_address_prefers_routable_then_link_local() -> None:
    assert pick_address(["127.0.0.1", "169.254.3.4", "192.168.1.5"]) == "192.168.1.5"
    assert pick_address(["127.0.0.1", "169.254.3.4"]) == "169.254.3.4"
    assert pick_address(["127.0.0.1"]) == "127.0.0.1"
    assert pick_address([]) == ""


def test_server_name_is_a_local_host_name() -> None:
    name = server_name(make_card(node_id="ab.cd/" + "e" * 80))
    assert name.endswith(".local.") and len(name.split(".")[0]) <= 63
