"""Mechanisms on the wire: what validation refuses (and where it says so), how `resolve` fills in q,
the one-to-one map onto dp_accounting events, and that a stored mechanism reads back the same."""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any

import pytest
from dp_accounting import dp_event as de
from pydantic import TypeAdapter, ValidationError

from dpledger.service.accounting.events import MechanismError, resolve, to_dp_event
from dpledger.wire import mechanisms as mech
from dpledger.wire.mechanisms import (
    MAX_COMPOSED,
    MAX_COUNT,
    MAX_NESTING,
    Composed,
    DpSgd,
    Gaussian,
    Laplace,
    PoissonSampled,
    RepeatAndSelect,
    SampledWithoutReplacement,
    SelfComposed,
    ZCdp,
    check_nesting,
    nesting_depth,
)

ADAPTER: TypeAdapter[Any] = TypeAdapter(mech.Mechanism)
G1 = {"type": "gaussian", "noise_multiplier": 1.0}


def errors_of(raw: Any) -> list[dict[str, Any]]:
    with pytest.raises(ValidationError) as caught:
        if isinstance(raw, str):
            ADAPTER.validate_json(raw)
        else:
            ADAPTER.validate_python(raw)
    return caught.value.errors()


def chain(depth: int) -> dict[str, Any]:
    """A raw mechanism `depth` levels deep: depth - 1 self_composed wrappers around one gaussian."""
    value: dict[str, Any] = dict(G1)
    for _ in range(depth - 1):
        value = {"type": "self_composed", "count": 2, "event": value}
    return value


# --- validation: every bad number is refused, and the error's loc names the field -----------------

NON_FINITE = [math.nan, math.inf, -math.inf]

