"""Keys -> tenant: the table from Secrets, rotation, refusals, and that keys never leak into problems."""

from __future__ import annotations

import base64

from kvfleet.gateway.keys import MIN_KEY_LENGTH, SecretRef, build_key_table, key_digest

A1, A2, B1 = "team-a-key-000000000001", "team-a-key-000000000002", "team-b-key-000000000001"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def ref(name: str) -> SecretRef:
    return SecretRef("kvfleet-system", name)


def test_every_entry_of_a_named_secret_is_a_key_of_its_tenant() -> None:
    table, problems = build_key_table({"team-a": [ref("a")], "team-b": [ref("b")]},
                                      {ref("a"): {"old": b64(A1), "new": b64(A2)}, ref("b"): {"k": b64(B1)}})
    assert problems == []
    assert table.tenant_for(A1) == "team-a" and table.tenant_for(A2) == "team-a"
    assert table.tenant_for(B1) == "team-b"
    assert table.tenant_for("team-a-key-000000000003") is None
    assert table.tenant_for(None) is None and table.tenant_for("") is None
    assert table.per_tenant() == {"team-a": 2, "team-b": 1}


def test_rotation_is_a_new_table_from_the_changed_secret() -> None:
    refs = {"team-a": [ref("a")]}
    before, _ = build_key_table(refs, {ref("a"): {"k1": b64(A1)}})
    during, _ = build_key_table(refs, {ref("a"): {"k1": b64(A1), "k2": b64(A2)}})
    after, _ = build_key_table(refs, {ref("a"): {"k2": b64(A2)}})
    assert before.tenant_for(A2) is None
    assert during.tenant_for(A1) == during.tenant_for(A2) == "team-a"
    assert after.tenant_for(A1) is None and after.tenant_for(A2) == "team-a"


def test_the_table_holds_digests_only() -> None:
    table, _ = build_key_table({"team-a": [ref("a")]}, {ref("a"): {"k": b64(A1)}})
    assert list(table.by_digest) == [key_digest(A1)]
    assert A1.encode() not in repr(table).encode()


def test_a_key_of_two_tenants_is_refused_for_both_and_named_without_its_value() -> None:
    table, problems = build_key_table({"team-a": [ref("a"), ref("shared")], "team-b": [ref("shared")]},
                                      {ref("a"): {"k": b64(A1)}, ref("shared"): {"k": b64(B1)}})
    assert table.tenant_for(B1) is None
    assert table.tenant_for(A1) == "team-a"
    assert problems == ["1 key(s) shared by tenants team-a, team-b: refused for all of them"]
    assert all(B1 not in p for p in problems)


def test_short_undecodable_and_missing_are_problems_naming_secret_and_entry_not_value() -> None:
    short = "x" * (MIN_KEY_LENGTH - 1)
    table, problems = build_key_table({"team-a": [ref("a"), ref("gone")]},
                                      {ref("a"): {"short": b64(short), "bad": "%%%", "ok": b64(A1)}})
    assert table.tenant_for(A1) == "team-a" and table.tenant_for(short) is None
    text = "\n".join(problems)
    assert "Secret kvfleet-system/a: entry 'short' is shorter than 16 characters" in text
    assert "entry 'bad' is not base64" in text
    assert "Secret kvfleet-system/gone not found" in text
    assert short not in text


def test_surrounding_whitespace_of_a_stored_key_is_ignored() -> None:
    table, _ = build_key_table({"team-a": [ref("a")]}, {ref("a"): {"k": b64(f"  {A1}\n")}})
    assert table.tenant_for(A1) == "team-a"
