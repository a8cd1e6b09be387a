"""Skipping applies that change nothing: the hash of what was built, and our fields still in place."""
from __future__ import annotations

import copy

from kvfleet.operator.applied import ANNOTATION_HASH, AppliedOnce, covers, unchanged, with_hash
from kvfleet.operator.builders import build_deployment
from kvfleet.operator.spec import parse_model_deployment

from op_factories import make_mdep


def live_copy(obj: dict) -> dict:
    """What the apiserver gives back: our fields plus defaults and status."""
    live = copy.deepcopy(obj)
    live["metadata"]["uid"] = "dep-uid"
    live["metadata"]["managedFields"] = [{"manager": "kvfleet-operator"}]
    live["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    live["status"] = {"replicas": 1}
    return live


def deployment(op_config, replicas: int = 1, image: str | None = None) -> dict:
    mdep = make_mdep({"model": {"source": "org/model"}, **({"engine": {"image": image}} if image else {})})
    spec = parse_model_deployment(mdep["spec"])
    return with_hash(build_deployment(mdep, spec, op_config, "h200", replicas, {"gpu": "h200"}, [], "abc123"))


def test_covers_ignores_what_others_added_but_not_what_they_changed() -> None:
    assert covers({"a": 1, "b": {"c": [1, {"d": 2, "e": 3}]}, "x": 0}, {"a": 1, "b": {"c": [1, {"d": 2}]}})
    assert not covers({"a": 1}, {"a": 1, "b": 2})  # a field of ours removed
    assert not covers({"a": "1"}, {"a": 1})  # changed type
    assert not covers({"l": [1, 2, 3]}, {"l": [1, 2]})  # lists are ours as a whole


def test_an_unchanged_deployment_is_not_applied_again(op_config) -> None:
    built = deployment(op_config)
    assert ANNOTATION_HASH in built["metadata"]["annotations"]
    assert not unchanged(None, built)
    assert unchanged(live_copy(built), built)
    listed = live_copy(built)
    del listed["apiVersion"], listed["kind"]  # an item of a LIST carries neither
    assert unchanged(listed, built)


def test_a_new_spec_or_an_edit_by_someone_else_is_applied(op_config) -> None:
    built = deployment(op_config)
    live = live_copy(built)
    assert not unchanged(live, deployment(op_config, replicas=2))
    assert not unchanged(live, deployment(op_config, image="img:2"))
    edited = copy.deepcopy(live)
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:1"
    assert not unchanged(edited, built)
    scaled = copy.deepcopy(live)
    scaled["spec"]["replicas"] = 5  # `kubectl scale deployment` by hand
    assert not unchanged(scaled, built)
    unhashed = copy.deepcopy(live)
    del unhashed["metadata"]["annotations"][ANNOTATION_HASH]  # made by an older operator
    assert not unchanged(unhashed, built)


def test_applied_once_until_forgotten() -> None:
    memo = AppliedOnce()
    key = ("ns", "chat", "uid-1")
    ticket = memo.needed(key)
    assert ticket is not None
    memo.done(ticket)
    assert memo.needed(key) is None and memo.needed(("ns", "chat", "uid-2"))  # a recreated object is new
    memo.forget("ns", "chat")
    assert memo.needed(key)


def test_an_edit_during_the_apply_is_not_recorded_as_applied() -> None:
    """The pass applied the Service as it was; someone's edit landed and its event forgot it before the pass
    recorded it: the next pass must apply (repair) it again."""
    memo = AppliedOnce()
    key = ("ns", "chat", "uid-1")
    ticket = memo.needed(key)
    assert ticket is not None
    memo.forget("ns", "chat")  # the edit's event, while the pass applied
    memo.done(ticket)
    assert memo.needed(key) is not None