# (raw python mechanism, the exact loc of the (first) error, its pydantic error type)
BAD: list[tuple[dict[str, Any], tuple[Any, ...], str]] = [
    *[({"type": "gaussian", "noise_multiplier": v}, ("gaussian", "noise_multiplier"), "finite_number") for v in NON_FINITE],
    *[({"type": "laplace", "noise_multiplier": v}, ("laplace", "noise_multiplier"), "finite_number") for v in NON_FINITE],
    *[({"type": "zcdp", "rho": v}, ("zcdp", "rho"), "finite_number") for v in NON_FINITE],
    *[({"type": "zcdp", "rho": 0.1, "xi": v}, ("zcdp", "xi"), "finite_number") for v in NON_FINITE],
    *[
        (
            {"type": "dpsgd", "noise_multiplier": v, "steps": 1, "sampling_rate": 0.1},
            ("dpsgd", "noise_multiplier"),
            "finite_number",
        )
        for v in NON_FINITE
    ],
    *[
        ({"type": "dpsgd", "noise_multiplier": 1.0, "steps": 1, "sampling_rate": v}, ("dpsgd", "sampling_rate"), "finite_number")
        for v in NON_FINITE
    ],
    *[
        ({"type": "poisson_sampled", "sampling_rate": v, "event": G1}, ("poisson_sampled", "sampling_rate"), "finite_number")
        for v in NON_FINITE
    ],
    *[
        ({"type": "repeat_and_select", "mean": v, "shape": 1, "event": G1}, ("repeat_and_select", "mean"), "finite_number")
        for v in NON_FINITE
    ],
    # negative and zero noise
    ({"type": "gaussian", "noise_multiplier": -1.0}, ("gaussian", "noise_multiplier"), "greater_than"),
    ({"type": "gaussian", "noise_multiplier": 0.0}, ("gaussian", "noise_multiplier"), "greater_than"),
    ({"type": "gaussian", "noise_multiplier": -0.0}, ("gaussian", "noise_multiplier"), "greater_than"),
    ({"type": "laplace", "noise_multiplier": -2}, ("laplace", "noise_multiplier"), "greater_than"),
    ({"type": "laplace", "noise_multiplier": 0}, ("laplace", "noise_multiplier"), "greater_than"),
    ({"type": "dpsgd", "noise_multiplier": 0.0, "steps": 1, "sampling_rate": 0.1}, ("dpsgd", "noise_multiplier"), "greater_than"),
    (
        {"type": "dpsgd", "noise_multiplier": -1e-9, "steps": 1, "sampling_rate": 0.1},
        ("dpsgd", "noise_multiplier"),
        "greater_than",
    ),
    ({"type": "zcdp", "rho": 0.0}, ("zcdp", "rho"), "greater_than"),
    ({"type": "zcdp", "rho": -1.0}, ("zcdp", "rho"), "greater_than"),
    ({"type": "zcdp", "rho": 0.1, "xi": -0.1}, ("zcdp", "xi"), "greater_than_equal"),
    # sampling rates outside (0, 1]
    (
        {"type": "poisson_sampled", "sampling_rate": 1.0000001, "event": G1},
        ("poisson_sampled", "sampling_rate"),
        "less_than_equal",
    ),
    ({"type": "poisson_sampled", "sampling_rate": 2, "event": G1}, ("poisson_sampled", "sampling_rate"), "less_than_equal"),
    ({"type": "poisson_sampled", "sampling_rate": 0, "event": G1}, ("poisson_sampled", "sampling_rate"), "greater_than"),
    ({"type": "poisson_sampled", "sampling_rate": -0.5, "event": G1}, ("poisson_sampled", "sampling_rate"), "greater_than"),
    ({"type": "dpsgd", "noise_multiplier": 1, "steps": 1, "sampling_rate": 1.5}, ("dpsgd", "sampling_rate"), "less_than_equal"),
    ({"type": "dpsgd", "noise_multiplier": 1, "steps": 1, "sampling_rate": 0.0}, ("dpsgd", "sampling_rate"), "greater_than"),
    ({"type": "dpsgd", "noise_multiplier": 1, "steps": 1, "sampling_rate": -0.01}, ("dpsgd", "sampling_rate"), "greater_than"),
    # counts: steps 0 and 10^12, self-composition count 0, absurd sizes
    ({"type": "dpsgd", "noise_multiplier": 1, "steps": 0, "sampling_rate": 0.1}, ("dpsgd", "steps"), "greater_than_equal"),
    ({"type": "dpsgd", "noise_multiplier": 1, "steps": 10**12, "sampling_rate": 0.1}, ("dpsgd", "steps"), "less_than_equal"),
    (
        {"type": "dpsgd", "noise_multiplier": 1, "steps": MAX_COUNT + 1, "sampling_rate": 0.1},
        ("dpsgd", "steps"),
        "less_than_equal",
    ),
    ({"type": "dpsgd", "noise_multiplier": 1, "steps": 1, "batch_size": 0}, ("dpsgd", "batch_size"), "greater_than_equal"),
    ({"type": "dpsgd", "noise_multiplier": 1, "steps": 1, "batch_size": 10**12 + 1}, ("dpsgd", "batch_size"), "less_than_equal"),
    ({"type": "self_composed", "count": 0, "event": G1}, ("self_composed", "count"), "greater_than_equal"),
    ({"type": "self_composed", "count": -3, "event": G1}, ("self_composed", "count"), "greater_than_equal"),
    ({"type": "self_composed", "count": 10**12, "event": G1}, ("self_composed", "count"), "less_than_equal"),
    (
        {"type": "sampled_without_replacement", "source_size": 0, "sample_size": 1, "event": G1},
        ("sampled_without_replacement", "source_size"),
        "greater_than_equal",
    ),
    (
        {"type": "sampled_without_replacement", "source_size": 10, "sample_size": 0, "event": G1},
        ("sampled_without_replacement", "sample_size"),
        "greater_than_equal",
    ),
    ({"type": "repeat_and_select", "mean": 0.5, "shape": 1, "event": G1}, ("repeat_and_select", "mean"), "greater_than_equal"),
    (
        {"type": "repeat_and_select", "mean": MAX_COUNT * 10, "shape": 1, "event": G1},
        ("repeat_and_select", "mean"),
        "less_than_equal",
    ),
    ({"type": "composed", "events": []}, ("composed", "events"), "too_short"),
    ({"type": "composed", "events": [G1] * (MAX_COMPOSED + 1)}, ("composed", "events"), "too_long"),
    # missing and mistyped fields
    ({"type": "gaussian"}, ("gaussian", "noise_multiplier"), "missing"),
    ({"type": "self_composed", "event": G1}, ("self_composed", "count"), "missing"),
    ({"type": "self_composed", "count": 2}, ("self_composed", "event"), "missing"),
    ({"type": "poisson_sampled", "event": G1}, ("poisson_sampled",), "value_error"),  # neither rate nor expected batch
    ({"type": "poisson_sampled", "sampling_rate": True, "event": G1}, ("poisson_sampled", "sampling_rate"), "float_type"),
    ({"type": "dpsgd", "batch_size": True, "noise_multiplier": 1, "steps": 1}, ("dpsgd", "batch_size"), "int_type"),
    ({"type": "repeat_and_select", "mean": 2, "event": G1}, ("repeat_and_select", "shape"), "missing"),
    ({"type": "dpsgd", "noise_multiplier": 1, "sampling_rate": 0.1}, ("dpsgd", "steps"), "missing"),
    # strict: no string is a number
    ({"type": "gaussian", "noise_multiplier": "loud"}, ("gaussian", "noise_multiplier"), "float_type"),
    ({"type": "gaussian", "noise_multiplier": None}, ("gaussian", "noise_multiplier"), "float_type"),
    ({"type": "self_composed", "count": 2.5, "event": G1}, ("self_composed", "count"), "int_type"),
    ({"type": "dpsgd", "noise_multiplier": 1, "steps": 1, "batch_size": "ten"}, ("dpsgd", "batch_size"), "int_type"),
    ({"type": "composed", "events": G1}, ("composed", "events"), "list_type"),
    ({"type": "self_composed", "count": 2, "event": 5}, ("self_composed", "event"), "model_attributes_type"),
    # extra fields, at the top and nested
    ({"type": "gaussian", "noise_multiplier": 1, "sigma": 2}, ("gaussian", "sigma"), "extra_forbidden"),
    ({"type": "zcdp", "rho": 0.1, "mu": 2}, ("zcdp", "mu"), "extra_forbidden"),
    (
        {"type": "dpsgd", "noise_multiplier": 1, "steps": 1, "sampling_rate": 0.1, "epochs": 3},
        ("dpsgd", "epochs"),
        "extra_forbidden",
    ),
    # errors deep inside name the whole path down to the field
    (
        {"type": "self_composed", "count": 2, "event": {"type": "gaussian", "noise_multiplier": -1}},
        ("self_composed", "event", "gaussian", "noise_multiplier"),
        "greater_than",
    ),
    (
        {"type": "composed", "events": [G1, {"type": "dpsgd", "noise_multiplier": 1, "steps": 10**12, "sampling_rate": 0.1}]},
        ("composed", "events", 1, "dpsgd", "steps"),
        "less_than_equal",
    ),
    (
        {
            "type": "repeat_and_select",
            "mean": 3,
            "shape": 1,
            "event": {"type": "poisson_sampled", "sampling_rate": 1.5, "event": G1},
        },
        ("repeat_and_select", "event", "poisson_sampled", "sampling_rate"),
        "less_than_equal",
    ),
    (
        {"type": "poisson_sampled", "sampling_rate": 0.1, "event": {"type": "gaussian", "noise_multiplier": 1, "extra": 1}},
        ("poisson_sampled", "event", "gaussian", "extra"),
        "extra_forbidden",
    ),
]


