"""The client suite's own checks fire: a property the schema does not name is found at any depth
(and one the schema allows is not), a value that breaks its schema is named, and a reply the
suite cannot read, or that is cut, fails the suite's promises (no server)."""

from __future__ import annotations

from nanoserve.bench.structured_cases import CASES, Contact, Drawing, Settings, Weather, case
from nanoserve.bench.structured_check import extra_properties, schema_error
from nanoserve.bench.structured_clients import Ask, Outcome, _check, _read_reply
from nanoserve.commands.bench_structured_clients import _kept, format_report

CONTACT = {
    "name": "Tom",
    "email": "tom@mail.com",
    "address": {"street": "1 Oak St", "city": "Springfield", "postal_code": "90210"},
}


def test_there_are_at_least_twenty_cases_with_distinct_models():
    assert len(CASES) >= 20 and len({c.name for c in CASES}) == len(CASES)


def test_a_whole_value_passes_both_checks():
    schema = Contact.model_json_schema()
    assert schema_error(CONTACT, schema) is None and extra_properties(CONTACT, schema) == []


def test_an_extra_property_is_found_at_each_depth():
    schema = Contact.model_json_schema()
    top = {**CONTACT, "country": "US"}
    nested = {**CONTACT, "address": {**CONTACT["address"], "zip": "1"}}  # behind a $ref
    assert extra_properties(top, schema) == ["$.country"]
    assert extra_properties(nested, schema) == ["$.address.zip"]
    assert schema_error(nested, schema) is None  # JSON Schema allows it: only this check sees it


def test_extras_inside_unions_optionals_and_lists_are_found():
    shapes = {"title": "t", "shapes": [{"kind": "circle", "radius": 2, "color": "red"}]}
    assert extra_properties(shapes, Drawing.model_json_schema()) == ["$.shapes[0].color"]
    weather = {"city": "Oslo", "temperature_c": 1, "condition": "sunny", "wind_kmh": None, "x": 1}
    assert extra_properties(weather, Weather.model_json_schema()) == ["$.x"]


def test_what_the_schema_allows_is_not_extra():
    settings = {"theme": "dark", "font_size": 12, "language": "en"}
    assert extra_properties(settings, Settings.model_json_schema()) == []
    scores = {"game": "chess", "scores": {"ana": 3}}
    assert extra_properties(scores, case("Scoreboard").model.model_json_schema()) == []
    patterned = {"type": "object", "properties": {}, "patternProperties": {"^x_": {}}}
    assert extra_properties({"x_1": 1, "y": 2}, patterned) == ["$.y"]


def test_a_value_that_breaks_its_schema_is_named():
    schema = Contact.model_json_schema()
    bad_code = {**CONTACT, "address": {**CONTACT["address"], "postal_code": "9021"}}
    assert schema_error(bad_code, schema).startswith("address/postal_code:")
    missing = {k: v for k, v in CONTACT.items() if k != "email"}
    assert "email" in schema_error(missing, schema)


def _outcome(content: str, finish: str = "stop", name: str = "Contact") -> Outcome:
    outcome = Outcome(Ask(case(name), "http-structured-outputs", 0.0, True), status=200)
    body = {
        "choices": [{"finish_reason": finish, "message": {"content": content}}],
        "usage": {"completion_tokens": 7},
    }
    _read_reply(outcome, body)
    _check(outcome)
    return outcome


def test_the_suite_fails_what_it_cannot_read_cut_or_extra():
    import json

    whole = _outcome(json.dumps(CONTACT))
    assert whole.valid and whole.completion_tokens == 7 and _kept(whole)
    cut = _outcome(json.dumps(CONTACT)[:20], finish="length")
    assert not cut.valid and cut.schema_error.startswith("not JSON") and not _kept(cut)
    extra = _outcome(json.dumps({**CONTACT, "country": "US"}))
    assert extra.valid and extra.extra == ["$.country"] and not _kept(extra)
    empty = Outcome(Ask(case("Contact"), "openai-parse", 0.0, True), status=400)
    assert not empty.valid and not _kept(empty)
    ungated = Outcome(Ask(case("Contact"), "instructor-json", 0.0, True), status=200)
    assert _kept(ungated)
    report = format_report([whole, cut, extra])
    assert "http-structured-outputs" in report and "extra ['$.country']" in report
