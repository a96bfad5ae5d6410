"""Merging Harbor's compose layers into one project and interpolating only Harbor's variables
(``aenv.integrations.compose_layers``)."""

from __future__ import annotations

from aenv.integrations.compose_layers import interpolate, merge_files


def test_services_merge_recursively_later_file_wins() -> None:
    base = {"services": {"main": {"image": "debian:bookworm", "command": ["sh", "-c", "sleep infinity"]}}}
    task = {
        "services": {
            "main": {"depends_on": ["app"], "command": ["bash"]},
            "app": {"image": "aenv/counter-app:1", "ports": ["8080:8080"]},
        },
        "volumes": {"data": {}},
    }
    out = merge_files([base, task])
    assert out["services"]["main"] == {
        "image": "debian:bookworm",
        "command": ["bash"],  # replaced, not appended
        "depends_on": ["app"],
    }
    assert out["services"]["app"]["ports"] == ["8080:8080"]
    assert out["volumes"] == {"data": {}}
    assert base["services"]["main"]["command"] == ["sh", "-c", "sleep infinity"]  # inputs untouched


def test_keyed_lists_merge_by_key_in_either_form() -> None:
    a = {"services": {"s": {"environment": ["A=1", "B=2", "FLAG"], "labels": {"x": "1"}}}}
    b = {"services": {"s": {"environment": {"B": "3", "C": "4"}, "labels": ["y=2"]}}}
    s = merge_files([a, b])["services"]["s"]
    assert s["environment"] == {"A": "1", "B": "3", "FLAG": None, "C": "4"}
    assert s["labels"] == {"x": "1", "y": "2"}


def test_first_seen_keyed_list_becomes_a_mapping() -> None:
    s = merge_files([{"services": {"s": {"environment": ["A=1"], "extra_hosts": ["db:10.0.0.2"]}}}])["services"]["s"]
    assert s["environment"] == {"A": "1"}
    assert s["extra_hosts"] == {"db": "10.0.0.2"}


def test_depends_on_list_and_mapping_forms_merge() -> None:
    a = {"services": {"main": {"depends_on": ["redis"]}}}
    b = {"services": {"main": {"depends_on": {"app": {"condition": "service_healthy"}}}}}
    assert merge_files([a, b])["services"]["main"]["depends_on"] == {
        "redis": {"condition": "service_started"},
        "app": {"condition": "service_healthy"},
    }


def test_volumes_replace_by_target_other_lists_append_once() -> None:
    a = {"services": {"s": {"volumes": ["data:/data", {"type": "volume", "source": "x", "target": "/x"}],
                            "ports": ["80:80"], "healthcheck": {"test": ["CMD", "a"], "interval": "1s"}}}}  # fmt: skip
    b = {"services": {"s": {"volumes": ["other:/data"], "ports": ["80:80", "81:81"],
                            "healthcheck": {"test": ["CMD", "b"]}}}}  # fmt: skip
    s = merge_files([a, b])["services"]["s"]
    assert s["volumes"] == ["other:/data", {"type": "volume", "source": "x", "target": "/x"}]
    assert s["ports"] == ["80:80", "81:81"]
    assert s["healthcheck"] == {"test": ["CMD", "b"], "interval": "1s"}


def test_null_in_a_later_file_keeps_the_earlier_value() -> None:
    out = merge_files([{"services": {"s": {"image": "a"}}}, {"services": {"s": None}}])
    assert out["services"]["s"] == {"image": "a"}


def test_interpolation_substitutes_only_given_variables() -> None:
    env = {"MAIN_IMAGE_NAME": "hb__task", "EMPTY": "", "PRICE": "5$"}
    tree = {
        "services": {
            "${MAIN_IMAGE_NAME}-svc": {
                "image": "${MAIN_IMAGE_NAME}:latest",
                "command": "echo $$HOME $HOME ${UNSET} ${UNSET:-dflt} ${EMPTY:-e} ${EMPTY-kept} $MAIN_IMAGE_NAME",
                "ports": [8080, True],
                "environment": {"PRICE": "${PRICE}"},
            }
        }
    }
    svc = interpolate(tree, env)["services"]["hb__task-svc"]
    assert svc["image"] == "hb__task:latest"
    assert svc["command"] == "echo $$HOME $HOME ${UNSET} dflt e  hb__task"
    assert svc["ports"] == [8080, True]
    assert svc["environment"] == {"PRICE": "5$$"}  # Compose's second pass reads it back as "5$"