@pytest.mark.parametrize(("raw", "loc", "kind"), BAD, ids=[f"{i}-{b[2]}-{'.'.join(map(str, b[1]))}" for i, b in enumerate(BAD)])
def test_a_bad_mechanism_is_refused_with_a_loc_naming_the_field(raw: dict[str, Any], loc: tuple[Any, ...], kind: str) -> None:
    errors = errors_of(raw)
    assert (errors[0]["loc"], errors[0]["type"]) == (loc, kind), errors
    # And the same mechanism as JSON text (the wire) is refused the same way, where JSON can carry it.
    if all((isinstance(v, float) and math.isfinite(v)) or not isinstance(v, float) for v in _leaves(raw)):
        assert errors_of(json.dumps(raw))[0]["loc"] == loc


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return [value]


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
@pytest.mark.parametrize(
    ("template", "loc"),
    [
        ('{{"type": "gaussian", "noise_multiplier": {}}}', ("gaussian", "noise_multiplier")),
        ('{{"type": "laplace", "noise_multiplier": {}}}', ("laplace", "noise_multiplier")),
        ('{{"type": "zcdp", "rho": 0.5, "xi": {}}}', ("zcdp", "xi")),
        ('{{"type": "dpsgd", "noise_multiplier": 1, "steps": 3, "sampling_rate": {}}}', ("dpsgd", "sampling_rate")),
        ('{{"type": "repeat_and_select", "mean": {}, "shape": 1, "event": {{"type": "laplace", "noise_multiplier": 1}}}}',
         ("repeat_and_select", "mean")),
    ],
)
def test_non_finite_json_numbers_are_refused_at_the_field(template: str, loc: tuple[str, ...], token: str) -> None:
    errors = errors_of(template.format(token))
    assert errors[0]["loc"] == loc
    assert errors[0]["type"] == "finite_number"


