"""A model id resolves within the caller's tenant only."""

from __future__ import annotations

from kvfleet.gateway.catalog import ModelRef, build_catalog


def model(tenant: str, ns: str, name: str, served: str) -> ModelRef:
    return ModelRef(tenant=tenant, namespace=ns, deployment=name, served_name=served)


def test_two_tenants_may_both_call_a_model_chat() -> None:
    a, b = model("team-a", "team-a", "chat", "chat"), model("team-b", "team-b", "chat", "chat")
    cat = build_catalog([a, b])
    assert cat.resolve("team-a", "chat").model == a
    assert cat.resolve("team-b", "chat").model == b
    assert [i for i, _ in cat.models("team-a")] == ["chat"]


def test_another_tenants_model_is_not_found_by_any_name() -> None:
    cat = build_catalog([model("team-a", "team-a", "chat", "smollm2"), model("team-b", "team-b", "coder", "coder")])
    for name in ("coder", "team-b/coder"):
        res = cat.resolve("team-a", name)
        assert res.model is None
        assert res.message == f"The model `{name}` does not exist or you do not have access to it."
    assert cat.resolve("nobody", "chat").model is None
    assert cat.models("nobody") == ()


def test_served_name_and_qualified_name_both_resolve() -> None:
    m = model("team-a", "team-a", "chat", "smollm2")
    cat = build_catalog([m])
    assert cat.resolve("team-a", "smollm2").model == m
    assert cat.resolve("team-a", "team-a/chat").model == m
    assert cat.resolve("team-a", "chat").model is None  # the deployment's bare name is not a model id


def test_a_name_two_models_of_one_tenant_share_resolves_to_neither_and_says_which() -> None:
    x, y = model("team-a", "ns1", "chat", "chat"), model("team-a", "ns2", "chat", "chat")
    cat = build_catalog([x, y])
    res = cat.resolve("team-a", "chat")
    assert res.model is None and "`ns1/chat`, `ns2/chat`" in res.message
    assert cat.resolve("team-a", "ns2/chat").model == y
    assert [i for i, _ in cat.models("team-a")] == ["ns1/chat", "ns2/chat"]