@pytest.mark.parametrize("shape", [math.inf, -math.inf, math.nan, "Infinity", "inf", -1, -1e-12])
def test_repeat_and_select_shape_is_finite_nonnegative_or_the_word_infinity(shape: Any) -> None:
    errors = errors_of({"type": "repeat_and_select", "mean": 3, "shape": shape, "event": G1})
    assert all(e["loc"][:2] == ("repeat_and_select", "shape") for e in errors), errors


@pytest.mark.parametrize(("shape", "value"), [(0, 0.0), (1, 1.0), (0.5, 0.5), (2, 2.0), ("infinity", math.inf)])
def test_repeat_and_select_shapes_are_accepted_and_map_onto_dp_accounting(shape: Any, value: float) -> None:
    m = ADAPTER.validate_python({"type": "repeat_and_select", "mean": 3.5, "shape": shape, "event": G1})
    assert isinstance(m, RepeatAndSelect)
    assert m.shape_value == value
    assert to_dp_event(m) == de.RepeatAndSelectDpEvent(de.GaussianDpEvent(1.0), 3.5, value)


@pytest.mark.parametrize("tag", ["exponential", "Gaussian", "GAUSSIAN", "", 3, None])
def test_an_unknown_type_is_refused_naming_the_type_tag(tag: Any) -> None:
    errors = errors_of({"type": tag, "noise_multiplier": 1.0})
    # A discriminated union reports an unknown tag at the mechanism itself; the message names `type`.
    assert errors[0]["loc"] == ()
    assert errors[0]["type"] == "union_tag_invalid"
    assert "'type'" in errors[0]["msg"]


def test_a_missing_type_is_refused_naming_the_type_tag() -> None:
    errors = errors_of({"noise_multiplier": 1.0})
    assert (errors[0]["loc"], errors[0]["type"]) == ((), "union_tag_not_found")
    assert "'type'" in errors[0]["msg"]


def test_an_unknown_nested_type_is_refused_at_the_nested_event() -> None:
    errors = errors_of({"type": "self_composed", "count": 2, "event": {"type": "exponential", "epsilon": 1}})
    assert (errors[0]["loc"], errors[0]["type"]) == (("self_composed", "event"), "union_tag_invalid")


def test_dpsgd_needs_a_sampling_rate_or_a_batch_size() -> None:
    errors = errors_of({"type": "dpsgd", "noise_multiplier": 1, "steps": 1})
    assert (errors[0]["loc"], errors[0]["type"]) == (("dpsgd",), "value_error")
    assert "sampling_rate" in errors[0]["msg"] and "batch_size" in errors[0]["msg"]


def test_a_sample_larger_than_its_source_is_refused_naming_both_sizes() -> None:
    errors = errors_of({"type": "sampled_without_replacement", "source_size": 10, "sample_size": 11, "event": G1})
    assert (errors[0]["loc"], errors[0]["type"]) == (("sampled_without_replacement",), "value_error")
    assert "sample_size" in errors[0]["msg"] and "source_size=10" in errors[0]["msg"] and "11" in errors[0]["msg"]
    # equal sizes (q = 1) are fine
    assert ADAPTER.validate_python({"type": "sampled_without_replacement", "source_size": 10, "sample_size": 10, "event": G1})


@pytest.mark.parametrize(
    "good",
    [
        {"type": "dpsgd", "noise_multiplier": 1, "steps": MAX_COUNT, "sampling_rate": 1.0},
        {"type": "self_composed", "count": MAX_COUNT, "event": G1},
        {"type": "self_composed", "count": 1, "event": G1},
        {"type": "composed", "events": [G1] * MAX_COMPOSED},
        {"type": "repeat_and_select", "mean": 1, "shape": 0, "event": G1},
        {"type": "poisson_sampled", "sampling_rate": 1, "event": G1},
        {"type": "zcdp", "rho": 1e-9},
    ],
)
def test_the_bounds_themselves_are_accepted(good: dict[str, Any]) -> None:
    assert ADAPTER.validate_python(good) is not None


def test_mechanisms_are_frozen() -> None:
    m = Gaussian(noise_multiplier=1.0)
    with pytest.raises(ValidationError):
        m.noise_multiplier = 0.0  # type: ignore[misc]
    assert m.noise_multiplier == 1.0


# --- nesting: refused on the raw JSON, before pydantic recurses -------------------------------------


def test_nesting_of_exactly_max_is_accepted_and_one_more_is_refused() -> None:
    assert MAX_NESTING == 8
    ok = chain(8)
    assert check_nesting(ok) is ok
    assert nesting_depth(ADAPTER.validate_python(ok)) == 8
    with pytest.raises(ValueError, match=r"at most 8 levels deep\. Found 9\."):
        check_nesting(chain(9))


def test_nesting_counts_the_deepest_branch_of_a_composition() -> None:
    shallow = chain(2)
    ok = {"type": "composed", "events": [shallow, chain(7), shallow]}  # 1 + 7
    assert check_nesting(ok) is ok
    assert nesting_depth(ADAPTER.validate_python(ok)) == 8
    bad = {"type": "composed", "events": [shallow, shallow, chain(8)]}  # 1 + 8
    with pytest.raises(ValueError, match="Found 9"):
        check_nesting(bad)
    # depth through every kind of wrapper counts the same
    mixed = {"type": "repeat_and_select", "mean": 2, "shape": 1, "event": {
        "type": "composed", "events": [{"type": "poisson_sampled", "sampling_rate": 0.1, "event": chain(6)}]}}
    assert nesting_depth(ADAPTER.validate_python(mixed)) == 9  # pydantic alone would take it
    with pytest.raises(ValueError, match="Found 9"):
        check_nesting(mixed)


def test_absurd_nesting_is_refused_without_recursing_to_the_bottom() -> None:
    deep = chain(50_000)  # far past Python's recursion limit
    with pytest.raises(ValueError, match="at most 8 levels deep"):
        check_nesting(deep)
    wide_and_deep = {"type": "composed", "events": [chain(3)] * 500 + [chain(50_000)]}
    with pytest.raises(ValueError, match="at most 8 levels deep"):
        check_nesting(wide_and_deep)


def test_check_nesting_agrees_with_the_depth_of_the_validated_model() -> None:
    rng = random.Random(7)
    for _ in range(200):
        raw = random_raw(rng, depth=rng.randint(1, 10))
        try:
            check_nesting(raw)
            accepted = True
        except ValueError:
            accepted = False
        depth = nesting_depth(ADAPTER.validate_python(raw))
        assert accepted == (depth <= MAX_NESTING), (depth, raw)


# --- resolve: q = batch_size / dataset_size, computed by the service ------------------------------


def test_resolve_fills_the_sampling_rate_exactly() -> None:
    for batch, size in [(150, 60000), (1, 3), (7, 7), (64, 10**12), (333, 1000)]:
        m = resolve(DpSgd(noise_multiplier=1.0, steps=10, batch_size=batch), dataset_size=size)
        assert isinstance(m, DpSgd)
        assert m.sampling_rate == batch / size
        assert m.batch_size == batch and m.noise_multiplier == 1.0 and m.steps == 10


def test_resolve_accepts_an_agreeing_rate_and_replaces_it_with_the_exact_one() -> None:
    m = resolve(DpSgd(noise_multiplier=1.0, steps=1, batch_size=1, sampling_rate=1 / 3 * (1 + 1e-12)), dataset_size=3)
    assert m.sampling_rate == 1 / 3  # type: ignore[union-attr]


def test_resolve_refuses_a_disagreeing_rate_naming_the_field() -> None:
    with pytest.raises(MechanismError) as caught:
        resolve(DpSgd(noise_multiplier=1.0, steps=1, batch_size=150, sampling_rate=0.003), dataset_size=60000)
    assert caught.value.field == "mechanism.sampling_rate"
    assert "0.0025" in caught.value.message and "0.003" in caught.value.message


@pytest.mark.parametrize(
    ("wrap", "path"),
    [
        (lambda d: SelfComposed(count=3, event=d), "mechanism.event.sampling_rate"),
        (lambda d: RepeatAndSelect(event=d, mean=4, shape=1), "mechanism.event.sampling_rate"),
        (lambda d: Composed(events=[Gaussian(noise_multiplier=1), d]), "mechanism.events.1.sampling_rate"),
        (lambda d: SelfComposed(count=2, event=Composed(events=[d])), "mechanism.event.events.0.sampling_rate"),
    ],
)
def test_resolve_names_the_nested_path_of_a_disagreeing_rate(wrap: Any, path: str) -> None:
    bad = DpSgd(noise_multiplier=1.0, steps=1, batch_size=10, sampling_rate=0.5)
    with pytest.raises(MechanismError) as caught:
        resolve(wrap(bad), dataset_size=1000)
    assert caught.value.field == path
    assert str(caught.value).startswith(path + ": ")


def test_resolve_fills_nested_rates_and_leaves_everything_else_alone() -> None:
    inner = DpSgd(noise_multiplier=2.0, steps=5, batch_size=10)
    m = Composed(
        events=[Laplace(noise_multiplier=1), SelfComposed(count=2, event=inner), RepeatAndSelect(event=inner, mean=2, shape=0)]
    )
    r = resolve(m, dataset_size=1000)
    assert isinstance(r, Composed)
    assert r.events[0] == Laplace(noise_multiplier=1)
    assert r.events[1].event.sampling_rate == 0.01  # type: ignore[union-attr]
    assert r.events[2].event.sampling_rate == 0.01  # type: ignore[union-attr]
    assert m.events[1].event.sampling_rate is None  # type: ignore[union-attr]  # the input is not mutated


def test_resolve_refuses_a_batch_larger_than_the_dataset() -> None:
    with pytest.raises(MechanismError) as caught:
        resolve(DpSgd(noise_multiplier=1.0, steps=1, batch_size=1001), dataset_size=1000)
    assert caught.value.field == "mechanism.batch_size"
    assert "1000" in caught.value.message and "1001" in caught.value.message
    with pytest.raises(MechanismError) as nested:
        resolve(SelfComposed(count=2, event=DpSgd(noise_multiplier=1.0, steps=1, batch_size=1001)), dataset_size=1000)
    assert nested.value.field == "mechanism.event.batch_size"


def test_resolve_refuses_a_batch_size_with_no_dataset_size() -> None:
    with pytest.raises(MechanismError) as caught:
        resolve(DpSgd(noise_multiplier=1.0, steps=1, batch_size=10), dataset_size=None)
    assert caught.value.field == "mechanism.batch_size"
    with pytest.raises(MechanismError) as nested:
        resolve(Composed(events=[DpSgd(noise_multiplier=1.0, steps=1, batch_size=10)]), dataset_size=None)
    assert nested.value.field == "mechanism.events.0.batch_size"


def test_resolve_leaves_a_rate_only_dpsgd_as_declared() -> None:
    m = DpSgd(noise_multiplier=1.0, steps=1, sampling_rate=0.25)
    assert resolve(m, dataset_size=None) == m
    assert resolve(m, dataset_size=10) == m


def test_an_unresolved_dpsgd_has_no_dp_event() -> None:
    with pytest.raises(MechanismError) as caught:
        to_dp_event(DpSgd(noise_multiplier=1.0, steps=1, batch_size=10))
    assert caught.value.field == "mechanism.sampling_rate"


# --- the one-to-one map onto dp_accounting events ----------------------------------------------------


def test_every_kind_maps_onto_its_dp_accounting_event() -> None:
    g = Gaussian(noise_multiplier=1.5)
    cases = [
        (g, de.GaussianDpEvent(1.5)),
        (Laplace(noise_multiplier=2.0), de.LaplaceDpEvent(2.0)),
        (PoissonSampled(sampling_rate=0.01, event=g), de.PoissonSampledDpEvent(0.01, de.GaussianDpEvent(1.5))),
        (SampledWithoutReplacement(source_size=100, sample_size=7, event=g),
         de.SampledWithoutReplacementDpEvent(100, 7, de.GaussianDpEvent(1.5))),
        (SelfComposed(count=9, event=g), de.SelfComposedDpEvent(de.GaussianDpEvent(1.5), 9)),
        (Composed(events=[g, Laplace(noise_multiplier=3)]),
         de.ComposedDpEvent([de.GaussianDpEvent(1.5), de.LaplaceDpEvent(3.0)])),
        (ZCdp(rho=0.2), de.ZCDpEvent(0.2, 0.0)),
        (ZCdp(rho=0.2, xi=0.1), de.ZCDpEvent(0.2, 0.1)),
        (RepeatAndSelect(event=g, mean=10, shape=0.5), de.RepeatAndSelectDpEvent(de.GaussianDpEvent(1.5), 10.0, 0.5)),
        (DpSgd(noise_multiplier=1.5, steps=100, sampling_rate=0.01),
         de.SelfComposedDpEvent(de.PoissonSampledDpEvent(0.01, de.GaussianDpEvent(1.5)), 100)),
    ]
    for m, event in cases:
        assert to_dp_event(m) == event, m


# --- round trip: a stored mechanism reads the same later --------------------------------------------

SIGMAS = [1.0, 0.1 + 0.2, 1e-300, 5e-324, 123456.789, 1 / 3, 2.0**-40]


def random_raw(rng: random.Random, depth: int) -> dict[str, Any]:
    """A raw (JSON-like) mechanism of exactly `depth` levels, over every kind and awkward floats."""
    if depth <= 1:
        kind = rng.choice(["gaussian", "laplace", "zcdp", "dpsgd_rate", "dpsgd_batch", "dpsgd_both"])
        if kind in ("gaussian", "laplace"):
            return {"type": kind, "noise_multiplier": rng.choice([*SIGMAS, rng.uniform(0.1, 10)])}
        if kind == "zcdp":
            raw: dict[str, Any] = {"type": "zcdp", "rho": rng.choice([0.1 + 0.2, 1e-9, rng.random() + 1e-3])}
            if rng.random() < 0.5:
                raw["xi"] = rng.choice([0, 0.0, 1e-7, rng.random()])
            return raw
        raw = {"type": "dpsgd", "noise_multiplier": rng.choice(SIGMAS), "steps": rng.choice([1, 7, MAX_COUNT])}
        if kind in ("dpsgd_rate", "dpsgd_both"):
            raw["sampling_rate"] = rng.choice([1.0, 1 / 3, 0.0025, rng.random() + 1e-9])
        if kind in ("dpsgd_batch", "dpsgd_both"):
            raw["batch_size"] = rng.randint(1, 10**12)
        return raw
    inner = random_raw(rng, depth - 1)
    kind = rng.choice(["poisson", "wor", "self", "composed", "rs"])
    if kind == "poisson":
        return {"type": "poisson_sampled", "sampling_rate": rng.choice([1, 1 / 7, rng.random() + 1e-12]), "event": inner}
    if kind == "wor":
        n = rng.randint(1, 10**12)
        return {"type": "sampled_without_replacement", "source_size": n, "sample_size": rng.randint(1, n), "event": inner}
    if kind == "self":
        return {"type": "self_composed", "count": rng.randint(1, MAX_COUNT), "event": inner}
    if kind == "composed":
        others = [random_raw(rng, rng.randint(1, depth - 1)) for _ in range(rng.randint(0, 3))]
        events = [*others, inner]
        rng.shuffle(events)
        return {"type": "composed", "events": events}
    return {"type": "repeat_and_select", "event": inner, "mean": rng.choice([1, 1.5, 1 / 3 + 10, MAX_COUNT]),
            "shape": rng.choice([0, 1, 0.5, 2, "infinity", 1e300])}


def test_a_stored_mechanism_reads_back_equal() -> None:
    rng = random.Random(20240611)
    for _ in range(300):
        m = ADAPTER.validate_python(random_raw(rng, depth=rng.randint(1, MAX_NESTING)))
        stored = m.model_dump_json()
        again = ADAPTER.validate_json(stored)
        assert again == m
        assert type(again) is type(m)
        # byte-identical when stored again: the cache key and the request hash must not drift
        assert again.model_dump_json() == stored
        # and through a generic JSON layer (what a database text column and a client do)
        assert ADAPTER.validate_python(json.loads(stored)) == m
        assert ADAPTER.validate_python(copy.deepcopy(m.model_dump())) == m


def test_round_trip_keeps_awkward_floats_bit_for_bit() -> None:
    for sigma in SIGMAS:
        m = SelfComposed(count=3, event=Gaussian(noise_multiplier=sigma))
        back = ADAPTER.validate_json(m.model_dump_json())
        assert back.event.noise_multiplier == sigma
        assert math.copysign(1, back.event.noise_multiplier) == 1
    rs = RepeatAndSelect(event=Laplace(noise_multiplier=1), mean=3, shape="infinity")
    back = ADAPTER.validate_json(rs.model_dump_json())
    assert back == rs and back.shape == "infinity" and back.shape_value == math.inf


def test_a_resolved_dpsgd_round_trips_and_resolves_again_to_itself() -> None:
    m = resolve(Composed(events=[DpSgd(noise_multiplier=1.3, steps=6000, batch_size=150)]), dataset_size=60000)
    back = ADAPTER.validate_json(m.model_dump_json())
    assert back == m
    assert resolve(back, dataset_size=60000) == m
    assert to_dp_event(back) == to_dp_event(m)
